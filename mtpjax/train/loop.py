"""Training loop (docs/design.md §5): set up (train/setup.py), jit once, loop; the jobs between steps (report,
eval, checkpoint, preemption, profile) are hooks (train/hooks.py), each registered once in `_loop` with its schedule.

Around the loop: `setup` (mesh, run directory and data, programs, first state), `step` (TrainState and the
jitted step), `evals` (the eval job), `report` (banner, metrics, summary), `checkpoint`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np

from mtpjax.config import Config
from mtpjax.parallel import console, distributed, runtime
from mtpjax.train import setup, task_evals
from mtpjax.train.evals import run_eval
from mtpjax.train.goodput import Goodput
from mtpjax.train.hooks import Hooks, Tick
from mtpjax.train.metrics import Writer, device_peak
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
    """SIGTERM, or a first Ctrl-C, sets a flag the loop checks after each step (the handler does nothing else); a
    second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested, self.interrupted, self.old = False, False, {}
        self.stepping = False  # set when the loop begins: before, a stop waits for the setup (data, compile) to end

    def __enter__(self):
        # Several processes must stop at the same step: JAX's preemption sync manager catches SIGTERM there.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            # an ignored SIGINT stays ignored (a background job's, a nohup's): Ctrl-C is not for them
            heard = [sig for sig in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(sig) is not signal.SIG_IGN]
            self.old = {sig: signal.signal(sig, self._handle) for sig in heard}
        return self

    def check(self, step: int) -> bool:
        """Whether to stop after `step` (the same answer on every process)."""
        if jax.process_count() > 1 and not self.requested:
            from jax.experimental import multihost_utils

            self.requested = multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def _handle(self, signum, frame):
        self.requested = True
        if signum == signal.SIGINT and not self.interrupted:
            self.interrupted = True
            signal.signal(signal.SIGINT, self.old[signal.SIGINT])  # the next Ctrl-C: Python's KeyboardInterrupt
            when = b"after this step and saving it" if self.stepping else b"once set up, before the first step"
            os.write(2, b"\ninterrupt: stopping " + when + b" (Ctrl-C again to stop at once)\n")

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C once its step was saved: its caller stops as at any Ctrl-C (a sweep does not go on to
    its next run); `out` is what train() would have returned."""

    def __init__(self, out: dict):
        super().__init__(f"interrupted at step {out['step']}")
        self.out = out


class NonFiniteGuard:
    """train.nan_policy on the host: a skipped (non-finite) step warns, or stops the run past the allowed count."""

    def __init__(self, cfg: Config, skipped: int = 0):
        # `skipped`: the run's skips before this process (a checkpoint's), so a restart does not reset the limit
        self.policy, self.limit, self.skipped = cfg.train.nan_policy, cfg.train.max_skipped_steps, skipped

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
            console.say(f"warning: {what}; update skipped ({self.skipped}/{self.limit})")
        return False


class _Report:
    """The report job: each step's metrics read one step late (the host never stalls the device), through the NaN
    guard into the logger; `sync` reads the step at a tick at once."""

    def __init__(self, cfg: Config, writer: Writer, bar, n_devices: int, start: int = 0, skipped: int = 0):
        self.bar, self.guard = bar, NonFiniteGuard(cfg, skipped)
        peak = device_peak(cfg.train.peak_flops)
        said = f"MFU against {peak.flops:.4g} FLOP/s per device: {peak.source}"
        say(said)
        writer.text(start, "mfu/peak", said)  # at this process's first step: a resumed run's peak, measured anew
        lines = distributed.is_primary() and not (cfg.train.progress and console.live())
        self.log = Logger(cfg, writer, bar, n_devices, peak.flops, lines)
        self.pending, self.seen = None, None

    def read(self, tick: Tick) -> None:
        """Queue this step's metrics and read the previous step's."""
        if self.seen == tick.step:
            return
        self.catch_up()  # the step before is done: this step's clock time (Logger.record)
        self.pending, self.seen = (tick.step, tick.metrics, time.perf_counter()), tick.step

    def sync(self, tick: Tick) -> None:
        """Read this step's metrics now: a job that must see them checked is due."""
        self.read(tick)
        self.catch_up()

    def catch_up(self) -> None:
        """Read the queued step's metrics; NonFiniteError when train.nan_policy stops the run."""
        if self.pending is None:
            return
        (step, met_dev, queued), self.pending = self.pending, None
        met = {k: float(v) for k, v in jax.device_get(met_dev).items()}
        self.bar.update(1)
        if self.guard.check(step, met):
            self.log.record(step, met, queued)


