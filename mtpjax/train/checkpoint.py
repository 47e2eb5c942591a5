"""Orbax checkpoints of a run: saving and resuming its TrainState (Checkpointer), and reading a saved run (SavedRun).

SavedRun is the one reader of run directories: decode.py (load_model), post-training (train.init_from) and
export open a run through it. `read_run_config` reads the config.yaml a run directory starts with.

Run directory layout: `config.yaml`, `tokenizer/`, `tensorboard/`, and `checkpoints/<step>/` with the items
- `model`: `nnx.to_pure_dict` of the model state: all that `load_model` (decoding, export) reads;
- `train`: the rest of the TrainState: `{"opt": optimizer state, "step": int32, "rng": uint32[2]}`;
- `data`: the data iterator's state (JSON); `meta`: `{"step", "config": cfg.to_dict(), "metrics", "goodput",
  "skipped_steps"}` (JSON);
- `digests`: an xxh3-128 digest of every stored array shard, of `data` and of `meta` (train/digests.py), checked
  on restore unless `checkpoint.verify=false`: a mismatch makes the checkpoint unreadable.
A model-only directory (export/import) holds just `model` and `meta` (and `digests`).
Arrays are saved with StandardSave and restored with StandardRestore onto the caller's target shardings,
so a checkpoint written on one mesh restores onto any other.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from mtpjax.config import CheckpointConfig, Config, ConfigError, from_dict, load_config
from mtpjax.errors import MtpjaxError, first_line
from mtpjax.parallel import console
from mtpjax.nn.model import build_model
from mtpjax.train import digests
from mtpjax.parallel.sharding import run_placement, state_shardings


class CheckpointError(MtpjaxError, RuntimeError):
    """A run directory or checkpoint is missing or unreadable; the message is one line naming the fix."""


def ckpt_dir(run_dir: str | Path) -> Path:
    """Where a run's numbered checkpoints live."""
    return Path(run_dir).absolute() / "checkpoints"


