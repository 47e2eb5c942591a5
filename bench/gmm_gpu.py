"""The MoE's grouped-matmul kernel on this device: equal to jax.lax.ragged_dot, and timed against it.

    python bench/gmm_gpu.py [--smoke] [--json out.json]

Rows (every one measured in this process, on this device):
- equality: `gmm.grouped_matmul` with this platform's kernel (Pallas-Triton on a GPU, megablox on a TPU; --smoke:
  the Triton kernel in interpret mode on a CPU) against `jax.lax.ragged_dot` at matmul precision `highest`, float32,
  on groups with empty experts and sizes off the row tile: the forward and both gradients, as the largest
  difference relative to the reference's largest magnitude.
- speed: the SwiGLU of `configs/gpu_moe.yaml`'s routed experts on one device (one micro-batch of 4 rows x 4096
  tokens x 4 experts each: 65,536 token-slots, d_model 1536, expert width 1024, 32 experts), bf16, forward and
  forward+backward, by the kernel and by ragged_dot: milliseconds (median) and TFLOP/s of the work the tokens need
  (6 matmuls of 2·slots·D·F FLOPs a forward, 3x that with the backward).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpjax.nn import gmm  # noqa: E402
from mtpjax.nn.moe import grouped_swiglu  # noqa: E402
from bench.common import json_path, write_json  # noqa: E402


def sizes(rng, m: int, E: int, empty: int) -> np.ndarray:
    """Group sizes summing to m, `empty` of them zero, the rest uneven (a multinomial over random weights)."""
    p = rng.random(E)
    p[rng.choice(E, empty, replace=False)] = 0
    return rng.multinomial(m, p / p.sum()).astype(np.int32)


def equality(kernel: gmm.Kernel, m: int, k: int, n: int, E: int) -> dict:
    """Largest forward / input-gradient / weight-gradient difference of the kernel against ragged_dot, relative."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, k, n)) / np.sqrt(k), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    gs = jnp.asarray(sizes(rng, m - 5, E, 2))  # 5 rows past the groups' total: zeros out, no gradient

    def run(f):
        y, vjp = jax.vjp(lambda a, b: f(a, b, gs), x, w)
        return (y, *vjp(dy))

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda: run(jax.lax.ragged_dot))()
        got = jax.jit(lambda: run(lambda a, b, s: gmm.grouped_matmul(a, b, s, kernel)))()
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    return {"shape": [m, k, n, E], "group_sizes": np.asarray(gs).tolist(),
            **{name: rel(a, b) for name, a, b in zip(("forward", "d_lhs", "d_rhs"), got, ref, strict=True)}}


def timed(f, args, repeats: int) -> float:
    """Median seconds of a compiled call (after one warm-up), waiting on its outputs each time."""
    jax.block_until_ready(f(*args))
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def speed(kernel: gmm.Kernel, slots: int, D: int, F: int, E: int, repeats: int) -> list[dict]:
    """Forward and forward+backward of the routed SwiGLU in bf16 by the kernel and by ragged_dot."""
    rng = np.random.default_rng(1)
    counts = jnp.asarray(sizes(rng, slots, E, 0))
    e_I = jnp.repeat(jnp.arange(E), counts, total_repeat_length=slots)
    x = jnp.asarray(rng.standard_normal((slots, D)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16) for s in ((E, D, F), (E, D, F), (E, F, D))]
    flops = 6 * slots * D * F
    rows = []
    for name, grouping in (("kernel", kernel), ("ragged_dot", "ragged")):
        fwd = jax.jit(lambda x, *w, g=grouping: grouped_swiglu(x, e_I, counts, *w, g))
        loss = lambda x, *w, g=grouping: jnp.sum(grouped_swiglu(x, e_I, counts, *w, g).astype(jnp.float32) ** 2)
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        row = {"grouping": name if name == "ragged_dot" else f"kernel {kernel.name}"}
        for what, f, work in (("forward", fwd, flops), ("forward_backward", bwd, 3 * flops)):
            try:
                s = timed(f, (x, *ws), repeats)
                row[what] = {"ms": 1e3 * s, "tflops": work / s / 1e12}
            except Exception as e:  # noqa: BLE001 - a kernel this jax/device cannot run is a row, not the end
                row[what] = {"failed": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the Triton kernel in interpret mode on a CPU, toy sizes")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=json_path)
    args = ap.parse_args(argv)
    platform = jax.default_backend()
    kernel = gmm.Kernel("triton", interpret=True) if args.smoke else gmm.kernel_for(platform)
    if kernel is None:
        print(f"no grouped-matmul kernel on {platform} (run on a GPU or TPU, or --smoke)")
        return 2
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "kernel": kernel.name}
    try:
        res["equality"] = equality(kernel, *((100, 48, 40, 5) if args.smoke else (4000, 384, 320, 8)))
    except Exception as e:  # noqa: BLE001 - reported
        res["equality"] = {"failed": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    print(json.dumps(res["equality"]), flush=True)
    res["speed"] = speed(kernel, *((256, 32, 64, 4) if args.smoke else (65536, 1536, 1024, 32)),
                         1 if args.smoke else args.repeats)
    for r in res["speed"]:
        print(json.dumps(r), flush=True)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
