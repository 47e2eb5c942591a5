"""python -m bench [--smoke] [--out bench/results.json]: every comparison in its own process, one table of ratios."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import load, mtp_chain
from bench.plots import make_plots

ROOT = Path(__file__).resolve().parent.parent
SMOKE_TRAIN = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=32",
               "train.batch_size=4"]


def _child(module: str, args: list[str], tmp: Path, name: str) -> dict:
    """Run one comparison in a fresh process (its own peak memory) and read back its JSON."""
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", module, *args, "--json", str(out)]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(out.read_text())


def run_suite(smoke: bool, rounds: int, run_dir: str, no_peer: bool, tmp: Path, large_run_dir: str | None = None,
              draft_run_dir: str = "runs/draft_tiny") -> dict:
    """Training throughput per config, then decoding (ours vs the PyTorch peer); the raw results dict.

    `large_run_dir`: a checkpoint whose weights do not fit the last-level cache, decoded at batch 1 too:
    there a decode step is bound by reading weights, the regime speculation is for. `draft_run_dir`: the
    draft model decoded beside MTP and n-gram (random in smoke mode; skipped, with a note, if absent).
    """
    train = {}
    for name, cfg, depths in [("tiny", "configs/tiny.yaml", "0,1,2,3"),
                              ("cpu_medium", "configs/cpu_medium.yaml", "0,1")]:
        depths = ",".join(depths.split(",")[::2]) if smoke and name == "tiny" else depths  # smoke: 0,2 only
        args = ["--config", cfg, "--steps", str(rounds), "--depths", depths]
        args += ["--peak-n", "256", *SMOKE_TRAIN] if smoke else []
        train[name] = _child("bench.train_throughput", args, tmp, f"train_{name}")
        if not no_peer:  # issue 29's comparison: batch 8 x 256, our step (MTP 0, 1) beside the transformers Llama
            pargs = ["--peer", "--config", cfg, "--steps", str(rounds), "train.batch_size=8"]
            pargs += ["--no-compile", *SMOKE_TRAIN] if smoke else []
            train[f"{name}_peer"] = _child("bench.train_throughput", pargs, tmp, f"train_peer_{name}")
    dargs = ["--run-dir", run_dir, "--draft-run-dir", draft_run_dir, "--rounds", str(rounds)]
    if smoke:
        dargs += ["--smoke", "--batches", "1,2", "--max-new", "8", "--prompts", "2", "--prompt-len", "16"]
    if no_peer:
        dargs.append("--no-peer")
    decode = _child("bench.decode_bench", dargs, tmp, "decode")
    cliff = _child("bench.cache_cliff", ["--layers", "1,2", "--d-model", "64"] if smoke else [], tmp, "cache_cliff")
    res = {"smoke": smoke, "train": train, "decode": decode, "cache_cliff": cliff}
    if large_run_dir:
        largs = ["--run-dir", large_run_dir, "--rounds", str(rounds), "--batches", "1", "--no-peer"]
        largs += ["--smoke", "--max-new", "8", "--prompts", "2", "--prompt-len", "16"] if smoke else []
        res["decode_large"] = _child("bench.decode_bench", largs, tmp, "decode_large")
    return res


def targets(res: dict) -> list[dict]:
    """Each target of the performance issue as (measured ratio, goal, met)."""
    t, rows = res["train"], []

    def add(name, value, goal, ok):
        rows.append({"target": name, "value": value, "goal": goal, "met": bool(ok) if value is not None else None})

    add("train MFU, tiny (mtp_depth 2)", t["tiny"]["depths"]["2"]["mfu"], ">= 0.40",
        t["tiny"]["depths"]["2"]["mfu"] >= 0.4)
    add("train MFU, cpu_medium (mtp_depth 1)", t["cpu_medium"]["depths"]["1"]["mfu"], ">= 0.50",
        t["cpu_medium"]["depths"]["1"]["mfu"] >= 0.5)
    worst = max(r["overhead_vs_flop_share"] for r in t["tiny"]["depths"].values() if "overhead_vs_flop_share" in r)
    add("MTP step-time overhead / FLOP share (worst depth, tiny)", worst, "<= 1.10", worst <= 1.1)
    for name in ("tiny", "cpu_medium"):
        v = t.get(f"{name}_peer", {}).get("variants", {}).get("mtpjax", {})
        for ref, goal in (("torch_eager", 1.5), ("torch_compile", 1.0)):
            if f"vs_{ref}" in v:
                add(f"train tokens/s / transformers {ref.split('_')[1]}, {name} (no MTP, batch 8)", v[f"vs_{ref}"],
                    f">= {goal}", v[f"vs_{ref}"] >= goal)
    by_b = {b["batch"]: b["variants"] for b in res["decode"]["batches"]}
    b1 = by_b[min(by_b)]
    peer = b1.get("peer_greedy")
    add("plain greedy / transformers greedy, batch 1", 1 / peer["vs_plain"] if peer else None, ">= 3",
        peer and 1 / peer["vs_plain"] >= 3)
    mtps = {k: v for k, v in b1.items() if mtp_chain(k)}
    if mtps:
        best = max(mtps, key=lambda k: mtps[k]["vs_plain"])
        add(f"MTP speculative ({best}) / plain greedy, batch 1", mtps[best]["vs_plain"], ">= 2",
            mtps[best]["vs_plain"] >= 2)
        _add_ceiling(add, min(res["decode"]["batches"], key=lambda b: b["batch"]), "")
        mp = mtps[best]["measured_over_predicted"]
        add(f"{best} measured / formula-predicted speedup, batch 1", mp, "within 10%", abs(mp - 1) <= 0.1)
    if "decode_large" in res:
        lv = res["decode_large"]["batches"][0]["variants"]
        lm = {k: v for k, v in lv.items() if mtp_chain(k)}
        best = max(lm, key=lambda k: lm[k]["vs_plain"])
        size = f", {res['decode_large']['weights_mb']:.0f} MB model"
        add(f"MTP speculative ({best}) / plain greedy, batch 1{size}", lm[best]["vs_plain"], "> 1 (faster)",
            lm[best]["vs_plain"] > 1)
        _add_ceiling(add, res["decode_large"]["batches"][0], size)
    big = by_b[max(by_b)]
    if "auto" in big:
        chose = big["auto"].get("tree") or big["auto"]["num_draft"]
        add(f"auto num_draft ({chose}) / plain, batch {max(by_b)}", big["auto"]["vs_plain"],
            ">= 1 (never slower)", big["auto"]["vs_plain"] >= 0.98)
    return rows


def _add_ceiling(add, batch: dict, size: str) -> None:
    """The row saying whether 2x is reachable at all: the best E(γ)/(1+γr) with this model's measured α."""
    c = batch.get("ceiling")
    if c:
        add(f"MTP ceiling E/(1+γr), r = {c['ceiling_r']:.2f}, batch {batch['batch']}{size}", c["max"],
            ">= 2 (2x reachable)", c["max"] >= 2)


