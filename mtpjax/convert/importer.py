"""Import a Llama / Qwen2 / DeepSeek-V3 safetensors checkpoint as a model-only run directory that `load_model` reads.

Layout written (the items `checkpoint.Checkpointer` writes, without optimizer or data state):
`OUT/config.yaml`, `OUT/tokenizer/`, `OUT/checkpoints/0/{model,meta}`. Tensors stream from memory-mapped
safetensors into orbax one at a time: a lazy leaf type whose handler writes leaves sequentially, so memory
holds a few tensors, not the model (orbax's own numpy path copies every array before writing any).
MTP modules present in the checkpoint (our own MiMo export, DeepSeek-V3's layers past the trunk) are read back;
the others start as `model.mtp_init` says. DeepSeek-V3's fp8 weights are dequantized by their block scales
(mtpjax.convert.fp8) each as it is written, into the run's dtype.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mtpjax.config import ConfigError, load_config
from mtpjax.convert import fp8, layout
from mtpjax.convert.errors import ConvertError
from mtpjax.convert.export import param_shapes, shape_tree, staged
from mtpjax.convert.hf_config import model_overrides, read_config
from mtpjax.convert.safetensors_io import FLOATS, Reader
from mtpjax.nn.model import MTPModule, mtp_from_last_block
from mtpjax.nn.placement import host_placement

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_QKV_BIAS = re.compile(r"self_attn\.[qkv]_proj\.bias$")
_O_BIAS = re.compile(r"self_attn\.o_proj\.bias$")


class Lazy:
    """A leaf produced on demand (shape and dtype known up front); `stack` keeps per-layer parts separate."""

    def __init__(self, shape, dtype, produce, parts: list | None = None):
        self.shape, self.dtype, self.produce, self.parts = tuple(shape), np.dtype(dtype), produce, parts
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape, dtype=np.int64))

    @classmethod
    def stack(cls, parts: list[Lazy]) -> Lazy:
        return cls((len(parts), *parts[0].shape), parts[0].dtype, lambda: np.stack([p.produce() for p in parts]), parts)

    @classmethod
    def nest(cls, parts: dict[tuple, Lazy]) -> Lazy:
        """One leaf from parts by their leading indices ((layer,), (expert,) or (layer, expert)), stacked in order."""
        if len(next(iter(parts))) == 1:
            return cls.stack([parts[i] for i in sorted(parts)])
        outer = sorted({i[0] for i in parts})
        return cls.stack([cls.nest({i[1:]: p for i, p in parts.items() if i[0] == o}) for o in outer])

    def __getitem__(self, i: int) -> Lazy:  # the last layer of a stacked trunk (mtp_init=last_block)
        return self.parts[i]


class _SequentialHandler(ocp.type_handlers.NumpyHandler):
    """Writes Lazy leaves one after another, each materialized just before its write and released after."""

    async def _background_serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        for value, info, arg in zip(values, infos, args):
            arr = np.ascontiguousarray(value.produce(), dtype=value.dtype)
            await super()._background_serialize([arr], [info], [arg])
            del arr


class _OwnRefusals(logging.Filter):
    """Drops orbax's logged traceback of a ConvertError raised in its writer threads (a digest mismatch found while
    a leaf is written): the error reaches the caller, which prints it as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ConvertError))


