"""Train the runs of the grid one after another, in this process, with train.py's semantics: each run
directory resumes from its latest checkpoint, so a killed sweep re-run finishes with the same losses."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.ablation.grid import Run, flops_per_token
from mtpjax.train import loop as train_loop
from mtpjax.train.checkpoint import ckpt_dir, read_run_config
from mtpjax.eval.log import read_evals
from mtpjax.errors import MtpjaxError
from bench.common import load

LOADS = "loads.jsonl"  # in the sweep's out dir: the load averages and wall seconds of each stretch trained

IGNORED = {("train", "progress"), ("train", "peak_flops"), ("train", "run_dir")}  # may differ between invocations


class SweepError(MtpjaxError, RuntimeError):
    """The out directory holds runs of another sweep; one line naming the fix."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_sweep(runs: list[Run]) -> None:
    """Refuse run dirs trained with other settings: resuming them would mix two schedules in one run.

    Under a constant lr a run's length changes nothing in its first steps (tested: D=0 read at step n of a
    longer run == a run of n steps), so there train.steps may differ: a sweep with more or fewer --steps
    continues or reads the same D=0 run.
    """
    for r in runs:
        old = read_run_config(r.dir)
        if old is None:
            continue
        a, b = _flat(old.to_dict()), _flat(r.cfg.to_dict())
        ignored = IGNORED | ({("train", "steps")} if r.cfg.optim.schedule == "constant" else set())
        diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and tuple(k.split(".", 1)) not in ignored]
        if diff:
            k = diff[0]
            raise SweepError(f"run dir '{r.dir}' was trained with {k}={a.get(k)!r}, this sweep asks {b.get(k)!r}; "
                             "re-run with the same settings to resume, or pass another --out")


def done_step(run: Run) -> int:
    """Latest committed checkpoint step of a run, 0 if none (orbax names a step's directory once it is complete)."""
    d = ckpt_dir(run.dir)
    return max((int(p.name) for p in d.iterdir() if p.name.isdigit()), default=0) if d.is_dir() else 0


def _fmt(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class Progress:
    """ETA from this invocation's seconds per training FLOP, times the FLOPs still to train."""

    def __init__(self, runs: list[Run]):
        self.tokens = {r.dir: r.cfg.train.batch_size * r.cfg.data.seq_len for r in runs}
        self.left = {r.dir: (r.steps - min(done_step(r), r.steps)) * self.tokens[r.dir] * flops_per_token(r.cfg)
                     for r in runs}
        self.seconds = self.flops = 0.0

    def record(self, run: Run, steps_trained: int, seconds: float) -> None:
        done = steps_trained * self.tokens[run.dir] * flops_per_token(run.cfg)
        self.left[run.dir] = max(0.0, self.left[run.dir] - done)
        self.seconds += seconds
        self.flops += done

    def eta(self) -> str:
        left = sum(self.left.values())
        if not left:
            return "done"
        return f"ETA {_fmt(left * self.seconds / self.flops)}" if self.flops else "ETA after the first run"


def record_load(out: Path, run: Run, steps: int, seconds: float) -> None:
    """Append the load averages after a stretch of training (read by report.loads)."""
    with open(Path(out) / LOADS, "a") as f:
        f.write(json.dumps({"run": str(run.dir), "steps": steps, "seconds": round(seconds, 2), "load": load()}) + "\n")


def run_all(runs: list[Run], log=print, out: Path | None = None) -> bool:
    """Train every run to its stops (the load after each stretch into `out`/loads.jsonl); False if a SIGTERM stopped
    the sweep (re-run to continue)."""
    check_same_sweep(runs)
    prog = Progress(runs)
    for i, r in enumerate(runs, 1):
        head = f"[{i}/{len(runs)}] seed {r.seed} {r.dir.name} ({r.variant.label})"
        start = done_step(r)
        if start >= r.steps:
            log(f"{head}: complete ({r.steps} steps); {prog.eta()}")
            continue
        log(f"{head}: steps {start}->{r.steps}, {flops_per_token(r.cfg) / 1e6:.1f} MFLOP/token; {prog.eta()}")
        t0 = time.perf_counter()
        for stop in r.stops:
            # a stop on the eval grid is evaluated on the way to the next one: no need to stop the run there
            if stop <= done_step(r) or (stop % r.cfg.train.eval_every == 0 and stop != r.steps):
                continue
            t1 = time.perf_counter()
            res = train_loop.train(r.cfg, max_steps=stop)
            prog.record(r, len(res["history"]), time.perf_counter() - t1)
            if out is not None:
                record_load(out, r, len(res["history"]), time.perf_counter() - t1)
            if res["preempted"]:
                log(f"{head}: stopped by SIGTERM at step {res['step']}; re-run the same command to continue")
                return False
        ev = read_evals(r.dir)
        last = ev[-1] if ev else {}
        bpb = f", bits/byte {last['bits_per_byte']:.4f}" if "bits_per_byte" in last else ""
        loss = last.get("loss/main", float("nan"))
        log(f"{head}: done in {_fmt(time.perf_counter() - t0)}, eval loss/main {loss:.4f}{bpb} at step"
            f" {last.get('step')}; {prog.eta()}")
    return True
