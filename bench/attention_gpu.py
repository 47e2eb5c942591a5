"""The fused attention kernels at the GPU configs' shapes, timed on this device: cuDNN (with the dense mask packed
documents need, and causal alone for scale) and the Pallas-Triton kernel over tile choices.

    python bench/attention_gpu.py [--smoke] [--json out.json] [--budget 150]

Shapes: gpu_1b (8 x 4096 tokens, 16 query heads over 8 KV heads of 128) and gpu_moe (12 heads of 192), bf16,
3-5 packed documents per row. Each row: forward and forward+backward milliseconds (median) and TFLOP/s of the
causal work (4·B·N·H·T²/2 a forward, 2.5x that a backward), and the largest difference of its output and
gradients from the first Pallas row's (the tiles the tests cover), relative to that row's largest magnitude.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.accelerator import packed_batch  # noqa: E402
from bench.gmm_gpu import timed  # noqa: E402
from mtpjax.nn import kernels  # noqa: E402
from bench.common import json_path, write_json  # noqa: E402

SHAPES = {"gpu_moe": (8, 4096, 12, 1, 192), "gpu_1b": (8, 4096, 8, 2, 128)}  # B, T, K, R, H
SMOKE = {"toy": (1, 64, 2, 2, 16)}
# (forward tile, backward tile, warps, pipeline stages); the first is the adapter's default
PALLAS = [(128, 32, None, 2), (128, 64, None, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
          (128, 64, 8, 3)]


def inputs(B, T, K, R, H, seed=0):
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((B, T, K, R, H)) / (np.sqrt(H) if i == 0 else 1), jnp.bfloat16)
             for i in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16) for _ in range(2))
    seg = jnp.asarray(packed_batch(B, T, 50)[1])
    return q, k, v, seg, do


def row(name, attend, args, flops, ref, repeats):
    """Times attend's forward and forward+backward; its difference from ref's results."""
    q, k, v, seg, do = args
    fwd = jax.jit(lambda q, k, v: attend(q, k, v, seg))
    bwd = jax.jit(lambda q, k, v: jax.vjp(lambda *a: attend(*a, seg), q, k, v)[1](do))
    r = {"kernel": name}
    try:
        got = (fwd(q, k, v), *bwd(q, k, v))
        r["forward_ms"] = 1e3 * timed(fwd, (q, k, v), repeats)
        r["forward_backward_ms"] = 1e3 * timed(bwd, (q, k, v), repeats)  # the vjp program runs the forward too
        r["forward_tflops"] = flops / r["forward_ms"] / 1e9
        r["forward_backward_tflops"] = 3.5 * flops / r["forward_backward_ms"] / 1e9
        if ref is not None:
            r["rel_diff"] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                      / jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(got, ref))
        return r, got
    except Exception as e:  # noqa: BLE001 - a tile this device cannot run is a row
        r["failed"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        return r, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="toy shape, Pallas in interpret mode, cuDNN's XLA path")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--tiles", type=int, default=len(PALLAS), help="how many of the Pallas tile choices to time")
    ap.add_argument("--json", type=json_path)
    args = ap.parse_args(argv)
    t0, res = time.perf_counter(), {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    for shape_name, (B, T, K, R, H) in (SMOKE if args.smoke else SHAPES).items():
        a = inputs(B, T, K, R, H)
        flops = 4 * B * K * R * H * T * T / 2
        ref = None
        impl = "xla" if args.smoke else "cudnn"
        pallas = [(f"pallas {p}", functools.partial(kernels.pallas_gpu_attention, block=p[0], bwd_block=p[1],
                     num_warps=p[2], num_stages=p[3], interpret=args.smoke)) for p in PALLAS[:args.tiles]]
        cudnn = [("cudnn, dense mask", functools.partial(kernels.cudnn_attention, implementation=impl)),
                 ("cudnn, causal only (not packed)",
                  lambda q, k, v, s, i=impl: kernels.cudnn_attention(q, k, v, None, implementation=i))]
        variants = pallas[:4] + cudnn + pallas[4:]
        for name, f in variants:
            if time.perf_counter() - t0 > args.budget:
                res["rows"].append({"shape": shape_name, "kernel": name, "skipped": "budget"})
                continue
            r, got = row(name, f, a, flops, ref if "causal only" not in name else None, args.repeats)
            ref = got if ref is None else ref
            r["shape"] = shape_name
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    print(f"{'shape':8s} {'kernel':34s} {'fwd ms':>8s} {'f+b ms':>8s} {'fwd TF/s':>9s} {'f+b TF/s':>9s} {'diff':>8s}")
    for r in res["rows"]:
        if "forward_ms" in r:
            print(f"{r['shape']:8s} {r['kernel']:34s} {r['forward_ms']:8.2f} {r['forward_backward_ms']:8.2f} "
                  f"{r['forward_tflops']:9.1f} {r['forward_backward_tflops']:9.1f} {r.get('rel_diff', 0):8.1e}")
        else:
            print(f"{r['shape']:8s} {r['kernel']:34s} {r.get('failed', r.get('skipped'))}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
