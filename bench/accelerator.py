"""Accelerator check, one table: gpu_1b train-step MFU per attention backend, decode plain vs MTP, greedy equality.

    python bench/accelerator.py [--smoke] [--alpha 0.98,0.50] [--backends xla,cudnn,pallas] [--json out.json]
        [--config configs/gpu_moe.yaml --set model.n_layers=4 --sections train]

Rows (every one measured in this process, on this device):
- train: one jitted train step of configs/gpu_1b.yaml (bf16 compute, float32 master weights and AdamW state,
  seq 4096, packed documents) per `model.attention` backend: tokens/s, MFU against the chip's published dense
  bf16 peak (mtpjax.parallel.targets.KIND_PEAKS; on a CPU a measured float32 matmul, labelled so) and the
  compiled program's memory.
- decode: greedy plain vs MTP (1 draft) at batch 1/8/32 on gpu_1b's shape with bfloat16 weights (2 GB: far
  beyond any listed chip's on-chip cache), random weights. Round costs relative to a plain round: v (a round of
  n-gram speculation: a verification of 2 tokens, drafting nearly free) and c (what an MTP draft adds). α is not
  measured here (random weights accept at random): it is passed in (--alpha, by draft position) from a
  CPU-trained run, and the row gives E(γ), the speedup E/(v+γc) those costs predict, and the ceiling E/(1+γr)
  with r one draft's FLOPs over a plain step's.
- equality: greedy speculative (1 and 2 drafts) == plain decoding, token for token, on a float32 model with
  jax_default_matmul_precision=highest (a GPU's default float32 matmul is TF32).

On a lent GPU (the device tool), from the repository root, nothing carried (it imports jax, flax, optax, numpy
and yaml: no grain, orbax, tensorboardX or tokenizers):
    PYTHONUNBUFFERED=1 python3 bench/accelerator.py --json $OUT/accelerator.json      (timeout_s 420)
If the image's flax/optax cannot build the model (every row fails alike), carry the pinned pure-Python wheels
(`pip download --no-deps -d .whl flax==0.12.8 optax==0.2.8`, .whl in carry) and prefix the command with
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;
A section that would overrun --budget seconds is skipped and says so; every failure is a row, not a crash.
--smoke runs the same code on a CPU at toy sizes in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from bench.common import json_path, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # mtpjax from this checkout, imported inside the functions below

DEFAULT_BACKENDS = {"gpu": "xla,cudnn,pallas", "tpu": "xla,splash", "cpu": "xla"}
SMOKE = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=64", "data.seq_len=48", "loss.chunk_size=16"]
# α by draft position of the former tiny CPU run (docs/benchmarks.md; byte-level d256, two MTP modules, 200 steps):
# passed in, not measured here (the current configs/tiny.yaml has one module: α 0.95 at batch 1, bench of 30 Nov).
TINY_ALPHA = "0.98,0.50"


def _decoder():
    """The decoder's public API and the speed arithmetic, imported in this one place."""
    from mtpjax.decode import generate
    from mtpjax.eval.evaluate import timed_decode
    from mtpjax.nn.speed import expected_tokens, speedup_ceiling

    return generate, timed_decode, expected_tokens, speedup_ceiling


def published_peak(kind: str) -> float | None:
    """The chip's published dense bf16 FLOP/s (mtpjax.parallel.targets.KIND_PEAKS; None if the chip is not listed)."""
    from mtpjax.parallel.targets import published_peak as peak

    return peak(kind)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


class Budget:
    """Wall-clock seconds left for the whole script; a section starts only if its estimate fits."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def allows(self, estimate: float) -> bool:
        return self.left() > estimate


# ----------------------------------------------------------------------------- train


def packed_batch(B: int, T: int, vocab: int, seed: int = 0):
    """Random tokens in rows of 3-5 packed documents (segment ids 1..n), the layout training data has."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(1, vocab, (B, T)).astype(np.int32)
    seg = np.zeros((B, T), np.int32)
    for r in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), 2 + r % 3, replace=False))
        seg[r] = 1 + np.searchsorted(cuts, np.arange(T), side="right")
    return tok, seg


