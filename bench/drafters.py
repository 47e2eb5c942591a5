"""Drafters on one trained trunk, side by side in one run: MTP modules trained jointly with the trunk, and modules
post-trained on the frozen trunk with data targets and with self targets at equal steps.

Measured: teacher-forced acceptance by depth on held-out text (greedy: `agreement/mtp_k`; stochastic at temperature
1: `accept_prob/mtp_k` = Σ min(p, q)) and the expected tokens per round from each; the cost of a frozen step
relative to a joint step (interleaved rounds, median of per-round ratios) beside the compiled FLOP ratio.

    python bench/drafters.py [--work runs/drafters] [--trunk-steps 300] [--post-steps 100] [--json out.json]
        [section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import interleave, load, log, median_ratio  # noqa: E402
from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.sharding import make_mesh  # noqa: E402
from mtpjax.train_loop import train  # noqa: E402
from mtpjax.train_step import make_programs  # noqa: E402

# The trunk: a small byte-level model on the embedded corpus (stdlib sources), two sequential MTP modules.
BASE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.mtp_depth=2",
        "data.seq_len=128", "train.batch_size=16", "train.eval_batches=8", "train.num_samples=0",
        "train.progress=false", "train.peak_flops=1e12", "checkpoint.every=100000", "optim.warmup_steps=20"]


def acceptance(out: dict, depth: int) -> dict:
    """Held-out teacher-forced acceptance by depth, and the expected tokens per round, from a run's final eval."""
    return {"agreement": [out[f"eval/agreement/mtp_{k}"] for k in range(1, depth + 1)],
            "accept_prob": [out[f"eval/accept_prob/mtp_{k}"] for k in range(1, depth + 1)],
            "expected_greedy": out["eval/expected_accept_length"],
            "expected_sampled": out["eval/expected_accept_length_sampled"],
            "loss_main": out["eval/loss/main"], "loss_mtp": [out[f"eval/loss/mtp_{k}"] for k in range(1, depth + 1)]}


def train_drafters(base, work: Path, trunk_steps: int, post_steps: int, targets=("data", "self")) -> dict:
    """Train the trunk jointly (its modules: 'joint'), then post-train fresh modules on it frozen per target."""
    depth = base.model.mtp_depth
    trunk_dir = work / "trunk"
    trunk = replace(base, [f"train.steps={trunk_steps}", f"train.eval_every={trunk_steps}",
                           f"train.run_dir={trunk_dir}"])
    out = {"joint": acceptance(train(trunk, fresh=True), depth) | {"steps": trunk_steps}}
    log(f"joint (trunk, {trunk_steps} steps): {out['joint']}")
    for target in targets:
        post = replace(base, [f"train.steps={post_steps}", f"train.eval_every={post_steps}",
                              f"train.run_dir={work / f'post-{target}'}", f"train.init_from={trunk_dir}",
                              "train.freeze=trunk", f"loss.mtp_target={target}"])
        out[f"frozen_{target}"] = acceptance(train(post, fresh=True), depth) | {"steps": post_steps}
        log(f"frozen, {target} targets ({post_steps} steps): {out[f'frozen_{target}']}")
    return out


def step_cost(base, rounds: int) -> dict:
    """Seconds per frozen and joint train step (interleaved, fixed random batch) and the compiled FLOP ratio."""
    steppers, flops = {}, {}
    for name, extra in [("joint", []), ("frozen", ["train.init_from=unused", "train.freeze=trunk"])]:
        cfg = replace(base, extra)
        progs = make_programs(cfg, make_mesh(cfg.mesh))
        B, T = cfg.train.batch_size, cfg.data.seq_len
        tok = jax.device_put(np.random.default_rng(0).integers(1, cfg.model.vocab_size, (B, T)).astype(np.int32),
                             progs.batch_sharding)
        seg = jax.device_put(np.ones((B, T), np.int32), progs.batch_sharding)
        box = [progs.init()]
        flops[name] = progs.train_step.lower(box[0], tok, seg).compile().cost_analysis()["flops"]

        def step(box=box, progs=progs, tok=tok, seg=seg):
            box[0], met = progs.train_step(box[0], tok, seg)
            jax.block_until_ready(met)

        step()
        steppers[name] = step
    t = interleave(steppers, rounds)
    return {"seconds_joint": float(np.median(t["joint"])), "seconds_frozen": float(np.median(t["frozen"])),
            "time_ratio_frozen_over_joint": median_ratio(t["frozen"], t["joint"]),
            "flop_ratio_frozen_over_joint": flops["frozen"] / flops["joint"], "rounds": rounds}


def table(res: dict) -> str:
    """The README's markdown table."""
    rows = ["| drafter | training | α greedy by depth | α sampled by depth | E greedy | E sampled |",
            "|---|---|---|---|---|---|"]
    names = {"joint": "MTP, joint with the trunk", "frozen_data": "MTP, frozen trunk, data targets",
             "frozen_self": "MTP, frozen trunk, self targets"}
    for key, label in names.items():
        if key in res["acceptance"]:
            r = res["acceptance"][key]
            fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
            rows.append(f"| {label} | {r['steps']} steps | {fmt(r['agreement'])} | {fmt(r['accept_prob'])} | "
                        f"{r['expected_greedy']:.2f} | {r['expected_sampled']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/drafters", help="run directories of the trunk and the post-trainings")
    ap.add_argument("--trunk-steps", type=int, default=300)
    ap.add_argument("--post-steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the step-cost comparison")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base = load_config("configs/tiny.yaml", [*BASE, *args.overrides])
    work = Path(args.work)
    res = {"config": base.to_dict()["model"], "load_start": load(),
           "acceptance": train_drafters(base, work, args.trunk_steps, args.post_steps)}
    res["step_cost"] = step_cost(base, args.rounds)
    log(f"step cost: {res['step_cost']}")
    res["load_end"] = load()
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
