"""This checkout's decode loop against another commit's, in one process: MTP chains at batch 1, 8 and 32.

The other commit's `mtpjax` is extracted with `git archive` into a temporary package `mtpjax_base` (its imports
renamed), so both decoders run side by side on models built from the same config and seed (random weights), with
the same prompts; rounds are interleaved (A B, B A, ...) and the ratio is the median of per-round ratios. Greedy
outputs must be identical (the row says so).

    python -m bench.decode_ab --baseline main --configs tiny cpu_deep --batches 1 8 32 --gammas 1 2 \\
        --rounds 7 --json bench/decode_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402


def extract(commit: str, into: Path) -> str:
    """The commit's mtpjax package as `mtpjax_base` under `into` (put on sys.path); returns the commit's hash."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True,
                         check=True).stdout.strip()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "mtpjax"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    (into / "mtpjax").rename(into / "mtpjax_base")
    for f in (into / "mtpjax_base").rglob("*.py"):
        f.write_text(re.sub(r"\bmtpjax(?=[.\s])", "mtpjax_base", f.read_text()))
    sys.path.insert(0, str(into))
    return sha


def body_ops(pkg: str, model, loop, prompts) -> int:
    """Instructions in the compiled loop's body (the round): a count the machine's load cannot move."""
    host, loop_mod = (importlib.import_module(f"{pkg}.decode.{m}") for m in ("host", "loop"))
    graph, params = nnx.split(model)
    hlo = loop_mod.execute.lower(loop, (graph, None), (params, None), host.request(loop, prompts)).compile().as_text()
    body = re.search(r"while\(.*?body=%?([\w.-]+)", hlo).group(1)
    text = hlo[hlo.index(f"%{body} ("):]
    return text[: text.index("\n}\n")].count(" = ")


def subject(pkg: str, config: str):
    """(model, make_loop, run) of package `pkg` for configs/<config>.yaml with random weights (seed 0)."""
    cfg = importlib.import_module(f"{pkg}.config").load_config(str(ROOT / "configs" / f"{config}.yaml"), [])
    model = importlib.import_module(f"{pkg}.nn.model").build_model(cfg.model, seed=0)
    host = importlib.import_module(f"{pkg}.decode.host")
    return model, host.make_loop, host.run


def chain_of(make_loop, gamma: int) -> dict:
    """make_loop's arguments for a chain of γ as the package spells them (draft=, or num_draft= before decode.draft)."""
    return {"draft" if "draft_model" in inspect.signature(make_loop).parameters else "num_draft": gamma}


def measure(config: str, batch: int, gamma: int, max_new: int, rounds: int) -> dict:
    """Seconds per generation of both decoders for one request shape, and whether their tokens agree."""
    rng = np.random.default_rng(batch)
    fns, outs, ops = {}, {}, {}
    for pkg in ("mtpjax", "mtpjax_base"):
        model, make_loop, run = subject(pkg, config)
        if pkg == "mtpjax":
            prompts = rng.integers(0, model.cfg.vocab_size, (batch, 16)).tolist()
        loop = make_loop(model, prompts, max_new_tokens=max_new, proposer="mtp", **chain_of(make_loop, gamma))

        def go(model=model, loop=loop, run=run, prompts=prompts, pkg=pkg):
            st = run(model, prompts, loop)
            outs[pkg] = np.asarray(jax.block_until_ready(st.seq_BS))

        go()  # compile
        fns[pkg], ops[pkg] = go, body_ops(pkg, model, loop, prompts) if batch == 1 else None  # shape-independent
    cpu: dict = {}
    secs = interleave(fns, rounds, cpu=cpu)
    return {"config": config, "batch": batch, "gamma": gamma, "ours_s": float(np.median(secs["mtpjax"])),
            "base_s": float(np.median(secs["mtpjax_base"])),
            "ratio": median_ratio(secs["mtpjax"], secs["mtpjax_base"]),
            "cpu_ratio": median_ratio(cpu["mtpjax"], cpu["mtpjax_base"]),
            "identical": bool((outs["mtpjax"] == outs["mtpjax_base"]).all()), "ours_body_ops": ops["mtpjax"],
            "base_body_ops": ops["mtpjax_base"], "load": load()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--baseline", default="main", help="the commit whose decoder is the baseline")
    p.add_argument("--configs", nargs="+", default=["tiny", "cpu_deep"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--gammas", nargs="+", type=int, default=[1, 2])
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=json_path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sha = extract(args.baseline, Path(tmp))
        log(f"baseline {args.baseline} = {sha[:10]}")
        rows = []
        for config in args.configs:
            for batch in args.batches:
                for gamma in args.gammas:
                    rows.append(measure(config, batch, gamma, args.max_new, args.rounds))
                    r = rows[-1]
                    log(f"{config} batch {batch} chain {gamma}: ours {r['ours_s'] * 1e3:.1f} ms, base "
                        f"{r['base_s'] * 1e3:.1f} ms, ratio {r['ratio']:.3f} (CPU time {r['cpu_ratio']:.3f}), "
                        f"identical {r['identical']}, round body {r['ours_body_ops']} vs {r['base_body_ops']} "
                        "instructions")
    if args.json:
        write_json(args.json, {"baseline": sha, "rows": rows})


if __name__ == "__main__":
    main()