def proposer_rows(res: dict) -> list[dict]:
    """Per proposer, side by side: the best speedup vs plain at each batch size, its acceptance, the ceiling."""
    rows = []
    for prefix, name, ceil in (("mtp", "MTP modules", "ceiling"), ("ngram", "n-gram", None),
                               ("model", "draft model", "draft_ceiling")):
        by_batch = {}
        for b in res["decode"]["batches"]:
            v = {k: x for k, x in b["variants"].items() if k.startswith(prefix) and k[len(prefix):].isdigit()}
            if v:
                best = max(v, key=lambda k: v[k]["vs_plain"])
                by_batch[b["batch"]] = {"variant": best, "vs_plain": v[best]["vs_plain"],
                                        "acceptance_by_position": v[best].get("acceptance_by_position", []),
                                        "ceiling": b[ceil]["max"] if ceil and ceil in b else None}
        if by_batch:
            rows.append({"proposer": name, "by_batch": by_batch})
    return rows


def print_table(res: dict) -> None:
    print(f"\n{'target':58s} {'measured':>9s}  {'goal':>20s}  met")
    for r in res["targets"]:
        v = "n/a" if r["value"] is None else f"{r['value']:.3f}"
        print(f"{r['target']:58s} {v:>9s}  {r['goal']:>20s}  {r['met']}")
    print("\nspeculative / plain greedy by proposer (best γ; acceptance by position; ceiling E/(1+γr)):")
    for r in res.get("proposers", []):
        cells = "  ".join(f"batch {b}: x{c['vs_plain']:.2f} "
                          f"({c['variant']}, α {[round(a, 2) for a in c['acceptance_by_position']]}"
                          + (f", ceiling x{c['ceiling']:.2f})" if c["ceiling"] is not None else ")")
                          for b, c in r["by_batch"].items())
        print(f"  {r['proposer']:12s} {cells}")
    if res["decode"].get("draft_skipped"):
        print(f"  draft model skipped: {res['decode']['draft_skipped']}")
    rows = res.get("cache_cliff", {}).get("rows", [])
    if rows:
        print("decode round cost per layer vs weights (plain, batch 1): " + ", ".join(
            f"{r['weights_mb']:.1f} MB {r['us_per_layer']:.0f} us" for r in rows))
    print(f"load average {load()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few steps: seconds, for tests")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per comparison (default 5, smoke 1)")
    ap.add_argument("--run-dir", default="runs/tiny",
                    help="trained checkpoint for decoding (the README's quickstart)")
    ap.add_argument("--no-peer", action="store_true", help="skip the PyTorch peer")
    ap.add_argument("--draft-run-dir", default="runs/draft_tiny",
                    help="a draft-model run with the same tokenizer (python train.py --config configs/draft_tiny.yaml)")
    ap.add_argument("--large-run-dir", default=None,
                    help="also decode this checkpoint at batch 1: weights beyond the last-level cache "
                         "(docs/benchmarks.md: runs/medium_mtp2)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.smoke else 5)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            res = run_suite(args.smoke, rounds, args.run_dir, args.no_peer, Path(tmp), args.large_run_dir,
                            args.draft_run_dir)
        except subprocess.CalledProcessError as e:
            print(f"error: benchmark step failed (exit {e.returncode}): {' '.join(e.cmd[1:3])}", file=sys.stderr)
            return 2
    res["targets"] = targets(res)
    res["proposers"] = proposer_rows(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res["plots"] = make_plots(res, out.parent)
    res["command"] = "python -m bench" + (" --smoke" if args.smoke else "") + (
        f" --large-run-dir {args.large_run_dir}" if args.large_run_dir else "")
    out.write_text(json.dumps(res, indent=2))
    print_table(res)
    print(f"wrote {out}" + "".join(f"\nwrote {p}" for p in res["plots"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
