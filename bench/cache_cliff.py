"""Decode round cost per layer against the weights a round touches: where the last-level cache ends; v(n) and c.

    python bench/cache_cliff.py [--layers 2,4,6,8] [--d-model 256]
    python bench/cache_cliff.py --rows 1,2,3,4,5,6,7,8 --config configs/cpu_deep.yaml [--run-dir RUN]

Plain greedy decoding (batch 1) of random models that differ only in depth. A round reads every
weight once, so if rounds were bound by per-layer compute or launches, the time per layer would stay
flat; it does not. Measured on the 2-core CPU here (d_model 256, float32): 62 / 109 / 269 / 285 us per
layer at 6.2 / 12.1 / 18.0 / 23.9 MB of weights (MB = 1e6 bytes of parameters, as in decode_bench).
The tiny config's trunk is 12 MB, with its two MTP modules 19 MB. This curve is the plain round's
cost only; why MTP rounds cost more than their FLOPs on the tiny model (XLA's few-row matmul kernels)
is on the benchmarks page (docs/benchmarks.md).

`--rows`: the verification cost v(n), one decode forward of n rows over the cache (trunk, head, argmax, the
cache written in place) relative to one row, and the drafting cost c(γ) of the MTP proposer per draft in the
same unit, each timed apart (a jitted loop of forwards) with every loop interleaved in each round, so the split
of a round into v(γ+1) + γc does not drift with the load. A speculative round with γ drafts costs at least
v(γ+1) + γc plain steps (docs/benchmarks.md#verification-cost-on-the-memory-bound-model).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402
from mtpjax.drafts import chain
from mtpjax.eval.plan import tree_bytes  # noqa: E402


def round_seconds(model, prompt, short: int, long_: int, repeats: int) -> float:
    """Seconds per plain decode round: the slope between a short and a long generation of one compiled loop."""
    from mtpjax.decode import make_loop, run

    loop = make_loop(model, [prompt], max_new_tokens=long_, draft=0)

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


def _decode_loop(model, batch: int, rows: int, context: int, capacity: int, iters: int):
    """A jitted call running `iters` trunk + head forwards of `rows` new rows over a cache of `context` committed
    entries (each forward's argmax feeding the next, the cache donated and updated in place, as a round does)."""
    from mtpjax.decode.cache import trunk_cache

    graph, params = nnx.split(model)
    pos_BN = jnp.broadcast_to(context + jnp.arange(rows, dtype=jnp.int32), (batch, rows))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def call(params, cache, toks_BN):
        m = nnx.merge(graph, params)

        def body(_, carry):
            cache, toks_BN = carry
            h_BND, cache = m.trunk(toks_BN, pos_BN, cache=cache)
            return cache, jnp.argmax(m.logits(m.final_norm(h_BND)), axis=-1).astype(jnp.int32)

        return jax.lax.fori_loop(0, iters, body, (cache, toks_BN))

    state = {"cache": trunk_cache(model.cfg, batch, capacity), "toks": jnp.ones((batch, rows), jnp.int32)}

    def run_once():
        state["cache"], state["toks"] = call(params, state["cache"], state["toks"])
        jax.block_until_ready(state["toks"])

    return run_once


def _draft_loop(model, batch: int, num_draft: int, context: int, capacity: int, iters: int):
    """A jitted call running `iters` drafting steps of the MTP proposer with γ = num_draft (its window of γ+1
    rows through each module, the head per draft), as a round after a commit runs them."""
    from mtpjax.decode.proposers import make_proposer
    from mtpjax.decode.protocol import Context, Models
    from mtpjax.decode.sampling import make_sampler

    graph, params = nnx.split(model)
    prop, sampler, D = make_proposer("mtp", chain(num_draft)), make_sampler(), model.cfg.d_model
    n_B = jnp.full((batch,), context, jnp.int32)
    seq_BS = jnp.ones((batch, capacity), jnp.int32)

    def ctx(h_BTD, start_B):
        return Context(seq_BS, n_B, h_BTD, start_B, sampler, jax.random.key(0), 1)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def call(params, pstate):
        models = Models(nnx.merge(graph, params))
        h_BYD = jnp.zeros((batch, num_draft + 1, D), jnp.float32)

        def body(_, st):
            return prop.step(models, st, ctx(h_BYD, n_B - num_draft - 1))[0]

        return jax.lax.fori_loop(0, iters, body, pstate)

    m = nnx.merge(graph, params)
    state = {"p": jax.jit(lambda: prop.start(Models(m), ctx(jnp.zeros((batch, 1, D)), n_B * 0))[0])()}

    def run_once():
        state["p"] = call(params, state["p"])
        jax.block_until_ready(state["p"])

    return run_once


def verify_costs(seconds: dict, drafts: dict | None = None) -> dict:
    """v(n) and c(γ) from interleaved per-round seconds: v(n) = median over rounds of t(n rows) / t(1 row), c(γ) =
    median of t(drafting γ) / (γ · t(1 row)): both in plain decode steps, each round's ratio within one round."""
    one = seconds[1]
    v = {n: median_ratio(t, one) for n, t in seconds.items()}
    c = {g: median_ratio(t, one) / g for g, t in (drafts or {}).items()}
    return {"v": v, "c": c}


def measure_rows(model, rows, gammas, batch: int = 1, context: int = 192, iters: int = 32, rounds: int = 7) -> dict:
    """v(n) for n in `rows` and c(γ) for γ in `gammas` on one model: every loop compiled first, then `rounds`
    rounds running each once in a shuffled order (load drifts cancel within a round), medians of ratios."""
    capacity = context + max(rows) + 64
    fns = {("v", n): _decode_loop(model, batch, n, context, capacity, iters) for n in rows}
    if model.cfg.mtp_depth:
        fns.update({("c", g): _draft_loop(model, batch, g, context, capacity, iters) for g in gammas})
    for f in fns.values():
        f()  # compile and warm up
    cpu: dict = {}
    times = interleave(fns, rounds, seed=batch, cpu=cpu)
    split = lambda t: ({n: t[("v", n)] for n in rows}, {k[1]: t[k] for k in t if k[0] == "c"})  # noqa: E731
    out = verify_costs(*split(times))
    out["cpu"] = verify_costs(*split(cpu))  # CPU time: what other processes on a loaded host inflate less
    out["step_us"] = float(np.median(times[("v", 1)])) / iters * 1e6
    out["load"] = load()
    return out


def rows_subject(config: str, run_dir: str | None):
    """(model, what it is): a trained run's model, or random weights of `config` (v(n) and c need no training)."""
    if run_dir:
        from mtpjax.train.checkpoint import load_model

        return load_model(run_dir)[1], f"trained checkpoint {run_dir}"
    from mtpjax.config import load_config
    from mtpjax.nn.model import build_model

    return build_model(load_config(config, []).model, seed=0), f"random weights of {config}"


def print_rows(res: dict) -> None:
    """v(n) and c(γ) as the benchmarks page tabulates them."""
    print(f"{res['source']}: {res['weights_mb']:.1f} MB, batch {res['batch']}, context {res['context']}, "
          f"one-row step {res['step_us']:.0f} us  [load {res['load']}]")
    print("  v(n) = " + "  ".join(f"{n}: {v:.2f}" for n, v in res["v"].items()))
    print("  v(n) by CPU time = " + "  ".join(f"{n}: {v:.2f}" for n, v in res["cpu"]["v"].items())
          + ("   c(γ) by CPU time = " + "  ".join(f"{g}: {c:.3f}" for g, c in res["cpu"]["c"].items())
             if res["cpu"]["c"] else ""))
    if res["c"]:
        print("  c(γ) = " + "  ".join(f"{g}: {c:.3f}" for g, c in res["c"].items())
              + "   round floor v(γ+1) + γc = " + "  ".join(
                  f"{g}: {res['v'][g + 1] + g * c:.2f}" for g, c in res["c"].items() if g + 1 in res["v"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,4,6,8")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--rows", help="v(n) for these row counts instead of the per-layer curve, e.g. 1,2,3,4,5,6,7,8")
    ap.add_argument("--gammas", default="1,2,3", help="with --rows: c(γ) of the MTP proposer for these γ")
    ap.add_argument("--config", default="configs/cpu_deep.yaml", help="with --rows: the model (random weights)")
    ap.add_argument("--run-dir", help="with --rows: a trained run's model instead")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=192, help="with --rows: committed cache entries")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=json_path, help="write the rows here")
    args = ap.parse_args(argv)
    if args.rows:
        model, source = rows_subject(args.config, args.run_dir)
        res = measure_rows(model, [int(x) for x in args.rows.split(",")], [int(x) for x in args.gammas.split(",")],
                           args.batch, args.context, rounds=args.rounds)
        res.update(source=source, weights_mb=tree_bytes(nnx.state(model, nnx.Param)) / 1e6, batch=args.batch,
                   context=args.context)
        print_rows(res)
        if args.json:
            write_json(args.json, res)
        return 0
    rows = measure([int(x) for x in args.layers.split(",")], args.d_model)
    if args.json:
        write_json(args.json, {"d_model": args.d_model, "rows": rows})
    base = rows[0]["us_per_layer"]
    for r in rows:
        print(f"{r['n_layers']:>3} layers {r['weights_mb']:6.1f} MB  per-layer cost x{r['us_per_layer'] / base:.2f} "
              f"of the {rows[0]['n_layers']}-layer model's")
    return 0

if __name__ == "__main__":
    sys.exit(main())
