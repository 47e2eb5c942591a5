"""Export a run's checkpoint as a Hugging Face directory, reading the orbax checkpoint one leaf at a time.

Written into a temporary sibling directory renamed into place at the end: a failed export leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mtpjax.train.checkpoint import SavedRun
from mtpjax.train.rundir import remove_created
from mtpjax.config import Config
from mtpjax.convert import fp8, layout
from mtpjax.convert.errors import ConvertError
from mtpjax.convert.hf_config import export_config
from mtpjax.convert.hf_tokenizer import check_exportable, export_tokenizer
from mtpjax.convert.safetensors_io import Spec, write_checkpoint
from mtpjax.nn.model import build_model

DEFAULT_SHARD_BYTES = 2e9


def param_shapes(cfg: Config) -> dict:
    """The model's pure-dict state tree (parameters and MoE routing biases, as checkpoints hold it) with each
    leaf's shape and dtype (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: build_model(cfg))
    return nnx.to_pure_dict(nnx.state(abstract))


def shape_tree(shapes: dict) -> dict:
    """The same tree with each leaf's shape (a tuple)."""
    return jax.tree.map(lambda a: tuple(a.shape), shapes)


class RunCheckpoint:
    """A run's checkpoint opened read-only (train.checkpoint.SavedRun): its config, tokenizer, step, and its
    parameters one leaf at a time."""

    def __init__(self, run_dir: str | Path, step: int | None = None):
        self.saved = SavedRun(run_dir)
        try:
            self.step = self.saved.step(step)
            self.cfg, self.tokenizer = self.saved.config(self.step), self.saved.tokenizer()
        except BaseException:
            self.saved.close()
            raise
        self.run, self._cached = self.saved.dir, (None, None)

    def leaf(self, path: tuple) -> np.ndarray:
        """One parameter as a host array (the last one read is kept: a stacked trunk leaf serves every layer)."""
        if self._cached[0] == path:
            return self._cached[1]
        self.release()  # the previous leaf goes before the next is read
        self._cached = (path, self.saved.leaf(self.step, path))
        return self._cached[1]

    def release(self) -> None:
        """Forget the kept leaf."""
        self._cached = (None, None)

    def close(self) -> None:
        self.saved.close()


def _check(cfg: Config, fmt: str, mtp_modules: int | None, tokenizer) -> int:
    """The number of MTP modules to write; ConvertError if the run or the format cannot give them."""
    m = cfg.model
    if fmt not in layout.FORMATS:
        raise ConvertError(f"--format {fmt} is unknown; use one of {', '.join(layout.FORMATS)}")
    if m.attention_kind == "gqa" and m.mlp_kind == "moe":
        raise ConvertError("no export layout holds grouped-query attention with a mixture of experts (llama, qwen2 "
                           "and MiMo are dense, DeepSeek-V3's attention is MLA); train with model.attention_kind=mla "
                           "to export an MoE run")
    if fmt != "deepseek_v3" and (m.attention_kind == "mla" or m.mlp_kind == "moe"):
        raise ConvertError(f"the run uses model.attention_kind={m.attention_kind} and model.mlp_kind={m.mlp_kind}, "
                           "which the llama/qwen2/MiMo layouts cannot express; use --format deepseek_v3")
    if fmt == "deepseek_v3" and m.attention_kind != "mla":
        raise ConvertError("--format deepseek_v3 needs model.attention_kind=mla (DeepSeek-V3's attention); "
                           "export a GQA run with --format qwen2")
    check_exportable(tokenizer, m.vocab_size)
    if fmt == "llama":
        if mtp_modules:
            raise ConvertError("--format llama writes the trunk only (Llama has no MTP layout); "
                               "use --format qwen2 for MTP modules, or --mtp-modules 0")
        return 0
    if mtp_modules is None:
        mtp_modules = min(1, m.mtp_depth if m.mtp_kind == "sequential" else 0)
    if mtp_modules < 0:
        raise ConvertError(f"--mtp-modules {mtp_modules} must be >= 0")
    if mtp_modules > m.mtp_depth:
        raise ConvertError(f"--mtp-modules {mtp_modules} asks for more MTP modules than the run has "
                           f"(model.mtp_depth={m.mtp_depth}); pass at most {m.mtp_depth}")
    if mtp_modules and m.mtp_kind != "sequential":
        raise ConvertError(f"the run's MTP modules are model.mtp_kind={m.mtp_kind}, which the MiMo and DeepSeek-V3 "
                           "layouts cannot express (they chain [hidden; embedding]); pass --mtp-modules 0 for the "
                           "trunk alone")
    if mtp_modules and fmt == "qwen2" and m.mtp_hidden != "raw":
        raise ConvertError("MiMo's engines feed the MTP layer the trunk's raw (pre-norm) state, but this run's module "
                           "1 reads the final-normed one; use --format deepseek_v3, or pass --mtp-modules 0")
    if mtp_modules and fmt == "deepseek_v3" and m.mtp_hidden != "normed":
        # DeepSeek's engines feed MTP layer L the trunk's final-normed state: a raw-trained module would draft
        # from another input than it learned on, silently.
        raise ConvertError("DeepSeek-V3's engines feed the MTP layer the trunk's final-normed state, but this run's "
                           "module 1 reads the raw one; train with model.mtp_hidden=normed, or pass --mtp-modules 0")
    return mtp_modules