def train_row(cfg, peak: float, steps: int) -> dict:
    """Compile one train step for cfg, run it `steps` times after a warm-up; tokens/s, MFU, memory."""
    from mtpjax.nn.flops import train_flops_per_token
    from mtpjax.parallel.sharding import make_mesh
    from mtpjax.train.step import make_programs

    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state = progs.init()
    B, T = cfg.train.batch_size, cfg.data.seq_len
    tok, seg = (jax.device_put(x, progs.batch_sharding) for x in packed_batch(B, T, cfg.model.vocab_size))
    t0 = time.perf_counter()
    step = progs.train_step.lower(state, tok, seg).compile()
    compile_s = time.perf_counter() - t0
    mem = step.memory_analysis()
    times = []
    for _ in range(steps + 1):  # the first run warms up
        t = time.perf_counter()
        state, met = step(state, tok, seg)
        jax.block_until_ready(met)
        times.append(time.perf_counter() - t)
    sec = float(np.median(times[1:]))
    tps = B * T / sec
    row = {"attention": cfg.model.attention, "tokens": B * T, "step_seconds": sec, "tokens_per_sec": tps,
           "mfu": tps * train_flops_per_token(cfg.model, T) / peak, "compile_seconds": compile_s,
           "loss": float(met["loss/total"])}
    if mem is not None:  # bytes the compiled step holds at its peak: arguments + outputs + temporaries - aliased
        row["memory_bytes"] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                                  - mem.alias_size_in_bytes)
    return row


def train_section(base, backends, peak: float, steps: int, budget: Budget) -> list[dict]:
    """One train row per attention backend, each started only if the time budget allows."""
    from mtpjax.config import replace

    rows, last = [], 0.0
    for name in backends:
        if not budget.allows(1.5 * last):
            rows.append({"attention": name, "skipped": f"time budget ({budget.left():.0f} s left)"})
            continue
        t = time.perf_counter()
        try:
            rows.append(train_row(replace(base, [f"model.attention={name}"]), peak, steps))
        except Exception as e:  # noqa: BLE001 - a kernel this jax/device cannot run is a row, not the end
            rows.append({"attention": name, "failed": _first_line(e)})
        last = time.perf_counter() - t
    return rows


# ----------------------------------------------------------------------------- decode


def decode_section(cfg, batches, alpha, prompt_len: int, max_new: int, repeats: int, budget: Budget) -> dict:
    """Plain vs MTP(1) tokens/s per batch, v and c, and what the passed-in α makes of them."""
    from mtpjax.decode.proposers import make_proposer
    from mtpjax.drafts import chain
    from mtpjax.nn.model import build_model
    from mtpjax.nn.speed import floor_ratio

    _, timed_decode, expected_tokens, speedup_ceiling = _decoder()
    model = build_model(cfg, seed=0)
    weights = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(model))
    rng = np.random.default_rng(1)
    gamma, rows, last = 1, [], 0.0
    r = floor_ratio(make_proposer("mtp", chain(gamma)), cfg.model, prompt_len + max_new // 2)
    E = expected_tokens(chain(gamma), [[a] for a in alpha])
    ceiling = speedup_ceiling(alpha, r, gamma)["by_gamma"][gamma]
    for b in batches:
        if not budget.allows(1.5 * last):
            rows.append({"batch": b, "skipped": f"time budget ({budget.left():.0f} s left)"})
            continue
        t = time.perf_counter()
        prompts = rng.integers(1, cfg.model.vocab_size, (b, prompt_len)).tolist()
        kw = {"max_new": max_new, "batch": b, "repeats": repeats}
        try:
            plain = timed_decode(model, prompts, draft=0, proposer="mtp", **kw)
            ngram = timed_decode(model, prompts, draft=gamma, proposer="ngram", **kw)
            mtp = timed_decode(model, prompts, draft=gamma, proposer="mtp", **kw)
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append({"batch": b, "failed": _first_line(e)})
            last = time.perf_counter() - t
            continue
        v = ngram["sec_per_round"] / plain["sec_per_round"]
        c = max(0.0, (mtp["sec_per_round"] / plain["sec_per_round"] - v) / gamma)
        rows.append({"batch": b, "plain_tokens_per_sec": plain["tokens_per_sec"],
                     "mtp_tokens_per_sec": mtp["tokens_per_sec"],
                     "measured_speedup": mtp["tokens_per_sec"] / plain["tokens_per_sec"],
                     "random_weights_alpha": float(mtp["accepted"].sum() / max(mtp["reached"].sum(), 1)),
                     "v": v, "c": c, "predicted_speedup": E / (v + gamma * c),
                     "same_tokens_as_plain": mtp["outputs"] == plain["outputs"]})
        last = time.perf_counter() - t
    return {"weights_bytes": weights, "param_dtype": cfg.model.param_dtype, "num_draft": gamma, "alpha": alpha,
            "expected_tokens": E, "draft_work_ratio": r, "ceiling": ceiling, "rows": rows}


def equality_section(smoke: bool) -> dict:
    """Greedy speculative == plain on a float32 model at matmul precision 'highest', batch 8, 1 and 2 drafts."""
    from mtpjax.config import ModelConfig
    from mtpjax.nn.model import build_model

    generate = _decoder()[0]

    mcfg = ModelConfig(vocab_size=512, d_model=32 if smoke else 256, n_layers=1 if smoke else 4, n_heads=4,
                       n_kv_heads=2, mtp_depth=2)
    model = build_model(mcfg, seed=3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 512, int(n)).tolist() for n in rng.integers(5, 40, 8)]
    max_new = 8 if smoke else 48
    with jax.default_matmul_precision("highest"):
        plain = generate(model, prompts, max_new_tokens=max_new, draft=0).tokens
        same = {g: generate(model, prompts, max_new_tokens=max_new, draft=g).tokens == plain for g in (1, 2)}
    return {"batch": len(prompts), "max_new": max_new, "identical": same}


