"""Goodput: the share of a run's wall time spent on training steps, over all its restarts (as MaxText reports it).

The loop marks where its time went; each mark gives the time since the previous one to one category:
`step` (productive: the steps that count), `compile` (the first step of a process: tracing, compiling, the
collectives' first meeting), `checkpoint` (saving, waiting for saves, restoring), `eval`, `startup` (mesh, data,
programs before the first step), and `restart` (steps done before an interruption and lost with it: their
time moves from `step` to `restart` when a resumed run redoes them). goodput = step / total.

Totals carry over restarts: each checkpoint's meta holds the totals when it was saved and `<run_dir>/goodput.json`
the latest (written at each checkpoint, eval and the end). A resumed run starts from goodput.json's totals and
moves the productive time past its checkpoint to `restart`. Time after the last write of a killed process
(at most one eval/checkpoint interval) is not counted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CATEGORIES = ("step", "compile", "checkpoint", "eval", "startup", "restart")
FILE = "goodput.json"


def goodput(totals: dict) -> float:
    """Productive seconds over all seconds (0 before any time is counted)."""
    total = sum(totals.values())
    return totals.get("step", 0.0) / total if total > 0 else 0.0


def resumed(latest: dict | None, at_checkpoint: dict | None) -> dict:
    """The totals a run starts from: `latest` (goodput.json) with its steps past the checkpoint lost (`at_checkpoint`:
    that checkpoint's totals, zeros when the run starts at step 0, None when the checkpoint recorded none)."""
    out = {c: 0.0 for c in CATEGORIES}
    out.update(latest or at_checkpoint or {})
    if at_checkpoint is not None and latest is not None:
        lost = max(0.0, out["step"] - at_checkpoint.get("step", 0.0))
        out["step"] -= lost
        out["restart"] += lost
    return out


class Goodput:
    """Seconds per category since `t0` (this process's start) on top of the earlier processes' totals."""

    def __init__(self, run_dir: str | Path, t0: float, *, enabled: bool = True):
        self.path, self.enabled = Path(run_dir) / FILE, enabled
        self.totals = {c: 0.0 for c in CATEGORIES}
        self.last = t0

    def start(self, at_checkpoint: dict | None) -> None:
        """Carry over the earlier processes' totals (see `resumed`)."""
        latest = None
        if self.path.is_file():
            try:
                latest = json.loads(self.path.read_text())
            except ValueError:
                latest = None
        earlier = resumed(latest, at_checkpoint)
        for c in CATEGORIES:
            self.totals[c] += earlier.get(c, 0.0)

    def mark(self, category: str) -> None:
        """The time since the previous mark went to `category`."""
        now = time.perf_counter()
        self.totals[category] += now - self.last
        self.last = now

    def record(self) -> dict:
        """The totals now (seconds by category), as a checkpoint's meta stores them."""
        return dict(self.totals)

    def save(self) -> None:
        """Write the totals to goodput.json (process 0; renamed into place, never half-written)."""
        if self.enabled:
            tmp = self.path.with_name(f".{FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(self.totals))
            os.replace(tmp, self.path)

    def scalars(self) -> dict:
        """TensorBoard scalars: `goodput` and the seconds of each category."""
        return {"goodput": goodput(self.totals)} | {f"goodput/{c}_s": v for c, v in self.totals.items()}

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Count `seconds` already given to `src` as `dst` instead."""
        self.totals[src] -= seconds
        self.totals[dst] += seconds


def line(totals: dict) -> str:
    """The goodput part of the summary's first line."""
    rest = ", ".join(f"{c} {totals[c]:.1f} s" for c in CATEGORIES[1:])
    return f"goodput {goodput(totals):.0%} ({totals['step']:.1f} s of steps in {sum(totals.values()):.1f} s; {rest})"
