"""Few-row products against weights past the last-level cache, in three operand layouts: v(n) for a chain of matmuls.

    python bench/row_products.py [--rounds 9] [--pairs 32] [--json out.json]

A chain of `pairs` MLP-like pairs of float32 products ([n, 320] x [320, 1280], then x [1280, 320]: 105 MB at 32
pairs, the weights of configs/cpu_deep.yaml's size), each product's input the previous one's tanh, jitted as one
program. The cost of n rows over one row's (v(n) of the verification, for the products alone), wall and CPU time,
median of per-round ratios, the forms interleaved in every round:

- rows: x [n, K] @ W [K, N], the layout the model uses (its Dense layers);
- columns: the weights stored transposed, W^T [N, K] @ x^T [K, n], the activations kept in column form throughout;
- columns, back to rows: the columns form, every product's result transposed back to [n, N] (what a Dense layer
  returning rows would cost).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import json_path, load, write_json  # noqa: E402

K, N = 320, 1280
ROWS = (1, 2, 3, 4, 6, 8)


def _rows(x, ups, downs):
    for u, d in zip(ups, downs):
        x = jnp.tanh(jnp.tanh(x @ u) @ d)
    return x


def _columns(xT, upsT, downsT):
    for u, d in zip(upsT, downsT):
        xT = jnp.tanh(d @ jnp.tanh(u @ xT))
    return xT


def _columns_back(x, upsT, downsT):
    for u, d in zip(upsT, downsT):
        x = jnp.tanh((d @ jnp.tanh((u @ x.T).T).T).T)
    return x


def measure(pairs: int, rounds: int) -> dict:
    """{form: {"wall": {n: v}, "cpu": {n: v}}}, v relative to the rows form's one-row pass; one-row ms per pass."""
    rng = np.random.default_rng(0)
    ups = [jnp.asarray(rng.normal(size=(K, N)) * 0.05, jnp.float32) for _ in range(pairs)]
    downs = [jnp.asarray(rng.normal(size=(N, K)) * 0.05, jnp.float32) for _ in range(pairs)]
    upsT, downsT = [u.T.copy() for u in ups], [d.T.copy() for d in downs]
    jr, jc, jb = jax.jit(_rows), jax.jit(_columns), jax.jit(_columns_back)
    fns = {}
    for n in ROWS:
        x, xT = jnp.full((n, K), 0.1, jnp.float32), jnp.full((K, n), 0.1, jnp.float32)
        fns[("rows", n)] = lambda x=x: jr(x, ups, downs)
        fns[("columns", n)] = lambda xT=xT: jc(xT, upsT, downsT)
        fns[("columns, back to rows", n)] = lambda x=x: jb(x, upsT, downsT)
    for f in fns.values():
        jax.block_until_ready(f())
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for r in range(rounds):
        keys = list(fns)
        random.Random(r).shuffle(keys)
        for k in keys:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(5):
                jax.block_until_ready(fns[k]())
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    one_w, one_c = np.asarray(wall[("rows", 1)]), np.asarray(cpu[("rows", 1)])
    out = {"weights_mb": pairs * 2 * K * N * 4 / 1e6, "one_row_ms": float(np.median(one_w)) / 5 * 1e3,
           "load": load(), "forms": {}}
    for form in ("rows", "columns", "columns, back to rows"):
        out["forms"][form] = {
            "wall": {n: float(np.median(np.asarray(wall[(form, n)]) / one_w)) for n in ROWS},
            "cpu": {n: float(np.median(np.asarray(cpu[(form, n)]) / one_c)) for n in ROWS}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", type=json_path)
    a = ap.parse_args(argv)
    res = measure(a.pairs, a.rounds)
    print(f"{res['weights_mb']:.0f} MB of weights, one row {res['one_row_ms']:.2f} ms a pass, load {res['load']}")
    print("| form | " + " | ".join(f"v({n}) wall / CPU" for n in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for form, v in res["forms"].items():
        print(f"| {form} | " + " | ".join(f"{v['wall'][n]:.2f} / {v['cpu'][n]:.2f}" for n in ROWS) + " |")
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