def _count(gp: Goodput, category: str, writer: Writer, step: int) -> None:
    """The time since the last mark went to `category`; the totals go to goodput.json and TensorBoard (one point per
    step, the step's last totals), whose log is flushed: a killed process loses no step up to its last checkpoint (a
    resume purges the ones after it)."""
    gp.mark(category)
    gp.save()
    writer.latest(step, gp.scalars())
    writer.flush()


class _Saving:
    """The checkpoint job: saves when checkpoint.every says; `last` saves the step the run stops at, if not yet."""

    def __init__(self, r: setup.Run, start: int, report: _Report, gp: Goodput, writer: Writer):
        self.r, self.saved, self.report, self.gp, self.writer = r, start, report, gp, writer

    def save(self, tick: Tick, force: bool = False) -> None:
        self.gp.mark("step")
        meta = {"step": tick.step, "config": self.r.cfg.to_dict(), "metrics": self.report.log.last,
                "goodput": self.gp.record(), "skipped_steps": self.report.guard.skipped}
        if self.r.ck.save(tick.step, tick.state, self.r.data.train.get_state(), meta, force=force):
            self.saved = tick.step
            _count(self.gp, "checkpoint", self.writer, tick.step)
            self.report.log.restart_clock(tick.step)  # tokens/s counts steps, not the save's digests and copies

    def last(self, tick: Tick) -> None:
        """A run always checkpoints its last step (also when preempted)."""
        if self.saved != tick.step:
            self.save(tick, force=True)


def _evaluate(r: setup.Run, writer: Writer, report: _Report, result: dict, gp: Goodput):
    """The eval job: validation metrics and samples (train/evals.py), a line per eval; tokens/s restarts after."""

    def job(tick: Tick) -> None:
        gp.mark("step")
        ev = run_eval(r.progs, tick.state, r.data.val, r.data.val_sources, lambda b: to_global(r.progs, b),
                      r.data.prepared.tokenizer, writer, tick.step, r.cfg.train.num_samples, r.dir,
                      tasks=r.data.tasks)
        result.update(ev)
        if ev:
            say(f"step {tick.step}: eval loss/main {ev['eval/loss/main']:.4f}" + "".join(
                f", mtp_{k} {ev[f'eval/loss/mtp_{k}']:.4f}" for k in range(1, r.cfg.model.mtp_depth + 1)))
        _count(gp, "eval", writer, tick.step)
        report.log.restart_clock(tick.step)

    return job


def _task_evaluate(r: setup.Run, writer: Writer, report: _Report, result: dict):
    """The lm-eval job (train.eval_tasks): task scores to TensorBoard beside the losses; tokens/s restarts after."""

    def job(tick: Tick) -> None:
        result.update(task_evals.run_task_eval(r.cfg, r.progs, tick.state, r.data.prepared.tokenizer, writer,
                                               tick.step))
        report.log.restart_clock(tick.step)

    return job


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, *, fresh: bool = False, max_steps: int | None = None) -> dict:
    """Train (resuming from the run dir's latest checkpoint) up to train.steps or max_steps; final metrics. Raises
    Interrupted after a Ctrl-C stopped the run (its step saved)."""
    # SIGTERM and Ctrl-C are caught from the start: one during setup stops the run before its first step.
    with _Preemption() as pre:
        t_start = time.perf_counter()
        run, first = setup.open_run(cfg, fresh, make_programs)
        out = _loop(run, first, pre, max_steps, t_start)
    if pre.interrupted:
        raise Interrupted(out)
    return out


