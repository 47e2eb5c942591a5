"""Training loop (docs/design.md §5): build once, jit once, loop; eval, checkpoints, NaN guard, preemption hang off it.

Around the loop: `rundir` (the run directory's lifecycle), `train_step` (TrainState and the jitted step),
`train_eval` (the eval hook), `train_report` (banner, metrics, summary), `checkpoint`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from mtpjax import data
from mtpjax.parallel import distributed, runtime
from mtpjax.train import posttrain, rundir
from mtpjax.train.checkpoint import Checkpointer
from mtpjax.config import Config
from mtpjax.train.metrics import Writer, measure_peak_flops
from mtpjax.parallel.sharding import batch_sharding, data_parallelism, make_mesh
from mtpjax.train.evals import run_eval
from mtpjax.train.report import Logger, banner, summary
from mtpjax.train.step import Programs, make_programs


class TrainError(RuntimeError):
    """Bad training setup (batch vs mesh); the message is one line naming the problem and the fix."""


class NonFiniteError(TrainError):
    """The loss or gradient became non-finite beyond what train.nan_policy allows."""


def check_parallelism(cfg: Config, mesh) -> None:
    """The batch must split evenly over data parallelism, micro-batches and processes."""
    dp, B, A = data_parallelism(mesh), cfg.train.batch_size, cfg.train.micro_batches
    if B % (dp * A):
        raise TrainError(f"train.batch_size={B} is not divisible by data parallelism mesh.data*mesh.fsdp={dp} "
                         f"times train.micro_batches={A}; use a multiple of {dp * A}")
    if B % jax.process_count():
        raise TrainError(f"train.batch_size={B} is not divisible by the {jax.process_count()} processes")


# ----------------------------------------------------------------------------- data


def open_data(cfg: Config, mesh):
    """(prepared corpus, train iterator, validation batches, per-source validation batches); DataError on bad input."""
    return data.open_run_data(cfg, batch_sharding(mesh))  # each process reads its rows of every global batch


def to_global(progs: Programs, batch: dict):
    """This process's numpy rows -> global arrays sharded over ('data','fsdp')."""
    put = lambda x: jax.make_array_from_process_local_data(progs.batch_sharding, np.asarray(x, np.int32))
    return put(batch["tokens"]), put(batch["segment_ids"])


# ----------------------------------------------------------------------------- what hangs off the loop


class _Preemption:
    """SIGTERM sets a flag the loop checks after each step (the handler itself does nothing else)."""

    def __init__(self):
        self.requested, self.old = False, None

    def __enter__(self):
        # Several processes must stop at the same step: JAX's preemption sync manager catches SIGTERM there.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def check(self, step: int) -> bool:
        """Whether to stop after `step` (the same answer on every process)."""
        if jax.process_count() > 1 and not self.requested:
            from jax.experimental import multihost_utils

            self.requested = multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


class NonFiniteGuard:
    """train.nan_policy on the host: a skipped (non-finite) step warns, or stops the run past the allowed count."""

    def __init__(self, cfg: Config):
        self.policy, self.limit, self.skipped = cfg.train.nan_policy, cfg.train.max_skipped_steps, 0

    def check(self, step: int, met: dict) -> bool:
        """True if the step's update was applied; NonFiniteError when the policy says stop."""
        if not met["skipped"]:
            return True
        self.skipped += 1
        what = f"non-finite loss/gradient at step {step} (loss {met['loss/total']}, grad_norm {met['grad_norm']})"
        if self.policy == "stop":
            raise NonFiniteError(f"{what}; stopped, the last good checkpoint is kept (nan_policy=stop). Lower "
                                 "optim.lr or raise optim.warmup_steps")
        if self.skipped > self.limit:
            raise NonFiniteError(f"{what}; {self.skipped} updates skipped > train.max_skipped_steps={self.limit}; "
                                 "stopped, the last good checkpoint is kept")
        if distributed.is_primary():
            tqdm.write(f"warning: {what}; update skipped ({self.skipped}/{self.limit})", file=sys.stderr)
        return False


def _say(text: str) -> None:
    if distributed.is_primary():
        tqdm.write(text, file=sys.stderr)


