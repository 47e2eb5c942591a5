"""Every validation eval of a run, one JSON line each in `<run_dir>/eval.jsonl`: curves without TensorBoard.

A resumed run re-evaluates the steps after its last checkpoint and appends them again (with the same
values: training is deterministic); `read_evals` keeps the last record of each step. A line cut short
by a kill is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "eval.jsonl"


def append_eval(run_dir: str | Path, step: int, metrics: dict) -> None:
    """Append {'step': step, **metrics} as one line (one write call, flushed on close)."""
    line = json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}}) + "\n"
    with open(Path(run_dir) / FILE, "a") as f:
        f.write(line)


def read_evals(run_dir: str | Path) -> list[dict]:
    """The eval records of a run sorted by step, the last one written for each step."""
    path = Path(run_dir) / FILE
    by_step: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a kill
                continue
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def agreement_at(run_dir: str | Path, step: int, depth: int) -> list[float] | None:
    """Training's teacher-forced agreement of MTP depths 1..depth at the last eval at or before `step` (None if the
    run logged none): what decode.py's first guess takes for the acceptance by draft position."""
    keys = [f"agreement/mtp_{k}" for k in range(1, depth + 1)]
    recs = [r for r in read_evals(run_dir) if r["step"] <= step and all(k in r for k in keys)]
    return [float(recs[-1][k]) for k in keys] if recs and keys else None
