"""configs/moe_tiny.yaml against configs/tiny.yaml (dense, equal active parameters): training time per token and the
expert load after warm-up, balanced by the routing bias alone.

    python -m bench.moe_tiny [--warmup 60 --rounds 4 --steps 3] [moe_tiny overrides: train.bias_update_speed=0.05]

Both train on byte windows of Python standard-library sources; the MoE run first trains `--warmup` steps, then the
two step functions alternate in rounds of `--steps` steps each (one process, interleaved), and the MoE steps' load
max/mean (the worst layer) is averaged over the timed steps.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np

from mtpjax.config import load_config
from mtpjax.nn.model import build_model, param_counts
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import make_programs

ROOT = Path(__file__).resolve().parent.parent


def byte_batches(n: int, batch: int, seq_len: int, seed: int = 0):
    """n [batch, seq_len] windows of standard-library source bytes (one document per row)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    data = np.frombuffer(b"".join(p.read_bytes() for p in sorted(lib.glob("*.py"))[:80]), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    for _ in range(n):
        starts = rng.integers(0, len(data) - seq_len, batch)
        yield np.stack([data[s:s + seq_len] for s in starts]), np.ones((batch, seq_len), np.int32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="section.key=value for configs/moe_tiny.yaml")
    a = ap.parse_args(argv)
    runs = {}
    for name in ("tiny", "moe_tiny"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", a.overrides if name == "moe_tiny" else [])
        progs = make_programs(cfg, make_mesh(cfg.mesh))
        runs[name] = [cfg, progs, progs.init(), param_counts(jax.eval_shape(lambda c=cfg: build_model(c)))]
    cfg = runs["moe_tiny"][0]
    B, T = cfg.train.batch_size, cfg.data.seq_len
    batches = byte_batches(a.warmup + 2 * a.rounds * a.steps + 4, B, T)
    for run in runs.values():  # compile
        run[2], _ = run[1].train_step(run[2], *next(batches))
    warm = []
    for _ in range(a.warmup):
        runs["moe_tiny"][2], met = runs["moe_tiny"][1].train_step(runs["moe_tiny"][2], *next(batches))
        warm.append(float(met["moe/load_max_over_mean"]))
    times, balance, layers = {n: [] for n in runs}, [], {}
    for _ in range(a.rounds):
        for name, run in runs.items():
            bs = [next(batches) for _ in range(a.steps)]
            jax.block_until_ready(run[2])
            t0 = time.perf_counter()
            for b in bs:
                run[2], met = run[1].train_step(run[2], *b)
            jax.block_until_ready(met)
            times[name].append((time.perf_counter() - t0) / (a.steps * B * T))
            if name == "moe_tiny":
                balance.append(float(met["moe/load_max_over_mean"]))
                for k, v in met.items():
                    if k.endswith("load_max_over_mean") and k != "moe/load_max_over_mean":
                        layers.setdefault(k.split("/")[1], []).append(float(v))
    dense, moe = (np.median(times[n]) for n in ("tiny", "moe_tiny"))
    ratios = [m / d for m, d in zip(times["moe_tiny"], times["tiny"])]
    print(f"{jax.default_backend()} batch {B}x{T}, warm-up {a.warmup} steps, {a.rounds} rounds x {a.steps} steps, "
          f"load average {os.getloadavg()[0]:.1f}, moe_tiny overrides {a.overrides}")
    print("| model | total params | active params | µs per token | vs dense |\n|---|---|---|---|---|")
    for name, t in (("tiny", dense), ("moe_tiny", moe)):
        c = runs[name][3]
        print(f"| {name} | {c['total']:,} | {c['active']:,} | {1e6 * t:.1f} | {t / dense:.2f} |")
    print(f"per-round ratio MoE/dense: median {np.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    print(f"expert load max/mean (worst layer): warm-up start {warm[0]:.2f}, end {warm[-1]:.2f}; "
          f"timed steps {np.mean(balance):.2f}")
    print("warm-up trace (every 10th step): " + " ".join(f"{v:.2f}" for v in warm[::10]))
    print("per layer (timed steps): " + ", ".join(f"{k} {np.mean(v):.2f}" for k, v in layers.items()))


if __name__ == "__main__":
    main()