class Checkpointer:
    """CheckpointManager of one run: saves every `every` steps (and forced ones), keeps the last `keep`."""

    def __init__(self, run_dir: str | Path, ccfg: CheckpointConfig = CheckpointConfig()):
        opts = ocp.CheckpointManagerOptions(save_interval_steps=ccfg.every, max_to_keep=ccfg.keep,
                                            enable_async_checkpointing=ccfg.async_save)
        self.dir, self.verify = ckpt_dir(run_dir), ccfg.verify
        self.restore_seconds = 0.0  # spent in restore_latest (goodput counts it as checkpointing)
        self.mngr = ocp.CheckpointManager(self.dir, options=opts)

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step (None if there is none)."""
        return self.mngr.latest_step()

    def due(self, step: int) -> bool:
        """Whether `save(step)` would write a checkpoint without `force`."""
        return self.mngr.should_save(step)

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        """Save a TrainState (maybe asynchronously) if `step` is due or `force`; returns whether a save started."""
        arrays = {"model": nnx.to_pure_dict(state.params), "train": _train_item(state)}
        args = ocp.args.Composite(
            **{k: ocp.args.StandardSave(v) for k, v in arrays.items()},
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta),
            digests=digests.DigestSave(arrays, {"data": data_state, "meta": meta}))
        try:  # also raises the error of a failed earlier asynchronous save
            return self.mngr.save(step, args=args, force=force)
        except Exception as e:
            raise self._save_error(e) from None

    def restore(self, step: int, target):
        """(state, data_state, meta) at `step`, arrays placed like `target` (a TrainState of ShapeDtypeStructs)."""
        try:
            return self._restore(step, target)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; use --fresh to start over") from None

    def _restore(self, step: int, target):
        args = ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.to_pure_dict(target.params)),
            train=ocp.args.StandardRestore(_train_item(target)),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore(),
            **self._digests(step))
        try:
            out = self.mngr.restore(step, args=args)
        except Exception as e:  # orbax raises many types; the user needs one line
            raise CheckpointError(f"checkpoint {step} in {self.dir} could not be restored "
                                  f"({first_line(e, typed=True)})") from None
        if ITEM in out:
            check(out[ITEM], {k: out[k] for k in ("model", "train")}, {k: out[k] for k in ("data", "meta")},
                  f"checkpoint {step} in {self.dir}")
        train = out["train"]
        state = target.replace(params=_fill(target.params, out["model"]), opt=_fill_vars(target.opt, train["opt"]),
                               step=train["step"], rng=train["rng"])
        return state, out["data"], out["meta"]

    def _digests(self, step: int) -> dict:
        """The digests item to restore with `step`'s arrays: none when not verifying or for a checkpoint without one."""
        return has_digests(self.dir, step) if self.verify else {}

    def restore_latest(self, target):
        """(step, state, data_state, meta) of the newest checkpoint that restores, or None if there is none.

        Unreadable newer checkpoints are reported on stderr and, once an older one restored, moved aside to
        `checkpoints-corrupt/` (never deleted) so their steps can be saved again. CheckpointError if none restores.
        """
        t0 = time.perf_counter()
        try:
            return self._restore_latest(target)
        finally:
            self.restore_seconds += time.perf_counter() - t0

    def _restore_latest(self, target):
        steps, bad = sorted(self.mngr.all_steps(), reverse=True), []
        for step in steps:
            try:
                out = self._restore(step, target)
            except CheckpointError as e:
                warn(f"{e}; trying the previous checkpoint")
                bad.append(step)
                continue
            for b in bad:
                self._move_aside(b)
            return (step, *out)
        if steps:
            raise CheckpointError(f"none of the checkpoints {steps} in {self.dir} can be restored; "
                                  "use --fresh to start over")
        return None

    def _move_aside(self, step: int) -> None:
        from mtpjax.parallel import distributed

        if distributed.is_primary():
            bad = self.dir.parent / "checkpoints-corrupt"
            bad.mkdir(exist_ok=True)
            dest = bad / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}"
            (self.dir / str(step)).rename(dest)
            warn(f"moved the unreadable checkpoint {step} to {dest}")
        distributed.barrier(f"mtpjax-corrupt-{step}")
        self.mngr.reload()

    def _save_error(self, e: Exception) -> CheckpointError:
        return CheckpointError(f"saving a checkpoint to {self.dir} failed ({first_line(e, typed=True)}); "
                               "free disk space or fix the directory's permissions, then re-run to resume from "
                               "the last complete checkpoint")

    def wait(self) -> None:
        """Block until async saves are on disk; CheckpointError if one failed."""
        try:
            self.mngr.wait_until_finished()
        except Exception as e:
            raise self._save_error(e) from None

    def close(self) -> None:
        """Wait for pending saves (CheckpointError if one failed) and release the manager."""
        try:
            self.wait()
        finally:
            self.mngr.close()


def warn(message: str) -> None:
    """One `warning: ...` line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        console.say(f"warning: {message}")  # above the progress bar of a run in progress


ITEM = digests.ITEM


def has_digests(directory: Path, step: int) -> dict:
    """{ITEM: DigestRestore()} if checkpoint `step` under `directory` recorded digests, else {} (an older one)."""
    return {ITEM: digests.DigestRestore()} if (directory / str(step) / ITEM).is_dir() else {}


def check(record: dict, arrays: dict, values: dict, what: str) -> None:
    """CheckpointError naming the first array or JSON item of `what` that does not match its recorded digest."""
    bad = digests.first_mismatch(record, arrays, values)
    if bad is not None:
        raise CheckpointError(f"{what}: {bad} does not match its {digests.checksum.ALGORITHM} digest (a changed "
                              "or flipped byte)")


def complete_steps(run_dir: str | Path) -> list[int]:
    """A run directory's complete checkpoint steps, oldest first (orbax renames a finished save to its bare step)."""
    d = ckpt_dir(run_dir)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


