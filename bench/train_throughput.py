"""Train-step throughput: tokens/s and MFU against this machine's matmul peak (measured in the same run,
interleaved with the steps), and the step-time cost of MTP depth 1, 2, 3 relative to 0 beside the FLOP ratio.
With --peer: our step without MTP and with one MTP module beside a `transformers` Llama of the same shape
trained in PyTorch eager and torch.compile (bench/peer.py), tokens/s ratios as medians of interleaved rounds.

    python bench/train_throughput.py [--config configs/tiny.yaml] [--steps 5] [--json out.json] [section.key=value ...]
    python bench/train_throughput.py --peer --config configs/tiny.yaml --steps 7 train.batch_size=8
    taskset -c 0 python bench/train_throughput.py --peer --threads 1 ...   # the work alone, on one core
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, peak_rss_mb, write_json  # noqa: E402
from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.nn.flops import train_flops_per_token  # noqa: E402
from mtpjax.train.metrics import measure_peak_flops  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402


def random_tokens(cfg) -> np.ndarray:
    """The fixed batch every stepper trains on: int32[batch_size, seq_len] uniform over the vocabulary."""
    rng = np.random.default_rng(0)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len)).astype(np.int32)


def compiled_step(cfg, compiler_options: dict | None = None):
    """(a closure running one train step on the fixed random tokens and returning its metrics, the compiled program),
    compiled with `compiler_options` (XLA's, for this program alone) and warmed up."""
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    box = [progs.init()]
    tok = jax.device_put(random_tokens(cfg), progs.batch_sharding)
    seg = jax.device_put(np.ones_like(random_tokens(cfg)), progs.batch_sharding)
    compiled = progs.train_step.lower(box[0], tok, seg).compile(compiler_options=compiler_options)

    def step():
        box[0], met = compiled(box[0], tok, seg)
        return jax.block_until_ready(met)

    step()
    step()
    return step, compiled


def make_stepper(cfg):
    """A closure running one jitted train step on fixed random tokens (compiled and warmed up)."""
    return compiled_step(cfg)[0]


def measure(base, depths, rounds: int, peak_n: int = 2048, peak_seconds: float = 0.5) -> dict:
    """Interleaved rounds of (matmul peak, one step per depth); MFU and overheads as medians of per-round ratios."""
    B, T = base.train.batch_size, base.data.seq_len
    tokens = B * T
    cfgs = {d: replace(base, [f"model.mtp_depth={d}"]) for d in depths}
    steppers = {d: make_stepper(c) for d, c in cfgs.items()}
    fpt = {d: train_flops_per_token(c.model, T) for d, c in cfgs.items()}
    peaks, times = [], {d: [] for d in depths}
    order = list(depths)
    for r in range(rounds):
        peaks.append(measure_peak_flops(peak_n, peak_seconds))
        for d in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            steppers[d]()
            times[d].append(time.perf_counter() - t0)
    peak = np.asarray(peaks)
    rows = {}
    for d in depths:
        t = np.asarray(times[d])
        mfu = float(np.median(tokens * fpt[d] / t / peak))
        rows[str(d)] = {"step_seconds": float(np.median(t)), "tokens_per_sec": float(np.median(tokens / t)),
                        "flops_per_token": fpt[d], "mfu": mfu}
        if depths[0] == 0 and d != 0:
            ratio = median_ratio(t, times[0])
            flop_ratio = fpt[d] / fpt[0]
            # overhead over the FLOP share: 1.0 = the extra depth costs exactly its share of FLOPs
            rows[str(d)].update({"step_time_ratio": ratio, "flop_ratio": flop_ratio,
                                 "overhead_vs_flop_share": (ratio - 1) / (flop_ratio - 1)})
    return {"model": {"d_model": base.model.d_model, "n_layers": base.model.n_layers, "vocab": base.model.vocab_size,
                      "batch": B, "seq_len": T},
            "peak_flops": float(np.median(peak)), "peak_matmul_n": peak_n, "rounds": rounds, "depths": rows,
            "peak_rss_mb": peak_rss_mb(), "load": load()}


def measure_peer(base, rounds: int, compile: bool = True, threads: int = 2) -> dict:
    """Tokens/s of our step (no MTP, one MTP module) and of the PyTorch peer (eager, torch.compile), interleaved
    rounds in a shuffled order; each ratio is the median of per-round ratios against eager (and compile)."""
    from bench.peer import available, peer_train_step
    from mtpjax.nn.model import build_model

    cfg0 = replace(base, ["model.mtp_depth=0"])
    steppers = {"mtpjax": make_stepper(cfg0), "mtpjax_mtp1": make_stepper(replace(base, ["model.mtp_depth=1"]))}
    why = available()
    if why is None:
        tok, model = random_tokens(cfg0), build_model(cfg0, seed=cfg0.train.seed)
        variants = {"torch_eager": False, "torch_compile": True} if compile else {"torch_eager": False}
        for name, comp in variants.items():
            step = peer_train_step(model, cfg0.optim, tok, threads, compile=comp)
            t0 = time.perf_counter()
            try:
                step(), step()  # warm-up (torch.compile compiles here)
            except Exception as e:  # noqa: BLE001 - any compiler failure means: no compiled peer on this machine
                log(f"  {name}: does not compile here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
            log(f"  {name}: warm-up {time.perf_counter() - t0:.1f} s")
            steppers[name] = step
    cpu: dict = {}
    times = interleave(steppers, rounds, cpu=cpu)  # CPU seconds too: on a loaded host wall time is contended
    tokens = base.train.batch_size * base.data.seq_len
    rows = {k: {"step_seconds": float(np.median(t)), "tokens_per_sec": tokens / float(np.median(t)),
                "cpu_seconds": float(np.median(cpu[k]))} for k, t in times.items()}
    for k in rows:
        for ref in ("torch_eager", "torch_compile"):
            if ref in times and k.startswith("mtpjax"):
                rows[k][f"vs_{ref}"] = median_ratio(times[ref], times[k])  # tokens/s ratio = inverse time ratio
    rows["mtpjax_mtp1"]["step_time_ratio"] = median_ratio(times["mtpjax_mtp1"], times["mtpjax"])
    T = base.data.seq_len
    rows["mtpjax_mtp1"]["flop_ratio"] = (train_flops_per_token(replace(base, ["model.mtp_depth=1"]).model, T)
                                         / train_flops_per_token(cfg0.model, T))
    return {"model": {"d_model": base.model.d_model, "n_layers": base.model.n_layers, "vocab": base.model.vocab_size,
                      "batch": base.train.batch_size, "seq_len": T},
            "rounds": rounds, "threads": threads, "peer_skipped": why, "variants": rows, "load": load()}


def print_peer(res: dict, config: str) -> None:
    """The peer table: tokens/s and ratios per variant, the load beside it."""
    m = res["model"]
    print(f"{config}: d={m['d_model']} L={m['n_layers']} V={m['vocab']} batch {m['batch']} x seq {m['seq_len']}, "
          f"{res['rounds']} interleaved rounds, torch threads {res['threads']}")
    for k, r in res["variants"].items():
        ratios = "".join(f"  {r[f'vs_{ref}']:.2f}x {ref}" for ref in ("torch_eager", "torch_compile")
                         if f"vs_{ref}" in r)
        print(f"  {k:14s} {r['step_seconds'] * 1e3:8.1f} ms/step ({r['cpu_seconds'] * 1e3:8.1f} ms CPU) "
              f"{r['tokens_per_sec']:9,.0f} tok/s{ratios}")
    r = res["variants"]["mtpjax_mtp1"]
    log(f"  one MTP module: step time x{r['step_time_ratio']:.3f} vs FLOPs x{r['flop_ratio']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=5, help="interleaved rounds (one step per depth each)")
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("--peak-n", type=int, default=2048, help="matmul size of the peak measurement")
    ap.add_argument("--json", type=json_path, help="write the results here")
    ap.add_argument("--peer", action="store_true", help="our step (MTP 0, 1) beside the transformers peer instead")
    ap.add_argument("--no-compile", action="store_true", help="--peer: skip torch.compile (minutes to compile)")
    ap.add_argument("--threads", type=int, default=2, help="--peer: PyTorch's threads (XLA takes the process's cores)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    base = load_config(args.config, args.overrides)
    if args.peer:
        res = measure_peer(base, args.steps, compile=not args.no_compile, threads=args.threads)
        res["config"] = args.config
        print_peer(res, args.config)
        if args.json:
            write_json(args.json, res)
        return 0
    depths = [int(x) for x in args.depths.split(",")]
    res = measure(base, depths, args.steps, args.peak_n, 0.5 if args.peak_n >= 1024 else 0.1)
    res["config"] = args.config
    m = res["model"]
    print(f"{args.config}: d={m['d_model']} L={m['n_layers']} V={m['vocab']} batch {m['batch']} x seq {m['seq_len']}; "
          f"f32 {args.peak_n}^2 matmul peak {res['peak_flops'] / 1e9:.1f} GFLOP/s (median of rounds)")
    for d, r in res["depths"].items():
        extra = ""
        if "step_time_ratio" in r:
            extra = (f"  step-time x{r['step_time_ratio']:.3f} vs FLOPs x{r['flop_ratio']:.3f} "
                     f"(overhead/FLOP share {r['overhead_vs_flop_share']:.2f})")
        print(f"  mtp_depth {d}: {r['step_seconds'] * 1e3:8.1f} ms/step {r['tokens_per_sec']:9,.0f} tok/s  "
              f"MFU {r['mfu']:6.1%}{extra}")
    log(f"  peak host memory {res['peak_rss_mb']:.0f} MiB")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
