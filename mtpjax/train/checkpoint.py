"""Orbax checkpoints of a run: the TrainState, the data-iterator position and the resolved config.

Run directory layout: `config.yaml`, `tokenizer/`, `tensorboard/`, and `checkpoints/<step>/` with the items
- `model`: `nnx.to_pure_dict` of the model state: all that `load_model` (decoding, export) reads;
- `train`: the rest of the TrainState: `{"opt": optimizer state, "step": int32, "rng": uint32[2]}`;
- `data`: the data iterator's state (JSON); `meta`: `{"step", "config": cfg.to_dict(), "metrics"}` (JSON).
A model-only directory (export/import) holds just `model` and `meta`.
Arrays are saved with StandardSave and restored with StandardRestore onto the caller's target shardings,
so a checkpoint written on one mesh restores onto any other.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from mtpjax.config import CheckpointConfig, Config, ConfigError, from_dict
from mtpjax.errors import MtpjaxError, first_line
from mtpjax.nn.model import build_model


class CheckpointError(MtpjaxError, RuntimeError):
    """A run directory or checkpoint is missing or unreadable; the message is one line naming the fix."""


def ckpt_dir(run_dir: str | Path) -> Path:
    """Where a run's numbered checkpoints live."""
    return Path(run_dir).absolute() / "checkpoints"


class Checkpointer:
    """CheckpointManager of one run: saves every `every` steps (and forced ones), keeps the last `keep`."""

    def __init__(self, run_dir: str | Path, ccfg: CheckpointConfig = CheckpointConfig(), *, read_only=False):
        if read_only:
            opts = ocp.CheckpointManagerOptions(save_interval_steps=0, create=False, read_only=True)
        else:
            opts = ocp.CheckpointManagerOptions(save_interval_steps=ccfg.every, max_to_keep=ccfg.keep,
                                                enable_async_checkpointing=ccfg.async_save)
        self.dir = ckpt_dir(run_dir)
        self.mngr = ocp.CheckpointManager(self.dir, options=opts)

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step (None if there is none)."""
        return self.mngr.latest_step()

    def due(self, step: int) -> bool:
        """Whether `save(step)` would write a checkpoint without `force`."""
        return self.mngr.should_save(step)

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        """Save a TrainState (maybe asynchronously) if `step` is due or `force`; returns whether a save started."""
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.to_pure_dict(state.params)),
            train=ocp.args.StandardSave(_train_item(state)),
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta))
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
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        try:
            out = self.mngr.restore(step, args=args)
        except Exception as e:  # orbax raises many types; the user needs one line
            raise CheckpointError(f"checkpoint {step} in {self.dir} could not be restored "
                                  f"({first_line(e, typed=True)})") from None
        train = out["train"]
        state = target.replace(params=_fill(target.params, out["model"]), opt=_fill_vars(target.opt, train["opt"]),
                               step=train["step"], rng=train["rng"])
        return state, out["data"], out["meta"]

    def restore_latest(self, target):
        """(step, state, data_state, meta) of the newest checkpoint that restores, or None if there is none.

        Unreadable newer checkpoints are reported on stderr and, once an older one restored, moved aside to
        `checkpoints-corrupt/` (never deleted) so their steps can be saved again. CheckpointError if none restores.
        """
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

    def restore_meta(self, step: int) -> dict:
        """Only the JSON metadata (step, rng, config) of a checkpoint."""
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

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
        print(f"warning: {message}", file=sys.stderr, flush=True)


def load_model(run_dir: str | Path, step: int | None = None):
    """(cfg, model, tokenizer) of a trained run on one device (latest step by default); CheckpointError if absent."""
    cfg, model, tok, _ = load_model_step(run_dir, step)
    return cfg, model, tok


def load_model_step(run_dir: str | Path, step: int | None = None):
    """(cfg, model, tokenizer, step); step is the checkpoint actually restored (older if the latest is unreadable)."""
    from mtpjax.data import DataError, tokenizer_from_dir

    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory '{run}' does not exist; pass the train.run_dir of a trained run")
    if not ckpt_dir(run).is_dir():
        raise CheckpointError(f"run directory '{run}' holds no checkpoints; train it first (python train.py ...)")
    ck = Checkpointer(run, read_only=True)
    steps = ck.mngr.all_steps()
    if not steps:
        raise CheckpointError(f"run directory '{run}' holds no complete checkpoint; train it first")
    if step is not None and step not in steps:
        raise CheckpointError(f"run '{run}' has no checkpoint at step {step}; available: {sorted(steps)}")
    try:
        tok = tokenizer_from_dir(run / "tokenizer")
    except DataError as e:
        raise CheckpointError(f"run '{run}' has no usable tokenizer ({e})") from None
    # The latest by default; an unreadable one is reported and the next older one is tried.
    for s in [step] if step is not None else sorted(steps, reverse=True):
        try:
            cfg, model = _load_step(ck, run, s)
            ck.mngr.close()
            return cfg, model, tok, s
        except CheckpointError as e:
            if step is not None:
                raise
            warn(f"{e}; falling back to the previous checkpoint")
    raise CheckpointError(f"no checkpoint of run '{run}' is readable (tried {sorted(steps, reverse=True)}); "
                          "train it again with --fresh")


def _load_step(ck: Checkpointer, run: Path, step: int):
    """(cfg, model) of one checkpoint; CheckpointError if it is unreadable."""
    try:
        cfg = from_dict(ck.restore_meta(step)["config"])
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {step} of '{run}' has an invalid config ({e})") from None
    except Exception as e:  # orbax raises many types
        raise CheckpointError(f"checkpoint {step} of '{run}' is unreadable ({first_line(e, typed=True)})") from None
    abstract = nnx.eval_shape(lambda: build_model(cfg))
    graphdef, abs_state = nnx.split(abstract)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abs_state)
    args = ocp.args.Composite(model=ocp.args.StandardRestore(nnx.to_pure_dict(target)))
    try:
        out = ck.mngr.restore(step, args=args)
    except Exception as e:
        raise CheckpointError(f"checkpoint {step} of '{run}' is unreadable ({first_line(e, typed=True)})") from None
    return cfg, nnx.merge(graphdef, _fill(target, out["model"]))


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
    import yaml

    p = Path(run_dir) / "config.yaml"
    if not p.is_file():
        return None
    try:
        return from_dict(yaml.safe_load(p.read_text()) or {})
    except (ConfigError, yaml.YAMLError) as e:
        raise CheckpointError(f"'{p}' is not a valid config ({e}); use --fresh to move the old run aside") from None