class SavedRun:
    """A run directory opened read-only (steps, a checkpoint's config, tokenizer, parameters); errors name it `name`."""

    def __init__(self, run_dir: str | Path, name: str | None = None, *, verify: bool = True):
        self.dir, self.verify = Path(run_dir), verify
        self.name = name or f"'{self.dir}'"
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.name} is not a run directory (it does not exist or is not a directory); "
                                  "pass the train.run_dir of a trained run or the --out of `python -m mtpjax convert "
                                  "import`")
        self.steps = complete_steps(self.dir)
        if not self.steps:
            none = "" if ckpt_dir(self.dir).is_dir() else " (no checkpoints/ directory)"
            raise CheckpointError(f"{self.name} holds no complete checkpoint{none}; train it first (python train.py "
                                  "...) or pass another run directory")
        with _quiet(_READ_ONLY_NOTICE):  # reading is what the caller asked for, not news
            self.mngr = ocp.CheckpointManager(ckpt_dir(self.dir), options=ocp.CheckpointManagerOptions(
                save_interval_steps=0, create=False, read_only=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, step: int | None = None) -> int:
        """`step` if the run has that checkpoint, else CheckpointError; the latest step for None."""
        if step is None:
            return self.steps[-1]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise CheckpointError(f"step={step!r} is not a checkpoint step: give an int (available: {self.steps}) or "
                                  "None for the latest")
        if step not in self.steps:
            raise CheckpointError(f"{self.name} has no checkpoint at step {step}; available: {self.steps}")
        return step

    def config(self, step: int) -> Config:
        """The resolved config a checkpoint was saved with."""
        meta = self._restore(step, meta=ocp.args.JsonRestore())["meta"]
        try:
            return from_dict(meta["config"])
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {step} of {self.name} has an invalid config ({e})") from None
        except (KeyError, TypeError) as e:  # a meta item without a config
            raise CheckpointError(f"checkpoint {step} of {self.name} is unreadable ({first_line(e, typed=True)})"
                                  ) from None

    def newest(self, read, step: int | None = None, skipped=lambda message: None):
        """read(`step`), or for None read() of the newest checkpoint it reads, each unreadable one passed to
        `skipped` first; CheckpointError when none reads."""
        if step is not None:
            return read(self.step(step))
        for s in self.steps[::-1]:
            try:
                return read(s)
            except CheckpointError as e:
                skipped(f"{e}; falling back to the previous checkpoint")
        raise CheckpointError(f"no checkpoint of run {self.name} is readable (tried {self.steps[::-1]}); "
                              "train it again with --fresh")

    def newest_config(self, step: int | None = None) -> Config:
        """The config of `step`, or for None of the newest checkpoint whose config reads (load_model_step warns about
        any it then skips)."""
        return self.newest(self.config, step)

    def tokenizer(self):
        """The tokenizer the run saved (tokenizer/)."""
        from mtpjax.data import DataError, tokenizer_from_dir

        try:
            return tokenizer_from_dir(self.dir / "tokenizer")
        except DataError as e:
            raise CheckpointError(f"{self.name} has no usable tokenizer ({e})") from None

    def model(self, step: int, mesh: Mesh | None = None):
        """(cfg, model) of a checkpoint: on one device, or built for `mesh` with each parameter restored straight into
        its training sharding (orbax reads every device's shard, never the whole array first)."""
        cfg = self.config(step)
        where = None if mesh is None else run_placement(cfg.mesh, mesh)
        graphdef, abs_state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, placement=where)))
        if mesh is None:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: dev, abs_state)
        else:
            shardings = state_shardings(abs_state, mesh)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings)
        out = self._restore(step, model=ocp.args.StandardRestore(nnx.to_pure_dict(target)))
        return cfg, nnx.merge(graphdef, _fill(target, out["model"]))

    def params(self, step: int, cfg: Config) -> dict:
        """A checkpoint's model parameters as a pure dict of host numpy arrays (every process reads them all)."""
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg))))
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
        return _int_keys(self._restore(step, model=ocp.args.PyTreeRestore(item=abstract, restore_args=args))["model"])

    def leaf(self, step: int, path: tuple) -> np.ndarray:
        """One parameter of a checkpoint as a host array, read alone."""
        item, args = 0, ocp.RestoreArgs(restore_type=np.ndarray)
        for p in reversed(path):
            item, args = {p: item}, {p: args}
        out = self._restore(step, f"parameter {'.'.join(map(str, path))} of ", model=ocp.args.PyTreeRestore(
            item=item, restore_args=args, partial_restore=True))["model"]
        for p in path:
            out = out[p] if p in out else out[str(p)]
        return out

    def _restore(self, step: int, what: str = "", **items) -> dict:
        extra = has_digests(ckpt_dir(self.dir), step) if self.verify else {}
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(**items, **extra))
        except Exception as e:  # orbax raises many types; the user needs one line
            raise CheckpointError(f"{what}checkpoint {step} of {self.name} is unreadable "
                                  f"({first_line(e, typed=True)})") from None
        if ITEM in out:
            check(out[ITEM], {k: out[k] for k in ("model", "train") if k in out},
                  {k: out[k] for k in ("data", "meta") if k in out}, f"{what}checkpoint {step} of {self.name}")
        return out

    def close(self) -> None:
        self.mngr.close()


