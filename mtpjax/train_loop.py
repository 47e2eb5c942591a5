"""The training loop (DESIGN §5): build once, jit once, loop; eval, checkpoints, TensorBoard, NaN guard, preemption."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from mtpjax import data, distributed, runtime
from mtpjax.checkpoint import Checkpointer, CheckpointError, read_run_config
from mtpjax.config import Config, ConfigError, identity, load_config
from mtpjax.flops import train_flops_per_token
from mtpjax.metrics import Writer, measure_peak_flops, mfu
from mtpjax.sharding import MeshError, batch_sharding, data_parallelism, make_mesh, replicated
from mtpjax.train_step import Programs, abstract_state, init_state, make_programs

IDENTITY_SECTIONS = ("model", "data")  # what makes a run dir "the same run"; other sections may change on resume
SAMPLE_PROMPT = 32


class TrainError(RuntimeError):
    """Bad training setup (batch/mesh, run dir); the message is one line naming the problem and the fix."""


class NonFiniteError(TrainError):
    """The loss or gradient became non-finite beyond what train.nan_policy allows."""


# ----------------------------------------------------------------------------- checks before anything is written


def check_parallelism(cfg: Config, mesh) -> None:
    """The batch must split evenly over data parallelism, micro-batches and processes."""
    dp, B, M = data_parallelism(mesh), cfg.train.batch_size, cfg.train.micro_batches
    if B % (dp * M):
        raise TrainError(f"train.batch_size={B} is not divisible by data parallelism mesh.data*mesh.fsdp={dp} "
                         f"times train.micro_batches={M}; use a multiple of {dp * M}")
    if B % jax.process_count():
        raise TrainError(f"train.batch_size={B} is not divisible by the {jax.process_count()} processes")


def _diff(a, b, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}.{k}")]
    return [] if a == b else [f"{prefix.lstrip('.')}: {a!r} -> {b!r}"]


def check_run_dir(cfg: Config) -> bool:
    """Refuse a run dir whose saved model/data config differs; True if it holds a previous run."""
    run = Path(cfg.train.run_dir)
    old = read_run_config(run)
    if old is None:
        return run.exists() and any(run.iterdir())
    diffs = [d for s in IDENTITY_SECTIONS for d in _diff(identity(old, s), identity(cfg, s), s)]
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; +{len(diffs) - 3} more" if len(diffs) > 3 else "")
        raise TrainError(f"run dir '{run}' holds a run with a different model/data config ({shown}); pass --fresh "
                         "to move it aside, or set another train.run_dir")
    return True


def probe_writable(run: Path) -> None:
    """Create the run dir (if missing) and write a probe file; TrainError if impossible."""
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / f".write-probe-{time.time_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"train.run_dir '{run}' is not writable ({e.strerror or e}); choose a writable "
                         "train.run_dir") from None


def setup_run_dir(cfg: Config, prepared, fresh: bool) -> Path:
    """--fresh moves an old run to <run_dir>.old-<timestamp> (never deletes); writes config.yaml and tokenizer/."""
    run = Path(cfg.train.run_dir)
    if fresh and jax.process_index() == 0 and run.exists() and any(run.iterdir()):
        aside = run.with_name(f"{run.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}")
        run.rename(aside)
        print(f"moved the previous run aside to {aside}", file=sys.stderr)
    if jax.process_index() == 0:
        run.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a kill mid-write must not leave a truncated config that blocks resuming.
        tmp = run / f".config.yaml.tmp-{time.time_ns()}"
        tmp.write_text(cfg.to_yaml())
        tmp.replace(run / "config.yaml")
        prepared.tokenizer.save(run / "tokenizer")
    distributed.barrier("mtpjax-run-dir")  # no process may look for checkpoints before the run dir is set up
    return run


# ----------------------------------------------------------------------------- data


def open_data(cfg: Config, mesh):
    """(prepared corpus, train iterator, validation batches, per-source validation batches); DataError on bad input."""
    return data.open_run_data(cfg, batch_sharding(mesh))  # each process reads its rows of every global batch


def to_global(progs: Programs, batch: dict):
    """This process's numpy rows -> global arrays sharded over ('data','fsdp')."""
    put = lambda x: jax.make_array_from_process_local_data(progs.batch_sharding, np.asarray(x, np.int32))
    return put(batch["tokens"]), put(batch["segment_ids"])


# ----------------------------------------------------------------------------- eval and samples


