"""Orbax checkpoints of a run: model, optimizer, step, RNG, data-iterator state and resolved config.

Run directory layout: `config.yaml`, `tokenizer/`, `checkpoints/<step>/{model,opt,data,meta}`, `tensorboard/`.
Arrays are saved with StandardSave and restored with StandardRestore onto the caller's target shardings,
so a checkpoint written on one mesh restores onto any other.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from mtpjax.config import CheckpointConfig, Config, ConfigError, from_dict
from mtpjax.model import build_model


class CheckpointError(RuntimeError):
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

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        """Save (maybe asynchronously) if `step` is due or `force`; returns whether a save started."""
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.to_pure_dict(state[0])),
            opt=ocp.args.StandardSave(nnx.to_pure_dict(state[1])),
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta))
        return self.mngr.save(step, args=args, force=force)

    def restore(self, step: int, target_state):
        """(state, data_state, meta) at `step`, arrays placed like `target_state` (ShapeDtypeStructs)."""
        args = ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.to_pure_dict(target_state[0])),
            opt=ocp.args.StandardRestore(nnx.to_pure_dict(target_state[1])),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        try:
            out = self.mngr.restore(step, args=args)
        except Exception as e:  # orbax raises many types; the user needs one line
            raise CheckpointError(f"checkpoint {step} in {self.dir} could not be restored "
                                  f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                  "use --fresh to start over") from None
        return _fill(target_state, {0: out["model"], 1: out["opt"]}), out["data"], out["meta"]

    def restore_meta(self, step: int) -> dict:
        """Only the JSON metadata (step, rng, config) of a checkpoint."""
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        """Block until async saves are on disk."""
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()


def load_model(run_dir: str | Path, step: int | None = None):
    """(cfg, model, tokenizer) of a trained run on one device (latest step by default); CheckpointError if absent."""
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
    step = max(steps) if step is None else step
    if step not in steps:
        raise CheckpointError(f"run '{run}' has no checkpoint at step {step}; available: {sorted(steps)}")
    try:
        cfg = from_dict(ck.restore_meta(step)["config"])
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {step} of '{run}' has an invalid config ({e})") from None
    abstract = nnx.eval_shape(lambda: build_model(cfg))
    graphdef, abs_state = nnx.split(abstract)
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abs_state)
    out = ck.mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(nnx.to_pure_dict(target))))
    ck.close()
    try:
        tok = tokenizer_from_dir(run / "tokenizer")
    except DataError as e:
        raise CheckpointError(f"run '{run}' has no usable tokenizer ({e})") from None
    return cfg, nnx.merge(graphdef, _fill(target, out["model"])), tok


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
