"""Where a train step's time goes on this machine: per-XLA-op self time from a jax.profiler trace of a few steps,
joined with the compiled program's op metadata, grouped by kind and by part of the model (docs/performance.md).

    python -m bench.profile_step [--config configs/tiny.yaml] [--steps 3] [--top 15] [section.key=value ...]
    python -m bench.profile_step --cores-split ...   # each op's time on every core beside its time on one core

--cores-split traces the same compiled step twice in one process, first on all of the process's cores, then with
every thread pinned to one core: an op's one-core time is its work, and its time on all cores over that is how
well XLA spread it over the cores (1.0: it ran on one thread).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from bench.common import log
from bench.train_throughput import compiled_step
from mtpjax.config import load_config

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
    # GPU: cuBLAS products are custom-calls (a backward's named .../transpose), fused kernels pallas_call or cuDNN's
    gemm = name.startswith(("ynn_fusion", "cublas", "gemm_fusion")) or (
        name.startswith("custom-call") and "sort" not in op)
    moves = op.endswith("transpose") or name.startswith(("copy", "transpose"))
    kind = "kernel" if name.startswith(("pallas_call", "dot_product_attention")) else "dot" if (
        op.endswith("dot_general") or gemm) else "transpose/copy" if moves else "elementwise/reduce"
    score = re.search(rf",{T}\]", shape) and shape.count(",") >= 3  # [B,K,(R,)T,S] scores
    if ATTENTION_OP.search(op) or score or "/attention/" in op:
        return f"attention {kind}"
    if re.search(rf",{V}\]", shape) or "iota" in name or "/head/" in op:
        return f"vocab/loss {kind}"
    return f"rest {kind}"


def pin_threads(cpus: set[int]) -> None:
    """Pin every thread of this process (XLA's pools included) to `cpus`; sched_setaffinity(0) moves only the caller."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def make_step(cfg, save: str | None = None):
    """(a closure tracing `steps` train steps, the compiled program's op metadata); compiled and warmed up.
    With `save`, the compiled HLO text and the last trace are kept there (gzipped)."""
    step, compiled = compiled_step(cfg)
    text = compiled.as_text()
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        with gzip.open(Path(save) / "step.hlo.txt.gz", "wt") as f:
            f.write(text)
    return (lambda steps: trace_steps(step, steps, save)), op_metadata(text)


def trace_steps(step, steps: int, save: str | None = None) -> tuple[collections.Counter, float]:
    """(self µs per op over `steps` traced steps, wall seconds per step from the step markers)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for s in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=s):
                step()
        jax.profiler.stop_trace()
        (trace,) = Path(d).glob("plugins/profile/*/*.trace.json.gz")
        if save:
            shutil.copy(trace, Path(save) / "step.trace.json.gz")
        events = json.load(gzip.open(trace))["traceEvents"]
    self_us = collections.Counter()
    step_us = []
    for e in events:
        if e.get("ph") != "X":
            continue
        if "hlo_op" in e.get("args", {}):  # a GPU kernel's name is the library's; its hlo_op is the instruction's
            self_us[e["args"]["hlo_op"]] += e["dur"]
        elif e.get("name", "").startswith("train") and e.get("dur", 0) > 0 and "step_num" in str(e.get("args", {})):
            step_us.append(e["dur"])
    return self_us, float(np.median(step_us)) / 1e6 if step_us else float("nan")


def parts_of(self_us: collections.Counter, meta: dict, T: int, V: int) -> collections.Counter:
    """Self µs summed by '<part> <kind>'."""
    parts = collections.Counter()
    for name, us in self_us.items():
        parts[classify(name, *meta.get(name, ("", "")), T, V)] += us
    return parts


def print_split(all_us, one_us, meta, steps: int, n: int, T: int, V: int, top: int) -> None:
    """Per part and per op: ms/step on n cores and on one, the spread (one-core time over n-core time) and the
    core-ms per step left idle while it ran (n × its time − its one-core time: 0 when it kept every core busy)."""
    def rows(a, b):
        return sorted(((k, a[k] / steps / 1e3, b[k] / steps / 1e3) for k in a if k in b),
                      key=lambda r: -(n * r[1] - r[2]))
    print(f"| part, kind | ms/step, {n} cores | ms/step, 1 core | spread | idle core-ms/step |\n|---|---|---|---|---|")
    for k, t2, t1 in rows(parts_of(all_us, meta, T, V), parts_of(one_us, meta, T, V)):
        print(f"| {k} | {t2:.1f} | {t1:.1f} | {t1 / t2:.2f} | {n * t2 - t1:.1f} |")
    print(f"\n| op | ms/step, {n} cores | ms/step, 1 core | spread | idle core-ms/step | result |\n"
          "|---|---|---|---|---|---|")
    for k, t2, t1 in rows(all_us, one_us)[:top]:
        shape = meta.get(k, ("?",))[0].split("{")[0]
        print(f"| {k} | {t2:.2f} | {t1:.2f} | {t1 / t2:.2f} | {n * t2 - t1:.2f} | `{shape}` |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--cores-split", action="store_true", help="also trace on one core; print each op's spread")
    ap.add_argument("--save", help="keep the compiled HLO text and the trace (gzipped) in this folder")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    run, meta = make_step(cfg, args.save)
    self_us, step_s = run(args.steps)
    total = sum(self_us.values())
    T, V = cfg.data.seq_len, cfg.model.vocab_size
    log(f"{args.config} {' '.join(args.overrides)}: {step_s * 1e3:.1f} ms/step (step markers), "
        f"{total / args.steps / 1e3:.1f} ms of XLA op time per step")
    if args.cores_split:
        cpus = os.sched_getaffinity(0)
        pin_threads({min(cpus)})
        one_us, one_s = run(args.steps)
        pin_threads(cpus)
        log(f"  pinned to one core: {one_s * 1e3:.1f} ms/step, {sum(one_us.values()) / args.steps / 1e3:.1f} ms of "
            f"op time; on {len(cpus)} cores the step ran {one_s / step_s:.2f}x faster")
        print_split(self_us, one_us, meta, args.steps, len(cpus), T, V, args.top)
        return 0
    print("| part, kind | share of op time |\n|---|---|")
    for k, us in parts_of(self_us, meta, T, V).most_common():
        print(f"| {k} | {us / total:.1%} |")
    print("\n| op | share | ms/step | result | op_name (tail) |\n|---|---|---|---|---|")
    for name, us in self_us.most_common(args.top):
        shape, op = meta.get(name, ("?", "?"))
        print(f"| {name} | {us / total:.1%} | {us / args.steps / 1e3:.1f} | `{shape.split('{')[0]}` | "
              f"`{op.split('closed_call/')[-1][-60:]}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
