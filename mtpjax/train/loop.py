"""Training loop (docs/design.md §5): set up in stages (train/setup.py), jit once, loop; eval, checkpoints, NaN
guard and preemption hang off it.

Around the loop: `setup` (mesh, run directory and data, programs, first state), `step` (TrainState and the
jitted step), `evals` (the eval hook), `report` (banner, metrics, summary), `checkpoint`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import jax
import numpy as np
from tqdm import tqdm

from mtpjax.config import Config
from mtpjax.parallel import distributed, runtime
from mtpjax.train import posttrain, setup
from mtpjax.train.checkpoint import Checkpointer
from mtpjax.train.evals import run_eval
from mtpjax.train.metrics import Writer, measure_peak_flops
from mtpjax.train.owntext import use_own_text
from mtpjax.train.report import Logger, banner, say, summary
from mtpjax.train.setup import TrainError
from mtpjax.train.step import Programs, make_programs


class NonFiniteError(TrainError):
    """The loss or gradient became non-finite beyond what train.nan_policy allows."""

    exit_status = 1  # a divergence, not bad input


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
    mesh = setup.open_mesh(cfg)
    source = posttrain.source_config(cfg, fresh)  # a new run's init_from, checked before anything is written
    run_dir, run_data = setup.open_run_dir(cfg, mesh, fresh, source)
    run_data = use_own_text(cfg, run_dir, run_data, mesh)  # train.own_text: the trunk's continuations instead
    run = setup.Run(cfg, mesh, run_dir, run_data, make_programs(cfg, mesh), Checkpointer(run_dir, cfg.checkpoint))
    return _loop(run, setup.open_state(run, source), pre, max_steps, t_start)


def _loop(r: setup.Run, first: setup.Start, pre: _Preemption, max_steps: int | None, t_start: float) -> dict:
    """The loop from `first` up to train.steps or max_steps; the final metrics."""
    cfg, mesh, run, progs, ck = r.cfg, r.mesh, r.dir, r.progs, r.ck
    prepared, train_it, val, val_sources = r.data.prepared, r.data.train, r.data.val, r.data.val_sources
    start, state = first.step, first.state
    end = min(cfg.train.steps, cfg.train.steps if max_steps is None else max_steps)
    say(banner(cfg, mesh, run, start, prepared))

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
            batch = to_global(progs, next(train_it))
            if step == start and jax.process_count() > 1:
                # Compile, then meet: on CPU, gloo gives up on a collective's first use after 30 s, which a process
                # whose compile ran longer than another's would otherwise miss.
                progs.train_step.lower(state, *batch).compile()
                distributed.barrier("train_step compiled")
            with prof.annotate(step + 1):
                state, met = progs.train_step(state, *batch)
            step += 1  # the host's mirror of state.step: one batch, one step, skipped or not
            if pending is not None:
                consume(*pending)
            pending = (step, met)
            if step % cfg.train.eval_every == 0 or step == end or ck.due(step):
                consume(*pending)  # a checkpoint never holds a step whose NaN guard has not been checked yet
                pending = None
            if step % cfg.train.eval_every == 0 or step == end:
                ev = run_eval(progs, state, val, val_sources, lambda b: to_global(progs, b), prepared.tokenizer,
                              writer, step, cfg.train.num_samples, run, tasks=r.data.tasks)
                result.update(ev)
                if ev:
                    say(f"step {step}: eval loss/main {ev['eval/loss/main']:.4f}" + "".join(
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
    say(summary(cfg, run, out, last if last.is_dir() else None))
    return out
