"""Where every mtpjax parameter lives in a Hugging Face checkpoint (Qwen2 / MiMo / Llama names), both ways.

One table serves export and import. Our kernels are [in, out], theirs [out, in]. MiMo's MTP layer
(vLLM `MiMoMultiTokenPredictorLayer`, SGLang `MiMoMTP`) computes input_proj([hidden_layernorm(h);
token_layernorm(e)]) while ours computes eh_proj([enorm(e); hnorm(h)]), so input_proj is eh_proj
transposed with its two input halves swapped. The checkpoint stores an MTP block's parameters directly
under `model.mtp_layers.{k}.` (the engines insert `mtp_block.` when loading).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mtpjax.config import ModelConfig

FORMATS = ("qwen2", "llama")

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
    kind: str  # copy | t (transpose) | eh (MiMo input_proj) | zeros


def _get(tree: dict, path: tuple):
    for p in path:
        tree = tree[p]
    return tree


def tensors(cfg: ModelConfig, shapes: dict, fmt: str, mtp_modules: int) -> list[Tensor]:
    """The checkpoint's tensors in file order. `shapes`: the model's pure-dict tree of leaf shapes.

    qwen2 has q/k/v biases (written as zeros when model.qkv_bias is off); llama with model.qkv_bias
    sets attention_bias, which also puts a bias on o_proj (written as zeros).
    """
    out: list[Tensor] = []

    def add(hf: str, path: tuple, kind: str, layer: int | None = None):
        shape = tuple(_get(shapes, path))[0 if layer is None else 1:]
        out.append(Tensor(hf, shape[::-1] if kind in ("t", "eh") else shape, path, layer, kind))

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
                width = tuple(_get(shapes, base + ("attn", ours, "kernel")))[-1]
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


def to_hf(t: Tensor, x) -> np.ndarray:
    """Our leaf (already indexed by layer) as the Hugging Face tensor."""
    if t.kind == "zeros":
        return np.zeros(t.shape, np.asarray(x).dtype)
    x = np.asarray(x)
    if t.kind == "t":
        return x.T
    if t.kind == "eh":  # [e; h] rows -> input_proj [d, 2d] over [h; e]
        d = x.shape[1]
        return np.concatenate([x[d:], x[:d]], axis=0).T
    return x


def from_hf(t: Tensor, x: np.ndarray) -> np.ndarray:
    """The Hugging Face tensor as our leaf (the inverse of to_hf)."""
    if t.kind == "t":
        return x.T
    if t.kind == "eh":
        k = x.T
        d = k.shape[1]
        return np.concatenate([k[d:], k[:d]], axis=0)
    return x
