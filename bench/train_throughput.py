"""Train-step throughput: tokens/s and MFU against this machine's matmul peak (measured in the same run),
and the step-time cost of MTP depth 1, 2, 3 relative to 0 beside the FLOP ratio.

    python bench/train_throughput.py [--config configs/tiny.yaml] [--steps 5] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.flops import train_flops_per_token  # noqa: E402
from mtpjax.metrics import measure_peak_flops, mfu  # noqa: E402
from mtpjax.sharding import make_mesh  # noqa: E402
from mtpjax.train_step import abstract_state, init_state, make_programs  # noqa: E402


def step_time(cfg, steps: int) -> float:
    """Median seconds per jitted train step on random tokens (after two warm-up steps)."""
    mesh = make_mesh(cfg.mesh)
    graphdef, _, sh = abstract_state(cfg, mesh)
    progs = make_programs(cfg, mesh, graphdef, sh)
    state = init_state(cfg, mesh, sh)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    tok = jax.device_put(rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32), progs.batch_sharding)
    seg = jax.device_put(np.ones((B, T), np.int32), progs.batch_sharding)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, met = progs.train_step(state, tok, seg, np.int32(i))
        jax.block_until_ready(met)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    base = load_config(args.config, args.overrides)
    peak = measure_peak_flops()
    n_dev = jax.device_count()
    tokens = base.train.batch_size * base.data.seq_len
    print(f"devices: {n_dev} x {jax.devices()[0].platform}; measured f32 matmul peak {peak / 1e9:.1f} GFLOP/s per device")
    print(f"model d={base.model.d_model} L={base.model.n_layers} V={base.model.vocab_size} "
          f"batch {base.train.batch_size} x seq {base.data.seq_len} = {tokens} tokens/step")
    rows = {}
    for d in [int(x) for x in args.depths.split(",")]:
        cfg = replace(base, [f"model.mtp_depth={d}"])
        t = step_time(cfg, args.steps)
        fpt = train_flops_per_token(cfg.model, cfg.data.seq_len)
        rows[d] = (t, fpt)
        tps = tokens / t
        print(f"mtp_depth {d}: {t * 1e3:8.1f} ms/step  {tps:10,.0f} tokens/s  "
              f"MFU {mfu(tps, fpt, peak, n_dev):6.1%}  ({fpt / 1e6:.1f} MFLOP/token)", flush=True)
    if 0 in rows:
        t0, f0 = rows[0]
        print("depth  step-time ratio  FLOP ratio   (vs depth 0)")
        for d, (t, f) in rows.items():
            print(f"{d:5d}  {t / t0:15.3f}  {f / f0:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
