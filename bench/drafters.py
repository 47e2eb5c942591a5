"""Drafters on one trained trunk, side by side in one run: MTP modules trained jointly with the trunk, and modules
post-trained on the frozen trunk with data targets and with self targets at equal steps.

Measured: teacher-forced acceptance by depth on held-out text (greedy: `agreement/mtp_k`; stochastic at temperature
1: `accept_prob/mtp_k` = Σ min(p, q)) and the expected tokens per round from each; the cost of a frozen step
relative to a joint step (interleaved rounds, median of per-round ratios) beside the compiled FLOP ratio.

    python bench/drafters.py [--work runs/drafters] [--trunk-steps 300] [--post-steps 100] [--json out.json]
        [section.key=value ...]

--objectives (issue 24): modules post-trained on the one frozen trunk at equal steps with each objective of
OBJECTIVES (data, self, tv, tv with module 1 unrolled, data targets on the trunk's own greedy text): teacher-forced
acceptance by position for module-k chains (`mtp`, γ = D) and module-1 chains (`mtp1`, γ = 4), sampled
accept_prob per depth (eval), free greedy decoding at batch 1 of module-k chains and of module-1 chains of length
1..4 (tokens per round, speedup over plain decoding, interleaved rounds, output identical to plain).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402
from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.loop import train  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402

# The trunk: a small byte-level model on the embedded corpus (stdlib sources), two sequential MTP modules.
# The draft model: 2 narrow blocks, no MTP modules (its drafts cost a fraction of an MTP module's).
DRAFT_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.mtp_depth=0"]
BASE = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.mtp_depth=2",
        "data.seq_len=128", "train.batch_size=16", "train.eval_batches=8", "train.num_samples=0",
        "train.progress=false", "train.peak_flops=1e12", "checkpoint.every=100000", "optim.warmup_steps=20",
        "data.tokenizer=byte", "model.vocab_size=256"]  # byte-level, as measured (configs/tiny.yaml is now BPE 1k)


def acceptance(out: dict, depth: int) -> dict:
    """Held-out teacher-forced acceptance by depth, and the expected tokens per round, from a run's final eval."""
    return {"agreement": [out[f"eval/agreement/mtp_{k}"] for k in range(1, depth + 1)],
            "accept_prob": [out[f"eval/accept_prob/mtp_{k}"] for k in range(1, depth + 1)],
            "expected_greedy": out["eval/expected_accept_length"],
            "expected_sampled": out["eval/expected_accept_length_sampled"],
            "loss_main": out["eval/loss/main"], "loss_mtp": [out[f"eval/loss/mtp_{k}"] for k in range(1, depth + 1)]}


# --objectives: the frozen-trunk post-trainings compared (each at the same steps; unroll 3 = module 1 also applied
# at chain positions 2..4, the chain mtp1 runs; own text: 64-token greedy continuations of 16-token corpus prompts)
OBJECTIVES = {"data": ["loss.mtp_target=data"], "self": ["loss.mtp_target=self"], "tv": ["loss.mtp_target=tv"],
              "tv_unroll": ["loss.mtp_target=tv", "loss.mtp_unroll=3", "loss.mtp_unroll_module=first"],
              "own_text": ["loss.mtp_target=data", "train.own_text=greedy", "train.own_text_prompt_len=16"]}
CHAIN = 4  # longest module-1 chain measured


def train_drafters(base, work: Path, trunk_steps: int, post_steps: int, targets=("data", "self"),
                   extra: dict | None = None) -> dict:
    """Train the trunk jointly (its modules: 'joint'), then post-train fresh modules on it frozen per target
    (`extra`: {name: overrides} instead of the targets)."""
    depth = base.model.mtp_depth
    trunk_dir = work / "trunk"
    trunk = replace(base, [f"train.steps={trunk_steps}", f"train.eval_every={trunk_steps}",
                           f"train.run_dir={trunk_dir}"])
    out = {"joint": acceptance(train(trunk, fresh=True), depth) | {"steps": trunk_steps}}
    log(f"joint (trunk, {trunk_steps} steps): {out['joint']}")
    for target, over in (extra or {t: [f"loss.mtp_target={t}"] for t in targets}).items():
        post = replace(base, [f"train.steps={post_steps}", f"train.eval_every={post_steps}",
                              f"train.run_dir={work / f'post-{target}'}", f"train.init_from={trunk_dir}",
                              "train.freeze=trunk", *over])
        out[f"frozen_{target}"] = acceptance(train(post, fresh=True), depth) | {"steps": post_steps}
        log(f"frozen, {target} ({post_steps} steps): {out[f'frozen_{target}']}")
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