_READ_ONLY_NOTICE = "Given directory is read only"  # orbax's warning on every read-only CheckpointManager


@contextlib.contextmanager
def _quiet(message: str):
    """Drop absl log records that start with `message` while the block runs."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(message)

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def load_model(run_dir: str | Path, step: int | None = None, mesh: Mesh | None = None):
    """(cfg, model, tokenizer) of a trained run on one device or sharded over `mesh` (SavedRun.model; latest step by
    default); CheckpointError if absent."""
    cfg, model, tok, _ = load_model_step(run_dir, step, mesh)
    return cfg, model, tok


def load_model_step(run_dir: str | Path, step: int | None = None, mesh: Mesh | None = None):
    """(cfg, model, tokenizer, step); step is the checkpoint actually restored (older if the latest is unreadable)."""
    with SavedRun(run_dir) as run:
        tok = run.tokenizer()
        return run.newest(lambda s: (*run.model(s, mesh), tok, s), step, warn)  # the latest by default


def _int_keys(tree):
    """orbax may return a list's indices as string keys; nnx's pure dicts use ints."""
    if not isinstance(tree, dict):
        return tree
    return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in tree.items()}


def _train_item(state) -> dict:
    """The `train` item of a TrainState: optimizer state (Variables unwrapped to arrays), step and RNG."""
    opt = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, state.opt, is_leaf=_is_var)
    return {"opt": opt, "step": state.step, "rng": state.rng}


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _fill_vars(target, arrays):
    """`target` (a pytree that may hold nnx Variables) with its leaves replaced by the restored `arrays`."""
    return jax.tree.map(lambda t, a: t.replace(a) if _is_var(t) else a, target, arrays, is_leaf=_is_var)


def _fill(target_state, pure: dict):
    """A copy of an abstract nnx state with the restored arrays (orbax may return int keys as strings)."""
    state = jax.tree.map(lambda x: x, target_state)
    nnx.replace_by_pure_dict(state, pure)
    return state


def read_run_config(run_dir: str | Path) -> Config | None:
    """The config saved in `<run_dir>/config.yaml` (None if the run has none yet)."""
    p = Path(run_dir) / "config.yaml"
    if not p.is_file():
        return None
    try:
        return load_config(p)  # its errors are one line (a YAML error's own message is several)
    except ConfigError as e:
        raise CheckpointError(f"'{p}' is not a valid config ({e}); delete it to resume with the config of the latest "
                              "checkpoint, or use --fresh to move the old run aside") from None
