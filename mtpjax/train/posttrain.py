"""Starting a run from another run's trunk (train.init_from, train.freeze, train.keep_mtp): checks and first state.

A post-training run is a new run: its step, λ and warmup count from 0. `init_from` is read only while the new
run directory has no checkpoint; after its first checkpoint the run resumes like any other. Trunk, embedding and
head come from the source; the MTP modules are fresh (model.mtp_init) unless train.keep_mtp keeps the source's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mtpjax.config import Config
from mtpjax.errors import MtpjaxError
from mtpjax.nn.model import mtp_from_last_block
from mtpjax.train.checkpoint import SavedRun, complete_steps

# Model keys that decide the trunk's parameters and what they compute; the MTP keys, the layer layout (scanned or
# not), dtypes, remat and the attention backend may differ between the source and the new run.
TRUNK_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "resolved_head_dim", "resolved_d_ff",
              "rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_len", "norm_eps", "qkv_bias", "tie_embeddings")
PROBE_TEXT = "def f(x):\n    return {'é': x ** 2}  # 你好, tokenizers\n"


class InitFromError(MtpjaxError, RuntimeError):
    """train.init_from cannot start this run; the message is one line naming the problem and the fix."""


@dataclass(frozen=True)
class Source:
    """The run a new run starts from (train.init_from): its directory, the checkpoint read, and its config."""

    dir: Path
    step: int
    cfg: Config

    @property
    def name(self) -> str:
        return f"train.init_from '{self.dir}'"


def _key(k: str) -> str:
    return "model." + k.removeprefix("resolved_")


def source_config(cfg: Config, fresh: bool = False) -> Source | None:
    """The init_from run (its latest checkpoint) after checking it can start `cfg`; None when init_from is unset or
    not read (the new run directory already has a checkpoint and is not --fresh). InitFromError, or CheckpointError
    for an unreadable run, otherwise; nothing written."""
    t = cfg.train
    src = Path(t.init_from).expanduser()
    where = f"train.init_from '{t.init_from}'"
    if t.init_from and src.resolve() == Path(t.run_dir).expanduser().resolve():
        raise InitFromError(f"{where} is this run's own train.run_dir; post-training starts a new run: set another "
                            "train.run_dir")
    if not t.init_from or (not fresh and complete_steps(Path(t.run_dir).expanduser())):
        return None
    with SavedRun(src, where) as run:
        step = run.step()
        scfg = run.config(step)
    diffs = [f"{_key(k)} {getattr(scfg.model, k)!r} there, {getattr(cfg.model, k)!r} here" for k in TRUNK_KEYS
             if getattr(scfg.model, k) != getattr(cfg.model, k)]
    if diffs:
        raise InitFromError(f"{where} has another architecture ({'; '.join(diffs[:3])}); set the model.* keys of "
                            f"'{src / 'config.yaml'}' (MTP keys may differ) or pass another run")
    if t.keep_mtp and (scfg.model.mtp_kind != cfg.model.mtp_kind or scfg.model.mtp_depth < cfg.model.mtp_depth):
        raise InitFromError(f"train.keep_mtp=true needs the init_from run's MTP modules, but it has "
                            f"{scfg.model.mtp_depth} {scfg.model.mtp_kind} module(s) and this run "
                            f"{cfg.model.mtp_depth} {cfg.model.mtp_kind}; set train.keep_mtp=false for fresh ones")
    return Source(src, step, scfg)


def check_tokenizer(cfg: Config, source: Source | None, tokenizer) -> None:
    """InitFromError unless the new run's tokenizer gives the init_from run's token ids (its embedding's rows)."""
    if source is None:
        return
    with SavedRun(source.dir, source.name) as run:
        theirs = run.tokenizer()
    if theirs.vocab_size != tokenizer.vocab_size or theirs.encode(PROBE_TEXT) != tokenizer.encode(PROBE_TEXT):
        spec = source.cfg.data.tokenizer
        if spec == "bpe":  # trained on that run's data: point at the file it saved
            spec = str(source.dir.absolute() / "tokenizer" / "tokenizer.json")
        raise InitFromError(f"data.tokenizer={cfg.data.tokenizer} gives other token ids than the tokenizer of "
                            f"{source.name}; set data.tokenizer={spec}")


def _relayout_blocks(blocks, src_scanned: bool, n_layers: int, scanned: bool):
    """Trunk blocks as the new run lays them out: one stacked tree (scan_layers) or one tree per layer."""
    if src_scanned == scanned:
        return blocks
    if src_scanned:
        return {i: jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n_layers)}
    return jax.tree.map(lambda *xs: np.stack(xs), *[blocks[i] for i in range(n_layers)])


def initial_state(cfg: Config, source: Source, progs):
    """The first TrainState of a run started from init_from: a fresh optimizer over the trainable part (the MTP
    modules when the trunk is frozen), step 0, the source's trunk/embedding/head, MTP modules as configured."""
    state = progs.init()
    fresh = nnx.to_pure_dict(state.params)
    with SavedRun(source.dir, source.name) as run:
        src = run.params(source.step, source.cfg)
    src["blocks"] = _relayout_blocks(src["blocks"], source.cfg.model.scan_layers, cfg.model.n_layers,
                                     cfg.model.scan_layers)
    new = {**{k: v for k, v in src.items() if k != "mtp"}, "mtp": fresh["mtp"]}
    if cfg.train.keep_mtp:
        new["mtp"] = {k: src["mtp"][k] for k in fresh["mtp"]}
    elif cfg.model.mtp_init == "last_block":  # the fresh modules copied the random trunk's block: copy the real one
        new = mtp_from_last_block(cfg.model, new)
    placed = jax.tree.map(_place, new, fresh)
    nnx.replace_by_pure_dict(state.params, placed)
    return state


def _place(value, like: jax.Array) -> jax.Array:
    """`value` (host numpy or an array) in `like`'s dtype and sharding, one buffer of its own."""
    if value is like:  # a fresh MTP parameter, already in place
        return like
    host = np.asarray(value).astype(like.dtype)
    if host.shape != like.shape:
        raise InitFromError(f"train.init_from: a parameter of shape {host.shape} meets {like.shape}; the source's "
                            "config does not describe its checkpoint")
    return jax.make_array_from_callback(host.shape, like.sharding, lambda idx: host[idx])