# ----------------------------------------------------------------------------- the table


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def table(res: dict) -> str:
    """The one markdown table the script prints (and docs/benchmarks.md quotes)."""
    d = res["device"]
    out = ["| measure | setting | result |", "|---|---|---|"]
    peak = f"{d['peak'] / 1e12:.3g} TFLOP/s ({d['peak_source']})"
    t = res["train_config"]
    for r in res.get("train", []):
        what = f"train step, attention={r['attention']}"
        setting = f"{t['name']}: {t['params']:,} parameters, {t['batch']}x{t['seq_len']} tokens, {t['dtype']}"
        if "tokens_per_sec" in r:
            result = (f"{r['tokens_per_sec']:,.0f} tok/s, MFU {r['mfu']:.1%} of {peak}, "
                      f"{r['step_seconds']:.3f} s/step, "
                      f"memory {_gib(r.get('memory_bytes'))}, compile {r['compile_seconds']:.0f} s")
        else:
            result = r.get("failed") or f"skipped: {r['skipped']}"
        out.append(f"| {what} | {setting} | {result} |")
    for e in res.get("estimate", []):  # python -m mtpjax compile's roofline for the same config, beside the measure
        out.append(f"| {e['program']}, compiled estimate | {e['target']} ({e['chip']}), mesh {e['mesh']} | "
                   f"{e['step_seconds']:.3f} s/step ({e['bound']}-bound roofline), MFU {e['mfu']:.1%}, memory "
                   f"{_gib(e['memory_bytes'])} (estimate, not measured) |")
    dec = res.get("decode")
    if dec and "failed" in dec:
        out.append(f"| decode | | {dec['failed']} |")
    elif dec:
        alpha = ",".join(f"{a:.2f}" for a in dec["alpha"])
        for r in dec["rows"]:
            setting = (f"batch {r['batch']}, {_gib(dec['weights_bytes'])} {dec['param_dtype']} weights (random), "
                       f"plain vs MTP {dec['num_draft']} draft")
            if "v" in r:
                result = (f"{r['plain_tokens_per_sec']:,.0f} vs {r['mtp_tokens_per_sec']:,.0f} tok/s "
                          f"(x{r['measured_speedup']:.2f} at random-weight α={r['random_weights_alpha']:.2f}); "
                          f"v={r['v']:.2f} c={r['c']:.2f}; with α={alpha} (passed in, CPU-trained run): "
                          f"E={dec['expected_tokens']:.2f}, predicted x{r['predicted_speedup']:.2f}, "
                          f"ceiling E/(1+γr) x{dec['ceiling']:.2f} (r={dec['draft_work_ratio']:.3f}); "
                          f"same tokens as plain: {'yes' if r['same_tokens_as_plain'] else 'no'}")
            else:
                result = r.get("failed") or f"skipped: {r['skipped']}"
            out.append(f"| decode | {setting} | {result} |")
    eq = res.get("equality")
    if eq:
        result = ", ".join(f"{g} draft{'s' if int(g) > 1 else ''}: {'identical' if ok else 'DIFFERENT'}"
                           for g, ok in eq["identical"].items()) if "identical" in eq else eq["failed"]
        out.append(f"| greedy speculative == plain | float32, matmul precision highest, batch {eq.get('batch', '')} "
                   f"| {result} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="toy sizes (CPU, well under a minute)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "gpu_1b.yaml"))
    ap.add_argument("--backends", help="model.attention values to time (default: this platform's kernels and xla)")
    ap.add_argument("--train-batch", type=int, default=8, help="sequences per timed train step")
    ap.add_argument("--steps", type=int, default=3, help="timed train steps per backend (after one warm-up)")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    ap.add_argument("--alpha", default=TINY_ALPHA, help="acceptance by draft position from a CPU-trained run")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--budget", type=float, default=270.0, help="seconds; sections that would overrun are skipped")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides: model.n_layers=4")
    ap.add_argument("--sections", default="equality,train,decode", help="which sections to run")
    ap.add_argument("--json", type=json_path, help="also write every number here")
    ap.add_argument("--estimate", help="a `python -m mtpjax compile --json` report of the same config: its roofline "
                    "rows go beside the measured ones")
    args = ap.parse_args(argv)
    from mtpjax.config import load_config, replace

    platform = jax.default_backend()
    dev = jax.devices()[0]
    peak, source = published_peak(dev.device_kind), "published dense bf16"
    if peak is None:
        from mtpjax.train.metrics import measure_peak_flops

        peak = measure_peak_flops(256 if args.smoke else 2048, 0.2)
        source = "measured float32 matmul: no published peak"
    overrides = [f"train.batch_size={2 if args.smoke else args.train_batch}", "train.micro_batches=1"]
    batches = "1,4" if args.smoke and args.batches == "1,8,32" else args.batches
    base = load_config(args.config, overrides + (SMOKE if args.smoke else []) + args.set)
    backends = (args.backends or DEFAULT_BACKENDS.get(platform, "xla")).split(",")
    budget = Budget(args.budget)
    res = {"device": {"platform": platform, "kind": dev.device_kind, "count": jax.device_count(), "peak": peak,
                      "peak_source": source, "jax": jax.__version__},
           "train_config": {"name": " ".join([Path(args.config).stem, *args.set]) + (" (smoke)" if args.smoke else ""),
                            "params": _param_count(base), "batch": base.train.batch_size,
                            "seq_len": base.data.seq_len, "dtype": base.model.dtype}, "smoke": args.smoke}
    print(f"{platform} {dev.device_kind} x{jax.device_count()}, jax {jax.__version__}, peak {peak / 1e12:.3g} "
          f"TFLOP/s ({source}); budget {args.budget:.0f} s", flush=True)
    sections = [
        ("equality", lambda: equality_section(args.smoke)),
        ("train", lambda: train_section(base, backends, peak, 1 if args.smoke else args.steps, budget)),
        ("decode", lambda: decode_section(replace(base, ["model.param_dtype=bfloat16"]),
                                          [int(b) for b in batches.split(",")],
                                          [float(a) for a in args.alpha.split(",")], 16 if args.smoke else 64,
                                          8 if args.smoke else args.max_new, 1 if args.smoke else 2, budget)),
    ]
    if args.estimate:
        res["estimate"] = estimate_rows(json.loads(Path(args.estimate).read_text()))
    for name, fn in [(n, f) for n, f in sections if n in args.sections.split(",")]:
        t, cpu = time.perf_counter(), time.process_time()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported in the table
            res[name] = {"failed": _first_line(e), "rows": []} if name != "train" else [
                {"attention": "all", "failed": _first_line(e)}]
        print(f"[{name}: {time.perf_counter() - t:.0f} s, {time.process_time() - cpu:.0f} s of CPU]", flush=True)
    mem = dev.memory_stats() or {}
    res["device"]["peak_bytes_in_use"] = mem.get("peak_bytes_in_use")
    res["seconds"] = time.perf_counter() - budget.t0
    print(table(res))
    print(f"device peak memory {_gib(res['device']['peak_bytes_in_use'])}; total {res['seconds']:.0f} s")
    if args.json:
        write_json(args.json, res, default=str)
    return 0


def estimate_rows(report: dict) -> list[dict]:
    """The train and eval steps' roofline estimates of a compile report, as the table shows them."""
    return [{"program": p["program"], "target": report["target"], "chip": report["chip"]["name"],
             "mesh": " x ".join(f"{k} {v}" for k, v in report["mesh"].items() if v > 1) or "one device",
             "step_seconds": p["roofline"]["estimate_s"],
             "bound": p["roofline"]["bound"], "mfu": p["mfu_estimate"], "memory_bytes": p["memory"]["total"]}
            for p in report["programs"] if "mfu_estimate" in p]


def _param_count(cfg) -> int:
    from flax import nnx

    from mtpjax.nn.model import build_model, param_counts

    return param_counts(nnx.eval_shape(lambda: build_model(cfg)))["total"]


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
