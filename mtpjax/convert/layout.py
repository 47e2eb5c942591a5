"""Where every mtpjax parameter lives in a Hugging Face checkpoint (Qwen2 / MiMo / Llama names), both ways.

One table serves export and import. Our kernels are [in, out], theirs [out, in]. MiMo's MTP layer
(vLLM `MiMoMultiTokenPredictorLayer`, SGLang `MiMoMTP`) computes input_proj([hidden_layernorm(h);
token_layernorm(e)]) while ours computes eh_proj([enorm(e); hnorm(h)]), so input_proj is eh_proj
transposed with its two input halves swapped. The checkpoint stores an MTP block's parameters directly
under `model.mtp_layers.{k}.` (the engines insert `mtp_block.` when loading).

DeepSeek-V3 (`deepseek_v3`): MLA attention, dense or MoE MLPs (one tensor per expert), MTP module k as layer
L+k-1 with its own copies of the embedding and head (`shared_head`). DeepSeek's engines and `transformers`
(rope_interleave) rotate interleaved pairs (2i, 2i+1) where mtpjax rotates halves (i, i+r/2), so the RoPE rows
of q_b_proj / q_proj and kv_a_proj_with_mqa are permuted on the way out (and back in).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from mtpjax.config import ModelConfig

FORMATS = ("qwen2", "llama", "deepseek_v3")

# (name inside a decoder layer, our path inside a Block, kind)
_BLOCK = (
    ("input_layernorm.weight", ("attn_norm", "scale"), "copy"),
    ("self_attn.q_proj.weight", ("attn", "wq", "kernel"), "t"),
    ("self_attn.k_proj.weight", ("attn", "wk", "kernel"), "t"),
    ("self_attn.v_proj.weight", ("attn", "wv", "kernel"), "t"),
    ("self_attn.o_proj.weight", ("attn", "wo", "kernel"), "t"),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), "copy"),
    ("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), "t"),
    ("mlp.up_proj.weight", ("mlp", "up", "kernel"), "t"),
    ("mlp.down_proj.weight", ("mlp", "down", "kernel"), "t"),
)
_QKV = (("q", "wq"), ("k", "wk"), ("v", "wv"))
_MTP = (
    ("token_layernorm.weight", ("enorm", "scale"), "copy"),
    ("hidden_layernorm.weight", ("hnorm", "scale"), "copy"),
    ("input_proj.weight", ("eh_proj", "kernel"), "eh"),
    ("final_layernorm.weight", ("norm", "scale"), "copy"),
)


class Tensor(NamedTuple):
    """One Hugging Face tensor: its name and shape, our leaf (path, layer index if stacked) and the transform."""

    hf: str
    shape: tuple
    path: tuple | None  # None: a zero bias the format has and our model does not
    layer: int | None  # index into the leaf's leading layer axis (scanned trunk)
    kind: str  # copy | t (transpose) | eh (MiMo input_proj) | zeros | rope (transpose, RoPE rows interleaved)
    expert: int | None = None  # index into the leaf's expert axis (after the layer's)
    rope: tuple = ()  # kind rope: (rows per group, RoPE rows at the end of each group)
    shared: bool = False  # a second copy of a leaf written before (DeepSeek's per-module embedding and head)

    @property
    def index(self) -> tuple:
        """The leading indices that take this tensor out of its leaf."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def leaf(tree: dict, path: tuple):
    """The subtree of a nested dict at `path`."""
    for p in path:
        tree = tree[p]
    return tree


