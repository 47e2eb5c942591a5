"""The MoE grouped matmul on this platform: ragged_dot, expert blocks and every expert for every row, side by side.

    python -m bench.moe_grouping [--slots 8192 --experts 8 --d 256 --f 256 --rounds 5]

Forward and backward of grouped_swiglu over sorted token-slots; interleaved rounds, the median time of each and
its ratio to the blocks path; the first three must agree (they are the same function), the last is the FLOPs of
one matmul over all rows (the bound a grouping can reach).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.nn.moe import grouped_swiglu


def dense_all(x_ND, e_N, counts_E, wg, wu, wd):
    """Every expert on every row, each row keeping its own expert's output (what ragged_dot costs on CPU)."""
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x_ND, wg)) * jnp.einsum("nd,edf->enf", x_ND, wu)
    y_END = jnp.einsum("enf,efd->end", h, wd)
    return jnp.take_along_axis(y_END, e_N[None, :, None], axis=0)[0]


def one_matmul(x_ND, e_N, counts_E, wg, wu, wd):
    """Every row through expert 0: the FLOPs of a perfect grouping (a lower bound, not the same function)."""
    return (jax.nn.silu(x_ND @ wg[0]) * (x_ND @ wu[0])) @ wd[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--f", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    N, E, D, F = a.slots, a.experts, a.d, a.f
    e_N = jnp.asarray(np.sort(rng.integers(0, E, N)), jnp.int32)
    counts = jnp.bincount(e_N, length=E)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
    ways = {"blocks": lambda *z: grouped_swiglu(*z, "blocks"), "ragged_dot": lambda *z: grouped_swiglu(*z, "ragged"),
            "all experts": dense_all, "one matmul (bound)": one_matmul}
    fns = {k: jax.jit(jax.value_and_grad(lambda x, w, f=f: f(x, e_N, counts, *w).sum() ** 2 / N, argnums=(0, 1)))
           for k, f in ways.items()}
    ref = None
    for k, f in fns.items():
        out = jax.block_until_ready(f(x, w))
        ref = out[0] if ref is None else ref
        assert k == "one matmul (bound)" or np.allclose(out[0], ref, rtol=1e-4), (k, out[0], ref)
    times = {k: [] for k in fns}
    for _ in range(a.rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, w))
            times[k].append(time.perf_counter() - t0)
    base = np.median(times["blocks"])
    print(f"{jax.default_backend()} slots={N} experts={E} d={D} f={F} load={os.getloadavg()[0]:.1f}")
    print("| grouping | fwd+bwd ms | vs blocks |\n|---|---|---|")
    for k, t in times.items():
        print(f"| {k} | {1e3 * np.median(t):.1f} | {np.median(t) / base:.2f} |")


if __name__ == "__main__":
    main()