def _meta(cfg: Config, step: int, last: dict) -> dict:
    return {"step": step, "config": cfg.to_dict(), "metrics": last}


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, *, fresh: bool = False, max_steps: int | None = None) -> dict:
    """Train (resuming from the run dir's latest checkpoint) up to train.steps or max_steps; final metrics."""
    # SIGTERM is caught from the start: one during setup stops the run before its first step, with exit 0.
    with _Preemption() as pre:
        return _train(cfg, pre, fresh, max_steps)


def _train(cfg: Config, pre: _Preemption, fresh: bool, max_steps: int | None) -> dict:
    t_start = time.perf_counter()
    runtime.enable_compilation_cache(cfg.train.compilation_cache)
    mesh = make_mesh(cfg.mesh)
    check_parallelism(cfg, mesh)
    source = posttrain.source_config(cfg, fresh)  # checked before anything is written
    if not fresh:
        rundir.check_identity(cfg)
    created = rundir.probe_writable(Path(cfg.train.run_dir))
    try:
        prepared, train_it, val, val_sources = open_data(cfg, mesh)
        posttrain.check_tokenizer(cfg, source, prepared.tokenizer)
    except BaseException:
        rundir.remove_created(created)
        raise
    run = rundir.setup(cfg, prepared.tokenizer, fresh)

    progs = make_programs(cfg, mesh)
    ck = Checkpointer(run, cfg.checkpoint)
    restored = ck.restore_latest(progs.target)  # the newest readable checkpoint; unreadable ones are reported
    if restored:
        start, state, data_state, _ = restored
        train_it.set_state(data_state)
        _say(f"resuming from checkpoint {start} in {ck.dir}")
    else:  # a new run: from init_from's trunk when it is set (read only now, before the first checkpoint)
        start, state = 0, progs.init() if source is None else posttrain.initial_state(cfg, source, progs)
    end = min(cfg.train.steps, cfg.train.steps if max_steps is None else max_steps)
    _say(banner(cfg, mesh, run, start, prepared))

    writer = Writer(run, enabled=jax.process_index() == 0)
    if start == 0:
        writer.text(0, "config", cfg.to_yaml())
    peak = cfg.train.peak_flops or measure_peak_flops()
    show = cfg.train.progress and distributed.is_primary()
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not show, desc="train", unit="step")
    log, guard = Logger(cfg, writer, bar, mesh.size, peak), NonFiniteGuard(cfg)
    prof = runtime.Profiler(cfg.train.profile, run / "tensorboard")

    def consume(step: int, met_dev) -> None:  # one step late, so the host never stalls the device
        met = {k: float(v) for k, v in jax.device_get(met_dev).items()}
        bar.update(1)
        if guard.check(step, met):
            log.record(step, met)

    result: dict = {"preempted": False}
    step, pending, saved = start, None, start
    try:
        while step < end and not pre.check(step):
            prof.step(step, state)
            state, met = progs.train_step(state, *to_global(progs, next(train_it)))
            step += 1  # the host's mirror of state.step: one batch, one step, skipped or not
            if pending is not None:
                consume(*pending)
            pending = (step, met)
            if step % cfg.train.eval_every == 0 or step == end or ck.due(step):
                consume(*pending)  # a checkpoint never holds a step whose NaN guard has not been checked yet
                pending = None
            if step % cfg.train.eval_every == 0 or step == end:
                ev = run_eval(progs, state, val, val_sources, lambda b: to_global(progs, b), prepared.tokenizer,
                              writer, step, cfg.train.num_samples, run)
                result.update(ev)
                if ev:
                    _say(f"step {step}: eval loss/main {ev['eval/loss/main']:.4f}" + "".join(
                        f", mtp_{k} {ev[f'eval/loss/mtp_{k}']:.4f}" for k in range(1, cfg.model.mtp_depth + 1)))
                log.restart_clock(step)
            if ck.save(step, state, train_it.get_state(), _meta(cfg, step, log.last), force=step == end):
                saved = step
        result["preempted"] = pre.requested
        if pending is not None:
            consume(*pending)
        if saved != step:  # a run always checkpoints its last step (also when preempted)
            ck.save(step, state, train_it.get_state(), _meta(cfg, step, log.last), force=True)
    finally:
        prof.close(step, state)
        ck.close()
        writer.close()
        bar.close()
    out = {**log.last, **result, "step": step, "skipped_steps": guard.skipped, "history": log.history,
           "seconds": time.perf_counter() - t_start}
    last = ck.dir / str(step)
    _say(summary(cfg, run, out, last if last.is_dir() else None))
    return out