def tensors(cfg: ModelConfig, shapes: dict, fmt: str, mtp_modules: int, interleave: bool = True) -> list[Tensor]:
    """The checkpoint's tensors in file order. `shapes`: the model's pure-dict tree of leaf shapes.

    qwen2 has q/k/v biases (written as zeros when model.qkv_bias is off); llama with model.qkv_bias
    sets attention_bias, which also puts a bias on o_proj (written as zeros). deepseek_v3 with `interleave`
    off: a checkpoint whose config says rope_interleave=false, RoPE rows as ours.
    """
    if fmt == "deepseek_v3":
        return deepseek_tensors(cfg, shapes, mtp_modules, interleave)
    out: list[Tensor] = []

    def add(hf: str, path: tuple, kind: str, layer: int | None = None):
        out.append(tensor(shapes, hf, path, kind, layer))

    def block(prefix: str, base: tuple, layer: int | None):
        for name, sub, kind in _BLOCK:
            add(prefix + name, base + sub, kind, layer)
            if name.startswith("self_attn.v_proj"):
                biases(prefix, base, layer)

    def biases(prefix: str, base: tuple, layer: int | None):
        if not cfg.qkv_bias and fmt == "llama":
            return
        for letter, ours in _QKV:
            if cfg.qkv_bias:
                add(f"{prefix}self_attn.{letter}_proj.bias", base + ("attn", ours, "bias"), "copy", layer)
            else:
                width = tuple(leaf(shapes, base + ("attn", ours, "kernel")))[-1]
                out.append(Tensor(f"{prefix}self_attn.{letter}_proj.bias", (width,), None, None, "zeros"))
        if fmt == "llama":
            out.append(Tensor(f"{prefix}self_attn.o_proj.bias", (cfg.d_model,), None, None, "zeros"))

    add("model.embed_tokens.weight", ("embed",), "copy")
    for i in range(cfg.n_layers):
        if cfg.scan_layers:
            block(f"model.layers.{i}.", ("blocks",), i)
        else:
            block(f"model.layers.{i}.", ("blocks", i), None)
    add("model.norm.weight", ("final_norm", "scale"), "copy")
    if not cfg.tie_embeddings:
        add("lm_head.weight", ("head",), "t")
    for k in range(mtp_modules):
        prefix = f"model.mtp_layers.{k}."
        for name, sub, kind in _MTP:
            add(prefix + name, ("mtp", k) + sub, kind)
        block(prefix, ("mtp", k, "block"), None)
    return out


_DS_ATTN = (("q_a_proj", "q_a", "t"), ("q_a_layernorm", "q_a_norm", "copy"), ("q_b_proj", "q_b", "q"),
            ("q_proj", "q_proj", "q"), ("kv_a_proj_with_mqa", "kv_a", "kv"), ("kv_a_layernorm", "kv_a_norm", "copy"),
            ("kv_b_proj", "kv_b", "t"), ("o_proj", "wo", "t"))
_DS_MTP = (("enorm.weight", ("enorm", "scale"), "copy"), ("hnorm.weight", ("hnorm", "scale"), "copy"),
           ("eh_proj.weight", ("eh_proj", "kernel"), "t"), ("shared_head.norm.weight", ("norm", "scale"), "copy"))
_SWIGLU = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))


def deepseek_tensors(cfg: ModelConfig, shapes: dict, mtp_modules: int, interleave: bool = True) -> list[Tensor]:
    """The DeepSeek-V3 layout's tensors in file order (an MoE leaf's experts one after another)."""
    out: list[Tensor] = []
    rope = {"q": (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim),
            "kv": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim)}

    def add(hf: str, path: tuple, kind: str, layer=None, expert=None, shared=False):
        if kind in rope:
            kind, r = ("rope", rope[kind]) if interleave else ("t", ())
        else:
            r = ()
        out.append(tensor(shapes, hf, path, kind, layer, expert, r, shared))

    def head(name: str, shared: bool):
        if cfg.tie_embeddings:
            add(name, ("embed",), "copy", shared=True)
        else:
            add(name, ("head",), "t", shared=shared)

    add("model.embed_tokens.weight", ("embed",), "copy")
    for i in range(cfg.n_layers):
        _ds_block(add, shapes, cfg.n_routed_experts, f"model.layers.{i}.",
                  ("blocks",) if cfg.scan_layers else ("blocks", i), i if cfg.scan_layers else None)
    add("model.norm.weight", ("final_norm", "scale"), "copy")
    head("lm_head.weight", False)
    for k in range(mtp_modules):
        prefix = f"model.layers.{cfg.n_layers + k}."
        for name, sub, kind in _DS_MTP:
            add(prefix + name, ("mtp", k) + sub, kind)
        add(prefix + "embed_tokens.weight", ("embed",), "copy", shared=True)
        head(prefix + "shared_head.head.weight", True)
        _ds_block(add, shapes, cfg.n_routed_experts, prefix, ("mtp", k, "block"), None)
    return out


