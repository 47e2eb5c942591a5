"""Decode round cost per layer against the weights a round touches: where the last-level cache ends.

    python bench/cache_cliff.py [--layers 2,4,6,8] [--d-model 256]

Plain greedy decoding (batch 1) of random models that differ only in depth. A round reads every
weight once, so if rounds were bound by per-layer compute or launches, the time per layer would stay
flat; it does not. Measured on the 2-core CPU here (d_model 256, float32): 62 / 109 / 269 / 285 us per
layer at 6.2 / 12.1 / 18.0 / 23.9 MB of weights (MB = 1e6 bytes of parameters, as in decode_bench).
The tiny config's trunk is 12 MB, with its two MTP modules 19 MB. This curve is the plain round's
cost only; why MTP rounds cost more than their FLOPs on the tiny model (XLA's few-row matmul kernels)
is on the benchmarks page (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import log  # noqa: E402
from mtpjax.eval.plan import tree_bytes  # noqa: E402


def round_seconds(model, prompt, short: int, long_: int, repeats: int) -> float:
    """Seconds per plain decode round: the slope between a short and a long generation of one compiled loop."""
    from mtpjax.decode import make_loop, run

    loop = make_loop(model, [prompt], max_new_tokens=long_, num_draft=0)

    def timed(budget):
        t = time.perf_counter()
        jax.block_until_ready(run(model, [prompt], loop, budget=budget).n_B)
        return time.perf_counter() - t

    timed(short)
    slopes = [(timed(long_) - timed(short)) / (long_ - short) for _ in range(repeats)]
    return float(np.median(slopes))


def measure(layers, d_model: int, short: int = 32, long_: int = 160, repeats: int = 5) -> list[dict]:
    """One row per depth: weight megabytes and microseconds per layer per round."""
    from mtpjax.config import ModelConfig
    from mtpjax.nn.model import build_model

    rows = []
    prompt = list(range(1, 33))
    for n in layers:
        cfg = ModelConfig(d_model=d_model, n_layers=n, n_heads=4, n_kv_heads=2, mtp_depth=0)
        model = build_model(cfg, seed=0)
        mb = tree_bytes(nnx.state(model, nnx.Param)) / 1e6
        sec = round_seconds(model, prompt, short, long_, repeats)
        rows.append({"n_layers": n, "weights_mb": mb, "us_per_round": sec * 1e6, "us_per_layer": sec * 1e6 / n})
        log(f"  {n} layers  {mb:6.1f} MB  {sec * 1e6:8.0f} us/round  {sec * 1e6 / n:6.0f} us/layer")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,4,6,8")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = measure([int(x) for x in args.layers.split(",")], args.d_model)
    if args.json:
        Path(args.json).write_text(json.dumps({"d_model": args.d_model, "rows": rows}, indent=2))
    base = rows[0]["us_per_layer"]
    for r in rows:
        print(f"{r['n_layers']:>3} layers {r['weights_mb']:6.1f} MB  per-layer cost x{r['us_per_layer'] / base:.2f} "
              f"of the {rows[0]['n_layers']}-layer model's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