def evaluate(progs: Programs, state, val: list, step: int) -> dict:
    """Mean validation metrics over the fixed eval batches."""
    mets = [progs.eval_step(state, *to_global(progs, b), np.int32(step)) for b in val]
    mets = jax.device_get(mets)
    return {k: float(np.mean([m[k] for m in mets])) for k in mets[0]}


def samples(progs: Programs, state, val: list, tokenizer, n: int) -> list[str]:
    """Greedy continuations of the first validation rows' opening tokens, as text."""
    rows = np.asarray(val[0]["tokens"])[:n, :SAMPLE_PROMPT]
    if jax.process_count() > 1:  # a replicated prompt must be the same on every process: process 0's rows
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.broadcast_one_to_all(rows))
    prompt = jax.device_put(rows.astype(np.int32), replicated(progs.batch_sharding.mesh))
    out = np.asarray(jax.device_get(progs.sample(state, prompt)))
    return [tokenizer.decode(p.tolist()) + " ⟶ " + tokenizer.decode(o.tolist()) for p, o in zip(rows, out)]


# ----------------------------------------------------------------------------- the loop


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


class _Logger:
    """Consumes each step's metrics one step late: NaN guard, TensorBoard, progress bar, throughput."""

    def __init__(self, cfg: Config, writer: Writer, bar, n_devices: int, peak: float):
        self.cfg, self.writer, self.bar = cfg, writer, bar
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self.flops = train_flops_per_token(cfg.model, cfg.data.seq_len)
        self.n_devices, self.peak = n_devices, peak
        self.skipped, self.history, self.last = 0, [], {}
        self.t0, self.s0 = None, None

    def restart_clock(self, step: int) -> None:
        """Exclude compilation, eval and checkpoint time from tokens/s."""
        self.t0, self.s0 = time.perf_counter(), step

    def consume(self, step: int, met_dev) -> None:
        met = {k: float(v) for k, v in jax.device_get(met_dev).items()}
        self.bar.update(1)
        if met.pop("skipped"):
            self._non_finite(step, met)
            return
        self.last = met
        self.history.append((step, met["loss/total"]))
        if self.t0 is None:
            self.restart_clock(step)  # the first fetched step included compilation
        elif step % self.cfg.train.log_every == 0 and step > self.s0:
            tps = (step - self.s0) * self.tokens_per_step / (time.perf_counter() - self.t0)
            extra = {"tokens_per_sec": tps, "mfu": mfu(tps, self.flops, self.peak, self.n_devices)}
            self.writer.scalars(step, {k: v for k, v in met.items() if k != "loss/total"} | extra)
            self.bar.set_postfix(loss=f"{met['loss/main']:.3f}", tok_s=f"{tps:,.0f}")
            self.restart_clock(step)

    def _non_finite(self, step: int, met: dict) -> None:
        self.skipped += 1
        t = self.cfg.train
        what = f"non-finite loss/gradient at step {step} (loss {met['loss/total']}, grad_norm {met['grad_norm']})"
        if t.nan_policy == "stop":
            raise NonFiniteError(f"{what}; stopped, the last good checkpoint is kept (nan_policy=stop). Lower "
                                 "optim.lr or raise optim.warmup_steps")
        if self.skipped > t.max_skipped_steps:
            raise NonFiniteError(f"{what}; {self.skipped} updates skipped > train.max_skipped_steps="
                                 f"{t.max_skipped_steps}; stopped, the last good checkpoint is kept")
        if distributed.is_primary():
            tqdm.write(f"warning: {what}; update skipped ({self.skipped}/{t.max_skipped_steps})", file=sys.stderr)


def _meta(cfg: Config, step: int, last: dict) -> dict:
    # The model has no stochastic layers; data order is in the iterator state. The key is saved for
    # completeness (and future dropout) so that resume reproduces every random stream.
    key = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.train.seed), step)))
    return {"step": step, "rng": key.tolist(), "config": cfg.to_dict(), "metrics": last}


def train(cfg: Config, *, fresh: bool = False, max_steps: int | None = None) -> dict:
    """Train (resuming from the run dir's latest checkpoint) up to train.steps or max_steps; final metrics."""
    # SIGTERM is caught from the start: one during setup stops the run before its first step, with exit 0.
    with _Preemption() as pre:
        return _train(cfg, pre, fresh, max_steps)