def train_draft_model(base, work: Path, steps: int) -> Path:
    """A small independent draft model (no MTP modules) on the same corpus and tokenizer: the draft-model proposer."""
    d = work / "draft"
    cfg = replace(base, [*DRAFT_MODEL, f"train.steps={steps}", f"train.eval_every={steps}", f"train.run_dir={d}"])
    train(cfg, fresh=True)
    return d


def subjects(work: Path, with_draft: bool, posts=("data", "self")):
    """{drafter: (model, proposer, draft model)} sharing one trunk, and held-out sequences of the corpus."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    from mtpjax.train.checkpoint import load_model
    from mtpjax.data import prepare

    cfg, trunk, tok = load_model(work / "trunk")
    out = {"joint": (trunk, "mtp", None)}
    for t in posts:
        out[f"frozen_{t}"] = (load_model(work / f"post-{t}")[1], "mtp", None)
    if not with_draft and posts != ("data", "self"):
        return cfg, out, prepare(cfg.data).val_tokens, tok.eos_id
    out["ngram"] = (trunk, "ngram", None)
    if with_draft:
        out["draft_model"] = (trunk, "model", load_model(work / "draft")[1])
    return cfg, out, prepare(cfg.data).val_tokens, tok.eos_id


def forced_by_position(drafters: dict, seqs, prompt_len: int, gamma: int) -> dict:
    """Teacher-forced acceptance by draft position on held-out text (the decoder walks the reference)."""
    from mtpjax.eval.evaluate import forced_acceptance

    return {k: forced_acceptance(m, seqs, prompt_len, gamma, proposer, draft)
            for k, (m, proposer, draft) in drafters.items()}


def decode_speed(cfg, drafters: dict, prompts, gamma: int, batches, max_new: int, rounds: int) -> dict:
    """Free greedy decoding per batch size: tokens per round, speedup over plain decoding (interleaved rounds,
    median of per-round ratios, wall and CPU time), output identical to plain, and each drafter's ceiling."""
    from bench.decode_bench import _ours
    from mtpjax.decode.proposers import make_proposer
    from mtpjax.drafts import chain
    from mtpjax.eval.evaluate import decode_context
    from mtpjax.nn.speed import floor_ratio, speedup_ceiling

    out = {}
    for batch in batches:
        n = max(1, len(prompts) // batch) if batch == 1 else 1
        groups = [prompts[i * batch:(i + 1) * batch] for i in range(n)]
        trunk = drafters["joint"][0]
        gens = {"plain": _ours(trunk, groups, 0, "mtp", max_new)}
        for k, (m, proposer, draft) in drafters.items():
            gens[k] = _ours(m, groups, gamma, proposer, max_new, draft)
        cpu: dict = {}
        times = interleave({k: v[0] for k, v in gens.items()}, rounds, seed=batch, cpu=cpu)
        plain, context = gens["plain"][1], decode_context(prompts, max_new)
        rows = {}
        for k, (_, box) in gens.items():
            r = {"tokens_per_sec": float(np.median(batch * n * max_new / np.asarray(times[k]))),
                 "vs_plain": median_ratio(times["plain"], times[k]), "vs_plain_cpu": median_ratio(cpu["plain"], cpu[k]),
                 "identical_to_plain": box["tokens"] == plain["tokens"]}
            if k != "plain":
                m, proposer, draft = drafters[k]
                alpha = (box["accepted"] / np.maximum(box["reached"], 1)).tolist()
                ratio = lambda g, p=proposer, d=draft, c=context: floor_ratio(
                    make_proposer(p, chain(g)), cfg.model, c, None if d is None else d.cfg)
                r |= {"tokens_per_round": (box["generated"] - box["rows"]) / max(box["rounds"], 1),
                      "acceptance_by_position": alpha, "ceiling": speedup_ceiling(alpha, ratio, gamma)["max"]}
            rows[k] = r
        out[str(batch)] = rows
        log(f"batch {batch}: " + ", ".join(f"{k} x{r['vs_plain']:.2f}" for k, r in rows.items()))
    return out


def table(res: dict) -> str:
    """The markdown table of docs/benchmarks.md: one row per drafter on the one trunk."""
    labels = {"joint": "MTP, trained jointly with the trunk", "frozen_data": "MTP, frozen trunk, data targets",
              "frozen_self": "MTP, frozen trunk, self targets", "ngram": "n-gram (prompt lookup)",
              "draft_model": "draft model (2 x 64 wide)"}
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
    batches = list(res.get("decode", {}))
    rows = ["| drafter | training steps | eval α greedy / sampled (depth 1) | teacher-forced α by position | "
            "tokens per round (batch 1) | " + " | ".join(f"speedup b{b} wall (CPU)" for b in batches)
            + " | ceiling (b1) |",
            "|---|---|---|---|---|" + "---|" * len(batches) + "---|"]
    for key, label in labels.items():
        if key not in res.get("forced", {}):
            continue
        acc = res["acceptance"].get(key)
        steps = acc["steps"] if acc else "-"
        ev = f"{acc['agreement'][0]:.3f} / {acc['accept_prob'][0]:.3f}" if acc else "-"
        dec = [res["decode"][b][key] for b in batches]
        rows.append(f"| {label} | {steps} | {ev} | {fmt(res['forced'][key])} | {dec[0]['tokens_per_round']:.2f} | "
                    + " | ".join(f"{d['vs_plain']:.2f}x ({d['vs_plain_cpu']:.2f}x)" for d in dec)
                    + f" | {dec[0]['ceiling']:.2f}x |")
    return "\n".join(rows)


def chains(drafters: dict, seqs, prompts, prompt_len: int, depth: int, max_new: int, rounds: int) -> dict:
    """Per drafter: teacher-forced acceptance by position of the module-k chain (mtp, γ = D) and of the module-1
    chain (mtp1, γ = CHAIN); free greedy decoding at batch 1 of mtp γ = D and mtp1 γ = 1..CHAIN: tokens per round,
    speedup over plain (interleaved rounds, median of per-round ratios, wall and CPU), identical to plain."""
    from bench.decode_bench import _ours

    out = {k: {"forced_mtp": forced_by_position({k: v}, seqs, prompt_len, depth)[k],
               "forced_mtp1": forced_by_position({k: (v[0], "mtp1", None)}, seqs, prompt_len, CHAIN)[k]}
           for k, v in drafters.items()}
    log(f"teacher-forced: {out}")
    groups = [[p] for p in prompts]  # batch 1
    trunk = drafters["joint"][0]
    gens = {"plain": _ours(trunk, groups, 0, "mtp", max_new)}
    for k, (m, _, _) in drafters.items():
        gens[f"{k}/mtp{depth}"] = _ours(m, groups, depth, "mtp", max_new)
        gens |= {f"{k}/mtp1x{g}": _ours(m, groups, g, "mtp1", max_new) for g in range(1, CHAIN + 1)}
    cpu: dict = {}
    times = interleave({k: v[0] for k, v in gens.items()}, rounds, seed=1, cpu=cpu)
    plain = gens["plain"][1]["tokens"]
    for name, (_, box) in gens.items():
        if name == "plain":
            continue
        k, chain = name.split("/")
        out[k][chain] = {"tokens_per_round": (box["generated"] - box["rows"]) / max(box["rounds"], 1),
                         "speedup": median_ratio(times["plain"], times[name]),
                         "speedup_cpu": median_ratio(cpu["plain"], cpu[name]), "identical": box["tokens"] == plain}
    return out


def objectives_table(res: dict) -> str:
    """The markdown table of docs/ablation.md's drafters section: one row per objective on the frozen trunk."""
    d = res["depth"]
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)
    head = (f"| modules | sampled α by depth (eval) | forced α mtp γ={d} | forced α mtp1 γ={CHAIN} | "
            f"tok/round mtp γ={d} | tok/round mtp1 γ=1..4 | speedup b1 mtp / best mtp1 (CPU) | = plain |")
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    for k, c in res["chains"].items():
        acc = res["acceptance"][k]
        m1 = [c[f"mtp1x{g}"] for g in range(1, CHAIN + 1)]
        best = max(m1, key=lambda r: r["speedup"])
        same = all(r["identical"] for r in [c[f"mtp{d}"], *m1])
        rows.append(f"| {k} ({acc['steps']} steps) | {fmt(acc['accept_prob'])} | {fmt(c['forced_mtp'])} | "
                    f"{fmt(c['forced_mtp1'])} | {c[f'mtp{d}']['tokens_per_round']:.2f} | "
                    f"{fmt([r['tokens_per_round'] for r in m1])} | {c[f'mtp{d}']['speedup']:.2f}x / "
                    f"{best['speedup']:.2f}x ({c[f'mtp{d}']['speedup_cpu']:.2f}x / {best['speedup_cpu']:.2f}x) | "
                    f"{'yes' if same else 'NO'} |")
    return "\n".join(rows)


