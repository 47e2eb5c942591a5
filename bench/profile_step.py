"""Where a train step's time goes on this machine: per-XLA-op self time from a jax.profiler trace of a few steps,
joined with the compiled program's op metadata, grouped by kind and by part of the model (docs/performance.md).

    python -m bench.profile_step [--config configs/tiny.yaml] [--steps 3] [--top 15] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from bench.common import log
from bench.train_throughput import random_tokens
from mtpjax.config import load_config
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import make_programs

# attention: its einsums by name, or a tensor with a [T,S]-sized score block
ATTENTION_OP = re.compile(r"bkrts|btkrh|bskh|bkqs|bkqh|bkhs")


def op_metadata(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (result shape, op_name)} of a compiled HLO module's text."""
    meta = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?metadata=\{op_name=\"([^\"]*)\"", line)
        if m and m.group(1) not in meta:
            meta[m.group(1)] = (m.group(2), m.group(3))
    return meta


def classify(name: str, shape: str, op: str, T: int, V: int) -> str:
    """'<part> <kind>': part attention / vocab (head, loss) / rest; kind dot / transpose-copy / elementwise-reduce."""
    # ynn_fusion: XLA CPU's YNNPACK fusion of a dot with what it could fuse around it (a max, a sum)
    moves = op.endswith("transpose") or name.startswith(("copy", "transpose"))
    kind = "dot" if op.endswith("dot_general") or name.startswith("ynn_fusion") else (
        "transpose/copy" if moves else "elementwise/reduce")
    score = re.search(rf",{T}\]", shape) and shape.count(",") >= 3  # [B,K,(R,)T,S] scores
    if ATTENTION_OP.search(op) or score:
        return f"attention {kind}"
    if re.search(rf",{V}\]", shape) or "iota" in name:
        return f"vocab/loss {kind}"
    return f"rest {kind}"


def profile(cfg, steps: int) -> tuple[collections.Counter, dict, float]:
    """(self µs per op over `steps` traced steps, op metadata, wall seconds per step from the step markers)."""
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state = progs.init()
    tok = jax.device_put(random_tokens(cfg), progs.batch_sharding)
    seg = jax.device_put(np.ones_like(random_tokens(cfg)), progs.batch_sharding)
    meta = op_metadata(progs.train_step.lower(state, tok, seg).compile().as_text())
    for _ in range(2):
        state, met = progs.train_step(state, tok, seg)
    jax.block_until_ready(met)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for s in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=s):
                state, met = progs.train_step(state, tok, seg)
                jax.block_until_ready(met)
        jax.profiler.stop_trace()
        (trace,) = Path(d).glob("plugins/profile/*/*.trace.json.gz")
        events = json.load(gzip.open(trace))["traceEvents"]
    self_us = collections.Counter()
    step_us = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if "hlo_op" in e.get("args", {}):
            self_us[e["name"]] += e["dur"]
        elif e.get("name", "").startswith("train") and e.get("dur", 0) > 0 and "step_num" in str(e.get("args", {})):
            step_us.append(e["dur"])
    return self_us, meta, float(np.median(step_us)) / 1e6 if step_us else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    self_us, meta, step_s = profile(cfg, args.steps)
    total = sum(self_us.values())
    T, V = cfg.data.seq_len, cfg.model.vocab_size
    parts = collections.Counter()
    for name, us in self_us.items():
        parts[classify(name, *meta.get(name, ("", "")), T, V)] += us
    log(f"{args.config} {' '.join(args.overrides)}: {step_s * 1e3:.1f} ms/step (step markers), "
        f"{total / args.steps / 1e3:.1f} ms of XLA op time per step")
    print("| part, kind | share of op time |\n|---|---|")
    for k, us in parts.most_common():
        print(f"| {k} | {us / total:.1%} |")
    print("\n| op | share | ms/step | result | op_name (tail) |\n|---|---|---|---|---|")
    for name, us in self_us.most_common(args.top):
        shape, op = meta.get(name, ("?", "?"))
        print(f"| {name} | {us / total:.1%} | {us / args.steps / 1e3:.1f} | `{shape.split('{')[0]}` | "
              f"`{op.split('closed_call/')[-1][-60:]}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