def _train(cfg: Config, pre: _Preemption, fresh: bool, max_steps: int | None) -> dict:
    runtime.enable_compilation_cache(cfg.train.compilation_cache)
    mesh = make_mesh(cfg.mesh)
    check_parallelism(cfg, mesh)
    if not fresh:
        check_run_dir(cfg)
    probe_writable(Path(cfg.train.run_dir))
    prepared, train_it, val, val_sources = open_data(cfg, mesh)
    run = setup_run_dir(cfg, prepared, fresh)

    graphdef, target, shardings = abstract_state(cfg, mesh)
    progs = make_programs(cfg, mesh, graphdef, shardings)
    ck = Checkpointer(run, cfg.checkpoint)
    restored = ck.restore_latest(target)  # the newest readable checkpoint; unreadable ones are reported
    start = restored[0] if restored else 0
    if restored:
        state, data_state = restored[1:3]
        train_it.set_state(data_state)
        if distributed.is_primary():
            print(f"resuming from checkpoint {start} in {ck.dir}", file=sys.stderr, flush=True)
    else:
        state = init_state(cfg, mesh, shardings)
    end = min(cfg.train.steps, cfg.train.steps if max_steps is None else max_steps)

    writer = Writer(run, enabled=jax.process_index() == 0)
    if start == 0:
        writer.text(0, "config", cfg.to_yaml())
    peak = cfg.train.peak_flops or measure_peak_flops()
    show = cfg.train.progress and distributed.is_primary()
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not show, desc="train", unit="step")
    log = _Logger(cfg, writer, bar, mesh.size, peak)
    prof = runtime.Profiler(cfg.train.profile, run / "tensorboard")
    result: dict = {"preempted": False}
    step, pending, saved = start, None, start
    try:
        while step < end and not pre.check(step):
            prof.step(step, state)
            state, met = progs.train_step(state, *to_global(progs, next(train_it)), np.int32(step))
            step += 1
            if pending is not None:
                log.consume(*pending)
            pending = (step, met)
            if step % cfg.train.eval_every == 0 or step == end or ck.due(step):
                # A checkpoint never holds a step whose NaN guard has not been checked yet.
                log.consume(*pending)
                pending = None
            if step % cfg.train.eval_every == 0 or step == end:
                result.update(_eval(cfg, progs, state, val, val_sources, prepared.tokenizer, writer, step))
                log.restart_clock(step)
            if ck.save(step, state, train_it.get_state(), _meta(cfg, step, log.last), force=step == end):
                saved = step
        result["preempted"] = pre.requested
        if pending is not None:
            log.consume(*pending)
        if saved != step:  # a run always checkpoints its last step (also when preempted)
            ck.save(step, state, train_it.get_state(), _meta(cfg, step, log.last), force=True)
    finally:
        prof.close(step, state)
        ck.close()
        writer.close()
        bar.close()
    return {**log.last, **result, "step": step, "skipped_steps": log.skipped, "history": log.history}


def _eval(cfg, progs, state, val, val_sources, tokenizer, writer: Writer, step: int) -> dict:
    if not val:
        return {}
    ev = evaluate(progs, state, val, step)
    keep = {k: v for k, v in ev.items() if k.startswith(("loss/", "agreement/", "accuracy/"))}
    keep |= data.eval_by_source(val_sources, lambda batches: evaluate(progs, state, batches, step), list(keep))
    writer.scalars(step, keep, prefix="eval/")
    for i, text in enumerate(samples(progs, state, val, tokenizer, cfg.train.num_samples)):
        writer.text(step, f"samples/{i}", text)
    writer.flush()
    if distributed.is_primary():
        tqdm.write(f"step {step}: eval loss/main {ev['loss/main']:.4f}"
                   + "".join(f", mtp_{k} {ev[f'loss/mtp_{k}']:.4f}" for k in range(1, cfg.model.mtp_depth + 1)),
                   file=sys.stderr)
    return {f"eval/{k}": v for k, v in keep.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI: train.py --config PATH [--fresh] [section.key=value ...]; exit 2 on bad input, 1 on divergence."""
    ap = argparse.ArgumentParser(prog="train.py", description="Pretrain an MTP language model.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("--fresh", action="store_true", help="move an existing run dir aside and start over")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = ap.parse_intermixed_args(argv)
    try:
        distributed.initialize()  # before any other JAX use; a no-op on one process
        cfg = load_config(args.config, args.overrides)
        out = train(cfg, fresh=args.fresh)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, data.DataError, CheckpointError, MeshError, TrainError, distributed.DistributedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out["preempted"] and distributed.is_primary():
        print(f"preempted: checkpoint saved at step {out['step']}", file=sys.stderr)
    return 0