def _specs(ck: RunCheckpoint, cfg: Config, fmt: str, mtp_modules: int, quantize: str | None = None) -> list[Spec]:
    shapes = param_shapes(cfg)
    dtype = np.dtype(jax.numpy.dtype(cfg.model.param_dtype))

    def producer(t: layout.Tensor):
        if t.kind == "zeros":
            return lambda: np.zeros(t.shape, dtype)

        def produce():
            x = ck.leaf(t.path)
            if not t.index:  # only a stacked leaf (scanned trunk, experts) is read again, for its next part
                ck.release()
                return layout.to_hf(t, x)
            return layout.to_hf(t, x[t.index])
        return produce

    def leaf_dtype(t: layout.Tensor):  # a MoE routing bias stays float32 whatever the parameters' dtype
        return dtype if t.path is None else np.dtype(layout.leaf(shapes, t.path).dtype)

    specs = [Spec(t.hf, t.shape, leaf_dtype(t), producer(t))
             for t in layout.tensors(cfg.model, shape_tree(shapes), fmt, mtp_modules)]
    if quantize:
        return [q for s in specs for q in (_fp8_pair(s, fp8.BLOCK) if fp8.quantized(s.name) else [s])]
    return specs


def _fp8_pair(spec: Spec, block: tuple[int, int]) -> list[Spec]:
    """A weight as float8 and its block scales beside it (quantized once: the scales wait for their turn)."""
    held = {}

    def weight():
        q, held["scale"] = fp8.quantize(spec.produce(), block)
        return q

    return [Spec(spec.name, spec.shape, fp8.DTYPE, weight),
            Spec(spec.name + fp8.SCALE, fp8.scale_shape(spec.shape, block), np.dtype(np.float32),
                 lambda: held.pop("scale"))]


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new temporary sibling of `out` (which must not exist yet; missing parents are made) to write into, renamed
    into place when the block ends; if it fails, nothing is left (the parents made included)."""
    out = Path(out)
    if out.exists():
        raise ConvertError(f"'{out}' already exists; pass a new --out directory (nothing was written)")
    missing = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    if not (missing[-1].parent if missing else out.parent).is_dir():
        raise ConvertError(f"the parent of --out '{out}' is not a directory (a file is in the way); choose another "
                           "--out")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        remove_created(missing)
        raise ConvertError(f"cannot write into '{out.parent}' ({e.strerror}); choose a writable --out") from None
    try:
        yield tmp
        try:
            tmp.rename(out)
        except OSError as e:
            raise ConvertError(f"cannot rename '{tmp}' to '{out}' ({e.strerror})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_created(missing)
        raise


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, mtp_modules: int | None = None,
               fmt: str = "qwen2", max_shard_bytes: float = DEFAULT_SHARD_BYTES, quantize: str | None = None) -> dict:
    """Write the run's checkpoint as a Hugging Face directory at `out` (quantize="fp8": DeepSeek-V3's float8
    block-scaled linears); a summary. ConvertError on bad input, CheckpointError for a missing or unreadable run."""
    out = Path(out)
    if quantize not in (None, "fp8") or (quantize and fmt != "deepseek_v3"):
        raise ConvertError(f"--quantize {quantize} with --format {fmt}: fp8 is written in DeepSeek-V3's layout only; "
                           "pass --format deepseek_v3 --quantize fp8, or leave --quantize out")
    ck = RunCheckpoint(run_dir, step)
    try:
        cfg = ck.cfg
        mtp_modules = _check(cfg, fmt, mtp_modules, ck.tokenizer)
        specs = _specs(ck, cfg, fmt, mtp_modules, quantize)
        with staged(out) as tmp:
            files = write_checkpoint(tmp, specs, max_shard_bytes)
            max_len = max(cfg.data.seq_len, cfg.decode.max_len)
            eos = ck.tokenizer.eos_id
            hf = export_config(cfg.model, fmt, mtp_modules, eos, max_len)
            if quantize:
                hf["quantization_config"] = fp8.config(fp8.BLOCK)
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            gen = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            export_tokenizer(ck.tokenizer, tmp, max_len)
    finally:
        ck.close()
    return {"out": str(out), "step": ck.step, "format": fmt, "quantize": quantize, "mtp_modules": mtp_modules,
            "files": files,
            "bytes": sum(s.nbytes for s in specs), "tensors": len(specs)}