def _ds_block(add, shapes: dict, n_experts: int, prefix: str, base: tuple, layer: int | None) -> None:
    """One decoder block's tensors through `add`: attention, then the dense MLP or the experts one after another."""
    add(prefix + "input_layernorm.weight", base + ("attn_norm", "scale"), "copy", layer)
    attn = leaf(shapes, base + ("attn",))
    for name, ours, kind in _DS_ATTN:
        if ours in attn:
            add(f"{prefix}self_attn.{name}.weight", base + ("attn", ours, "kernel" if kind != "copy" else "scale"),
                kind, layer)
    add(prefix + "post_attention_layernorm.weight", base + ("mlp_norm", "scale"), "copy", layer)
    mlp = leaf(shapes, base + ("mlp",))
    if "router" not in mlp:
        for name, ours in _SWIGLU:
            add(f"{prefix}mlp.{name}.weight", base + ("mlp", ours, "kernel"), "t", layer)
        return
    add(prefix + "mlp.gate.weight", base + ("mlp", "router"), "t", layer)
    add(prefix + "mlp.gate.e_score_correction_bias", base + ("mlp", "bias"), "copy", layer)
    for name, ours in _SWIGLU:
        for e in range(n_experts):
            add(f"{prefix}mlp.experts.{e}.{name}.weight", base + ("mlp", f"w_{ours}"), "t", layer, e)
    if "shared" in mlp:
        for name, ours in _SWIGLU:
            add(f"{prefix}mlp.shared_experts.{name}.weight", base + ("mlp", "shared", ours, "kernel"), "t", layer)


def mtp_index(fmt: str, n_layers: int, name: str) -> int | None:
    """The MTP module (0-based) a checkpoint tensor belongs to, None for the trunk's."""
    if fmt == "deepseek_v3":
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        return int(m[1]) - n_layers if m and int(m[1]) >= n_layers else None
    m = re.match(r"^model\.mtp_layers\.(\d+)\.", name)
    return int(m[1]) if m else None


def tensor(shapes: dict, hf: str, path: tuple, kind: str, layer: int | None = None, expert: int | None = None,
           rope: tuple = (), shared: bool = False) -> Tensor:
    """The Tensor of leaf `path` (indexed by layer and expert when given), its shape as the checkpoint holds it."""
    t = Tensor(hf, (), path, layer, kind, expert, rope, shared)
    shape = tuple(leaf(shapes, path))[len(t.index):]
    return t._replace(shape=shape[::-1] if kind in ("t", "eh", "rope") else shape)


def interleaved(rows: int, rope: int) -> np.ndarray:
    """Row order within a group of `rows` whose last `rope` rotate: checkpoint row j is our row order[j] (pairs
    (2i, 2i+1) in the checkpoint are our (i, i + rope/2))."""
    nope = rows - rope
    half = np.arange(rope // 2)
    return np.concatenate([np.arange(nope), nope + np.stack([half, half + rope // 2], 1).reshape(-1)])


def _rows(x: np.ndarray, rope: tuple, order: np.ndarray) -> np.ndarray:
    rows, _ = rope
    return x.reshape(-1, rows, *x.shape[1:])[:, order].reshape(x.shape)


def to_hf(t: Tensor, x) -> np.ndarray:
    """Our leaf (already indexed by layer) as the Hugging Face tensor."""
    if t.kind == "zeros":
        return np.zeros(t.shape, np.asarray(x).dtype)
    x = np.asarray(x)
    if t.kind == "t":
        return x.T
    if t.kind == "rope":
        return _rows(x.T, t.rope, interleaved(*t.rope))
    if t.kind == "eh":  # [e; h] rows -> input_proj [d, 2d] over [h; e]
        d = x.shape[1]
        return np.concatenate([x[d:], x[:d]], axis=0).T
    return x


def from_hf(t: Tensor, x: np.ndarray) -> np.ndarray:
    """The Hugging Face tensor as our leaf (the inverse of to_hf)."""
    if t.kind == "t":
        return x.T
    if t.kind == "rope":
        return _rows(x, t.rope, np.argsort(interleaved(*t.rope))).T
    if t.kind == "eh":
        k = x.T
        d = k.shape[1]
        return np.concatenate([k[d:], k[:d]], axis=0)
    return x