def save_model_checkpoint(run_dir: Path, params: dict, meta: dict) -> None:
    """`run_dir/checkpoints/0` with the items `model` (params: a pure dict of Lazy leaves) and `meta` (JSON)."""
    registry = ocp.type_handlers.create_type_handler_registry((Lazy, _SequentialHandler(deepcopy_host_arrays=False)))
    # float weights barely compress (~7%) and compression halves the write speed
    handlers = {"model": ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False),
                "meta": ocp.JsonCheckpointHandler()}
    mngr = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), item_handlers=handlers,
                                 options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    quiet, absl = _OwnRefusals(), logging.getLogger("absl")
    absl.addFilter(quiet)
    try:
        mngr.save(0, args=ocp.args.Composite(model=ocp.args.PyTreeSave(params), meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()
    finally:
        mngr.close()
        absl.removeFilter(quiet)


def _loaded_modules(reader: fp8.BlockScaled, fmt: str, n_layers: int) -> int:
    """How many MTP layers the checkpoint holds (model.mtp_layers.0 .. n-1, DeepSeek's model.layers.L .. L+n-1)."""
    found = {k for name in reader.entries if (k := layout.mtp_index(fmt, n_layers, name)) is not None}
    n = 0
    while n in found:
        n += 1
    return n


def _is_zero(reader: fp8.BlockScaled, names: list[str]) -> bool:
    return all(not np.any(reader.array(n)) for n in names)


def _has_qkv_bias(reader: fp8.BlockScaled) -> bool:
    """Whether the checkpoint has nonzero q/k/v biases (all-zero ones compute nothing); nonzero o_proj ones are
    refused."""
    o = [n for n in reader.entries if _O_BIAS.search(n)]
    if not _is_zero(reader, o):
        raise ConvertError("the checkpoint has attention output (o_proj) biases, which mtpjax cannot represent")
    return not _is_zero(reader, [n for n in reader.entries if _QKV_BIAS.search(n)])


def _leaf(reader: fp8.BlockScaled, t: layout.Tensor, dtype: np.dtype) -> Lazy:
    e = reader.entries[t.hf]
    if e.shape != t.shape:
        raise ConvertError(f"tensor {t.hf} has shape {list(e.shape)} but the config implies {list(t.shape)}; "
                           "the checkpoint does not match its config.json")
    if e.dtype not in FLOATS:
        raise ConvertError(f"tensor {t.hf} is {e.dtype}; import takes float checkpoints (not quantized ones)")
    shape = t.shape[::-1] if t.kind in ("t", "eh", "rope") else t.shape
    # a view: cast and copied once, when written
    return Lazy(shape, dtype, lambda: layout.from_hf(t, reader.array(t.hf)))


def _set(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _check_shared(reader: fp8.BlockScaled, t: layout.Tensor, first: layout.Tensor) -> None:
    """A second copy of a leaf (DeepSeek's per-module embedding and head) must equal the first: we keep one."""
    a, b = reader.array(t.hf), reader.array(first.hf)
    if a.shape != b.shape or not np.array_equal(a, b):
        raise ConvertError(f"tensor {t.hf} differs from {first.hf}; mtpjax's MTP modules share the trunk's embedding "
                           "and head, so it cannot represent this checkpoint")


def _params(cfg, reader: fp8.BlockScaled, fmt: str, loaded: int, has_bias: bool, interleave: bool = True) -> dict:
    """The model's pure-dict tree with Lazy leaves: HF tensors, then fresh MTP modules for the ones not loaded."""
    m = cfg.model
    if has_bias and not m.qkv_bias:
        raise ConvertError("model.qkv_bias=false would drop the checkpoint's nonzero q/k/v biases; leave it unset")
    shapes = param_shapes(cfg)
    tensors = layout.tensors(m, shape_tree(shapes), fmt, loaded, interleave)
    expected = {t.hf for t in tensors}
    extra = [n for n in reader.entries if n not in expected and not _IGNORED.search(n)
             and not _QKV_BIAS.search(n) and not _O_BIAS.search(n)  # checked to be zero
             and not (n == "lm_head.weight" and m.tie_embeddings)  # tied: transformers ignores it too
             and not ((k := layout.mtp_index(fmt, m.n_layers, n)) is not None and k >= loaded)]
    missing = [t.hf for t in tensors if t.kind != "zeros" and t.hf not in reader]
    if missing:
        raise ConvertError(f"the checkpoint lacks tensor {missing[0]} (and {len(missing) - 1} more) that its config "
                           "implies; it does not match its config.json")
    if extra:
        raise ConvertError(f"the checkpoint has tensor {extra[0]} (and {len(extra) - 1} more) that a "
                           f"{fmt} model of this config does not have; mtpjax cannot represent it")
    tree = _nested_copy(shapes)
    stacks: dict[tuple, dict] = {}
    firsts: dict[tuple, layout.Tensor] = {}
    for t in tensors:
        if t.kind == "zeros":
            continue
        if t.shared:
            _check_shared(reader, t, firsts[t.path, t.kind])
            continue
        firsts[t.path, t.kind] = t
        leaf = _leaf(reader, t, np.dtype(layout.leaf(shapes, t.path).dtype))
        if t.index:
            stacks.setdefault(t.path, {})[t.index] = leaf
        else:
            _set(tree, t.path, leaf)
    for path, parts in stacks.items():
        _set(tree, path, Lazy.nest(parts))
    new = {k: lazy_tree(v) for k, v in _fresh_modules(m, cfg.train.seed).items() if k >= loaded} \
        if loaded < m.mtp_depth else {}
    if new and m.mtp_init == "last_block":
        new = mtp_from_last_block(m, {**tree, "mtp": new})["mtp"]
    tree["mtp"].update(new)
    return tree


def _nested_copy(tree):
    return {k: _nested_copy(v) for k, v in tree.items()} if isinstance(tree, dict) else None


def _fresh_modules(m, seed: int) -> dict:
    """Freshly initialized MTP modules as a pure dict (built in one jit: eager init compiles every shape)."""
    if m.mtp_depth == 0:
        return {}

    @nnx.jit
    def build():
        rngs = nnx.Rngs(params=seed)
        return nnx.List([MTPModule(m, rngs, host_placement()) for _ in range(m.mtp_depth)])

    return nnx.to_pure_dict(nnx.state(build()))  # parameters and MoE routing biases, as checkpoints hold them


def lazy_tree(tree):
    """Lazy leaves over a tree of (fresh, small) arrays."""
    if isinstance(tree, dict):
        return {k: lazy_tree(v) for k, v in tree.items()}
    arr = np.asarray(tree)
    return Lazy(arr.shape, arr.dtype, lambda: arr)


def _tokenizer_spec(tok, out: Path) -> str:
    """data.tokenizer naming the tokenizer saved in the run (absolute: the run may be read from anywhere)."""
    from mtpjax.data.tokenizer import HF_FILE, SP_FILE

    if tok.kind == "byte":
        return "byte"
    return str(out.absolute() / "tokenizer" / (HF_FILE if tok.kind == "hf" else SP_FILE))


def import_hf(hf_dir: str | Path, out: str | Path, overrides=()) -> dict:
    """Write the Hugging Face checkpoint at `hf_dir` as a model-only run directory `out`; a summary."""
    from mtpjax.data import DataError, check_vocab, tokenizer_from_dir

    hf_dir, out = Path(hf_dir), Path(out)
    if not hf_dir.is_dir():
        raise ConvertError(f"--hf '{hf_dir}' is not a directory; pass a local Hugging Face model directory")
    hf = read_config(hf_dir)
    fmt, model_ovr = model_overrides(hf)
    raw = Reader(hf_dir)
    reader = fp8.BlockScaled(raw, fp8.block_of(hf))
    try:
        tok = tokenizer_from_dir(hf_dir)
    except DataError as e:
        raise ConvertError(f"'{hf_dir}' has no usable tokenizer ({e})") from None
    has_bias = _has_qkv_bias(reader)
    if fmt == "llama" and has_bias and not hf.get("attention_bias"):
        raise ConvertError("the checkpoint has q/k/v biases but its config.json says attention_bias=false")
    try:
        cfg = load_config(None, [*model_ovr, f"model.qkv_bias={str(has_bias).lower()}", f"train.run_dir={out}",
                                 f"data.tokenizer={_tokenizer_spec(tok, out)}", *overrides])
        check_vocab(tok, cfg.model.vocab_size)
    except (ConfigError, DataError) as e:
        raise ConvertError(str(e)) from None
    loaded = min(_loaded_modules(reader, fmt, cfg.model.n_layers), cfg.model.mtp_depth)
    params = _params(cfg, reader, fmt, loaded, has_bias, bool(hf.get("rope_interleave", True)))
    notes = []
    if loaded < int(hf.get("num_nextn_predict_layers") or 0):
        notes.append(f"config.json declares {hf['num_nextn_predict_layers']} MTP layers but the checkpoint holds "
                     f"{loaded}; the other MTP modules start as model.mtp_init={cfg.model.mtp_init} says")
    with staged(out) as tmp:
        (tmp / "config.yaml").write_text(cfg.to_yaml())
        tok.save(tmp / "tokenizer")
        meta = {"step": 0, "config": cfg.to_dict(), "source": {"hf_dir": str(hf_dir.resolve()), "format": fmt,
                                                               "mtp_modules_loaded": loaded}}
        save_model_checkpoint(tmp, params, meta)
    return {"out": str(out), "format": fmt, "mtp_depth": cfg.model.mtp_depth, "mtp_modules_loaded": loaded,
            "notes": notes,
            "tensors": len(raw.entries), "float8": sum(e.dtype == fp8.DTYPE for e in raw.entries.values()),
            "bytes": sum(int(np.prod(e.shape, dtype=np.int64)) * e.dtype.itemsize for e in raw.entries.values())}
