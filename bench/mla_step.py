"""Where MLA's decode step spends its time against GQA kv=4 at bench/mla_decode.py's default width: the cached
attention alone, and one whole block's decode step (200 steps of a compiled loop carrying the cache), with the copies
and transposes XLA put in each block step.

    python bench/mla_step.py [--rounds 7]

One process, the two interleaved round by round, medians; float32, batch 1, a cache of 512 positions.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from mla_decode import variants  # noqa: E402

from mtpjax.nn.layers import KV, attend_cached  # noqa: E402
from mtpjax.nn.mla import MLACache, attend_absorbed, decode_view, mla_cache  # noqa: E402
from mtpjax.nn.placement import host_placement  # noqa: E402
from mtpjax.nn.model import make_block  # noqa: E402

S, STEPS = 512, 200


def attention_loops(cfgs):
    """Compiled loops of STEPS cached attention calls (T=1, 300 committed positions): {name: () -> value}."""
    r = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    m, g = cfgs["mla"], cfgs["gqa kv=4"]
    N, Z, Hr, hd, K = m.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, g.n_kv_heads
    start = jnp.array([300])
    mla_args = (f(1, 1, N, hd), f(1, 1, N, Hr), f(1, 1, Z), f(1, 1, Hr), MLACache(f(1, S, Z), f(1, S, Hr)))
    wk, wv = f(N, Z, hd), f(N, m.v_head_dim, Z)  # per head, as MLAttention.up_projections lays them out
    q, k, v, kv = f(1, 1, K, N // K, hd), f(1, 1, K, hd), f(1, 1, K, hd), KV(f(1, K, S, hd), f(1, K, S, hd))

    def loop(fn):
        return jax.jit(lambda: jax.lax.fori_loop(0, STEPS, lambda i, a: a + fn(a).sum() * 0, jnp.float32(0)))

    return {"mla": loop(lambda a: attend_absorbed(mla_args[0] + a, *mla_args[1:], start, wk, wv)),
            "gqa kv=4": loop(lambda a: attend_cached(q + a, k, v, kv, start))}


def block_loops(cfgs):
    """Compiled loops of STEPS decode steps of one block carrying its cache: {name: (fn, params, cache)}."""
    out = {}
    for name in ("mla", "gqa kv=4"):
        cfg = cfgs[name]
        g, st = nnx.split(make_block(cfg, nnx.Rngs(params=0), False, host_placement()))
        hd = cfg.d_model // cfg.n_heads
        cache = mla_cache(cfg, 1, S) if name == "mla" else KV(*(jnp.zeros((1, cfg.n_kv_heads, S, hd)),) * 2)

        def run(st, cache, g=g, d=cfg.d_model):
            blk = decode_view(nnx.merge(g, st))  # as the decode loop does, once before it

            def body(i, carry):
                y, c, _ = blk(carry[0], jnp.full((1, 1), i), None, carry[1])
                return y, c
            return jax.lax.fori_loop(0, STEPS, body, (jnp.ones((1, 1, d)), cache))
        out[name] = (jax.jit(run), st, cache)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    cfgs = variants(256, 4, 8)
    att, blk = attention_loops(cfgs), block_loops(cfgs)
    calls = {("attention", n): (lambda f=f: f()) for n, f in att.items()}
    calls |= {("block step", n): (lambda f=f, s=s, c=c: f(s, c)) for n, (f, s, c) in blk.items()}
    for c in calls.values():
        jax.block_until_ready(c())
    ts = {k: [] for k in calls}
    for _ in range(a.rounds):
        for k, c in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(c())
            ts[k].append((time.perf_counter() - t) / STEPS)
    print(f"float32 batch 1, cache {S}, {a.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print("| what | gqa kv=4 µs | mla µs | mla / gqa | copies + transposes per block step (gqa / mla) |")
    print("|---|---|---|---|---|")
    hlo = {n: f.lower(s, c).compile().as_text() for n, (f, s, c) in blk.items()}
    moved = lambda line: "while/body" in line and (" copy(" in line or " transpose(" in line)  # noqa: E731
    moves = {n: sum(map(moved, h.splitlines())) for n, h in hlo.items()}  # inside the loop: what every step pays
    for what in ("attention", "block step"):
        g, m = (float(np.median(ts[(what, n)])) for n in ("gqa kv=4", "mla"))
        extra = f"{moves['gqa kv=4']} / {moves['mla']}" if what == "block step" else ""
        print(f"| {what} | {g * 1e6:.1f} | {m * 1e6:.1f} | {m / g:.2f} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