def objectives(base, args) -> dict:
    """--objectives: the trunk, a post-training per OBJECTIVES, then chains() on each; the results dict."""
    work = Path(args.work)
    res = {"config": base.to_dict()["model"], "depth": base.model.mtp_depth, "load_start": load(),
           "post_overrides": OBJECTIVES}
    saved = work / "acceptance.json"
    if args.reuse and saved.is_file():
        res["acceptance"] = json.loads(saved.read_text())
    else:
        res["acceptance"] = train_drafters(base, work, args.trunk_steps, args.post_steps, extra=OBJECTIVES)
        saved.write_text(json.dumps(res["acceptance"]))
    cfg, drafters, val, eos = subjects(work, False, tuple(OBJECTIVES))
    from mtpjax.eval.evaluate import heldout_prompts

    seqs = heldout_prompts(val, args.forced_seqs, 2 * args.prompt_len, eos)
    prompts = heldout_prompts(val, args.decode_prompts, args.prompt_len, eos)
    res["chains"] = chains(drafters, seqs, prompts, args.prompt_len, base.model.mtp_depth, args.max_new, args.rounds)
    res["load_end"] = load()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/drafters", help="run directories of the trunk and the post-trainings")
    ap.add_argument("--trunk-steps", type=int, default=300)
    ap.add_argument("--post-steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the step-cost comparison")
    ap.add_argument("--draft-steps", type=int, default=400, help="train steps of the draft model (0: none)")
    ap.add_argument("--reuse", action="store_true", help="reuse the runs (and metrics) of an earlier invocation")
    ap.add_argument("--forced-seqs", type=int, default=16, help="held-out sequences of the teacher-forced measure")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--json", type=json_path)
    ap.add_argument("--objectives", action="store_true", help="issue 24's comparison of post-training objectives")
    ap.add_argument("--decode-prompts", type=int, default=4, help="--objectives: batch-1 prompts decoded per round")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base = load_config("configs/tiny.yaml", [*BASE, *args.overrides])
    if args.objectives:
        res = objectives(base, args)
        res["command"] = "python bench/drafters.py " + " ".join(sys.argv[1:] if argv is None else argv)
        print(objectives_table(res))
        if args.json:
            write_json(args.json, res)
        return 0
    work = Path(args.work)
    res = {"config": base.to_dict()["model"], "load_start": load()}
    saved = work / "acceptance.json"
    if args.reuse and saved.is_file():  # the trained runs of an earlier invocation, and their eval metrics
        res["acceptance"] = json.loads(saved.read_text())
    else:
        res["acceptance"] = train_drafters(base, work, args.trunk_steps, args.post_steps)
        saved.write_text(json.dumps(res["acceptance"]))
    if args.draft_steps and not (args.reuse and (work / "draft" / "checkpoints").is_dir()):
        train_draft_model(base, work, args.draft_steps)
    res["step_cost"] = step_cost(base, args.rounds)
    log(f"step cost: {res['step_cost']}")
    cfg, drafters, val, eos = subjects(work, (work / "draft" / "checkpoints").is_dir())
    from mtpjax.eval.evaluate import heldout_prompts

    gamma = base.model.mtp_depth
    seqs = heldout_prompts(val, args.forced_seqs, 2 * args.prompt_len, eos)
    res["forced"] = forced_by_position(drafters, seqs, args.prompt_len, gamma)
    log(f"teacher-forced acceptance by position: {res['forced']}")
    prompts = heldout_prompts(val, max(args.batches), args.prompt_len, eos)
    res["decode"] = decode_speed(cfg, drafters, prompts, gamma, args.batches, args.max_new, args.rounds)
    res["load_end"] = load()
    print(table(res))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