def _loop(r: setup.Run, first: setup.Start, pre: _Preemption, max_steps: int | None, t_start: float) -> dict:
    """Steps from `first` up to train.steps or max_steps, the jobs run between them; the final metrics."""
    cfg, end = r.cfg, min(r.cfg.train.steps, r.cfg.train.steps if max_steps is None else max_steps)
    say(banner(cfg, r.mesh, r.dir, first.step, r.data.prepared, len(r.data.val)))
    writer = Writer(r.dir, enabled=jax.process_index() == 0, purge_step=first.step + 1 if first.step else None)
    if first.step == 0:
        writer.text(0, "config", cfg.to_yaml())
    show = cfg.train.progress and distributed.is_primary()
    bar = console.bar(cfg.train.steps, initial=first.step, enabled=show, desc="train", unit="step")
    prof, result = runtime.Profiler(cfg.train.profile, r.dir / "tensorboard"), {"preempted": False}
    report = _Report(cfg, writer, bar, r.mesh.size, first.step, first.skipped)
    gp = Goodput(r.dir, t_start, enabled=distributed.is_primary())
    gp.start(first.goodput)
    gp.mark("startup")
    gp.move(r.ck.restore_seconds, "startup", "checkpoint")
    saving = _Saving(r, first.step, report, gp, writer)
    hooks = Hooks(sync=report.sync)
    hooks.add(lambda t: gp.mark("compile" if t.step == first.step + 1 else "step"))  # the step just done
    hooks.add(report.read)
    hooks.add(_evaluate(r, writer, report, result, gp), every=lambda s: s % cfg.train.eval_every == 0 or s == end,
              synced=True)
    hooks.add(_task_evaluate(r, writer, report, result), every=lambda s: task_evals.due(cfg, s, end), synced=True)
    hooks.add(saving.save, every=r.ck.due, synced=True)  # a checkpoint never holds a step the guard has not seen
    hooks.add(lambda t: pre.check(t.step), before_step=True)
    hooks.add(lambda t: prof.step(t.step, t.state), before_step=True)
    tick = Tick(first.step, first.state, None, last=first.step >= end)
    pre.stepping = True
    try:
        while not hooks.run(tick) and not tick.last:
            tick = _step(r, tick, prof, first.step, end)
        result["preempted"], result["interrupted"] = pre.requested, pre.interrupted
        report.catch_up()
        saving.last(tick)
    finally:
        prof.close(tick.step, tick.state)
        r.ck.close()
        _count(gp, "checkpoint", writer, tick.step)
        writer.close()
        bar.close()
    out = {**report.log.last, **result, "step": tick.step, "skipped_steps": report.guard.skipped,
           "history": report.log.history, "seconds": time.perf_counter() - t_start,
           "goodput": gp.scalars()["goodput"], "goodput_s": gp.record()}
    last = r.ck.dir / str(tick.step)
    out["checkpoint"] = last if last.is_dir() else None
    say(summary(cfg, r.dir, out, out["checkpoint"]))
    return out


def _step(r: setup.Run, tick: Tick, prof: runtime.Profiler, start: int, end: int) -> Tick:
    """One train step on the stream's next batch: the tick after it."""
    batch = to_global(r.progs, next(r.data.train))
    if tick.step == start and jax.process_count() > 1:
        # Compile, then meet: on CPU, gloo gives up on a collective's first use after 30 s, which a process
        # whose compile ran longer than another's would otherwise miss.
        r.progs.train_step.lower(tick.state, *batch).compile()
        distributed.barrier("train_step compiled")
    with prof.annotate(tick.step + 1):
        state, met = r.progs.train_step(tick.state, *batch)
    return Tick(tick.step + 1, state, met, last=tick.step + 1 == end)  # one batch, one step, skipped or not
