"""MTP drafting variants side by side in one process: the recomputed window, and module 1 for every draft.

    python -m bench.mtp_drafting [--run-dir runs/tiny] [--gammas 1,2,3] [--batches 1,8]

Each round module k recomputes a window of rows ending at the draft position. The window the decoder used
before was γ + min(γ, D) rows; γ + 1 rows (the positions a round can commit, which also hold every entry a
rejection invalidates) is the smallest that keeps the module caches exact. "module1" drafts every token
with module 1 (as vLLM and SGLang do) instead of module k for token k: fewer windows, other drafts.
Every variant decodes the same prompts greedily; rounds are interleaved; ratios are medians of per-round
ratios of wall time and, in parentheses, of this process's CPU time (the work done, which a host loaded by
other processes does not inflate). mtp1 and mtp1_old_window run the same program (both windows are 2 rows
at γ = 1): their ratio shows the noise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402
from bench.decode_bench import _ours, load_subject  # noqa: E402
from mtpjax.decode import MTPChainProposer  # noqa: E402
from mtpjax.drafts import chain  # noqa: E402


@dataclass(frozen=True)
class OldWindow(MTPChainProposer):
    """The window before this change: γ + min(γ, D) rows."""

    depth: int = 0

    def window(self, depth: int) -> int:
        return self.tree.size + min(self.tree.size, self.depth)


def variants(depth: int, gammas) -> dict:
    """name -> the MTP proposer it decodes with."""
    out = {}
    for g in gammas:
        out[f"mtp{g}_old_window"] = OldWindow(chain(g), depth=depth)
        out[f"mtp{g}"] = MTPChainProposer(chain(g))
        if g > 1:
            out[f"mtp{g}_module1"] = MTPChainProposer(chain(g), modules=1)
    return out


def bench_batch(model, prompts, batch: int, max_new: int, rounds: int, gammas) -> dict:
    """Plain and every drafting variant at one batch size, interleaved: speedups, acceptance, exactness."""
    n = max(1, len(prompts) // batch) if batch == 1 else 1
    groups = [prompts[i * batch:(i + 1) * batch] for i in range(n)]
    gens = {"plain": _ours(model, groups, 0, "mtp", max_new)}
    for name, prop in variants(model.cfg.mtp_depth, gammas).items():
        gens[name] = _ours(model, groups, prop.tree.size, "mtp", max_new, variant=prop)
    cpu: dict = {}
    times = interleave({k: v[0] for k, v in gens.items()}, rounds, seed=batch, cpu=cpu)
    out = {"batch": batch, "max_new": max_new, "load": load(), "variants": {}}
    for name, (_, box) in gens.items():
        out["variants"][name] = {
            "vs_plain": median_ratio(times["plain"], times[name]),
            "vs_plain_cpu": median_ratio(cpu["plain"], cpu[name]),
            "identical_to_plain": box["tokens"] == gens["plain"][1]["tokens"],
            "acceptance_by_position": (box["accepted"] / np.maximum(box["reached"], 1)).tolist()}
    for g in gammas:  # the window change, measured as a ratio of the two variants' times in the same rounds
        old, new = f"mtp{g}_old_window", f"mtp{g}"
        out["variants"][new].update(vs_old_window=median_ratio(times[old], times[new]),
                                    vs_old_window_cpu=median_ratio(cpu[old], cpu[new]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--smoke", action="store_true", help="random tiny model, short generations")
    ap.add_argument("--gammas", default="1,2,3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded one by one at batch 1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=json_path, help="write the results here")
    args = ap.parse_args(argv)
    gammas = [int(g) for g in args.gammas.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model, prompts, source = load_subject(args.run_dir, args.smoke, max(batches + [args.prompts]), args.prompt_len)
    res = {"source": source, "batches": []}
    for b in batches:
        r = bench_batch(model, prompts[:max(b, args.prompts if b == 1 else b)], b, args.max_new, args.rounds, gammas)
        res["batches"].append(r)
        for k, v in r["variants"].items():
            extra = (f"  x{v['vs_old_window']:.2f} (CPU time: x{v['vs_old_window_cpu']:.2f}) vs the old window"
                     if "vs_old_window" in v else "")
            alpha = [round(a, 3) for a in v["acceptance_by_position"]]
            print(f"  batch {b:3d} {k:18s} x{v['vs_plain']:.2f} (CPU x{v['vs_plain_cpu']:.2f}) vs plain{extra}  "
                  f"α {alpha}  "
                  f"identical {v['identical_to_plain']}")
        log(f"  batch {b} done")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
