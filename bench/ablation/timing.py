"""Step time of each variant relative to D=0, measured side by side in one process (interleaved rounds,
median of per-round ratios), not from the sweep's wall clock, which the shared machine's load distorts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.common import interleave, load, median_ratio
from bench.train_throughput import make_stepper
from mtpjax.config import Config

FILE = "step_times.json"


def measure(cfgs: dict[str, Config], rounds: int) -> dict:
    """{'variants': {name: {'seconds', 'ratio'}}, 'rounds', 'load'}; ratios against the variant named 'd0'."""
    steppers = {name: make_stepper(cfg) for name, cfg in cfgs.items()}  # compiled and warmed up
    times = interleave(steppers, rounds)
    out = {name: {"seconds": float(np.median(t)), "ratio": median_ratio(t, times["d0"])} for name, t in times.items()}
    return {"variants": out, "rounds": rounds, "load": load()}


def cached_measure(out_dir: Path, cfgs: dict[str, Config], rounds: int) -> dict:
    """measure(), reused from `<out>/step_times.json` when it holds the same variants and rounds."""
    path = Path(out_dir) / FILE
    if path.is_file():
        old = json.loads(path.read_text())
        if set(old["variants"]) == set(cfgs) and old["rounds"] == rounds:
            return old
    res = measure(cfgs, rounds)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)
    return res
