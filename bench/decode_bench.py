"""Decoding side by side in one process: plain greedy, MTP chains and trees, hybrid MTP + n-gram trees, n-gram and
draft-model speculation, the PyTorch peer.

For each batch size every variant runs once per round, rounds interleaved; ratios are medians of
per-round ratios. Round costs (relative to a plain round at the same batch size) feed the predicted
speedup E(γ)/(v + γc) of mtpjax.nn.speed and its choice of γ ("cost_model"); the "auto" row is the variant
the decoder's own `generate(draft="auto")` picks after timing its probes. The draft model is a
second trained run with the same tokenizer (`--draft-run-dir`, configs/draft_tiny.yaml). Beside every
speculative row: v, the verification of its rows measured apart at that batch size (bench/cache_cliff.py's
loops, interleaved), c, the rest of its round per drafting call, and its ceiling, the tokens per round it got
over v plus its drafting's floor (the smaller of the FLOPs and weight shares of a plain step).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import peer as peer_mod  # noqa: E402
from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402
from mtpjax.decode import MTPProposer, make_loop, run, summarize  # noqa: E402
from mtpjax.decode.ngram import NgramProposer  # noqa: E402
from mtpjax.decode.proposers import make_proposer  # noqa: E402
from mtpjax.decode.tree import acceptance_by_depth_rank  # noqa: E402
from mtpjax.eval.evaluate import decode_context  # noqa: E402
from mtpjax.eval.plan import tree_bytes  # noqa: E402
from mtpjax.drafts import chain  # noqa: E402
from mtpjax.nn.speed import (  # noqa: E402
    by_position,
    choose_fastest,
    expected_tokens,
    floor_ratio,
    speedup_ceiling,
    weight_ratio,
    work_ratio,
)

DRAFT_GAMMAS = (1, 2, 3)  # draft-model variants: its drafts cost a fraction of an MTP module's
CHAIN_GAMMAS = (1, 2, 3)  # MTP chains; past the model's depth module 1 drafts every token (proposer mtp1)
# variant name -> decode.draft: MTP trees, one each as deep as the chains of 1 and 2 drafts, and a wider one
TREES = {"2": "-1,-1", "2x1": "2x1", "2x2": "2x2"}
HYBRIDS = {h: h for h in ("1x1+ngram2", "2x1+ngram2")}  # a chain or a tree of the modules with n-gram lookup beside


def load_subject(run_dir: str | None, smoke: bool, n_prompts: int, prompt_len: int):
    """(model, prompts, source): a trained run's model and held-out prompts, or a random tiny model in smoke mode."""
    if run_dir and Path(run_dir, "checkpoints").exists():
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
        from mtpjax.train.checkpoint import load_model
        from mtpjax.data import prepare
        from mtpjax.eval.evaluate import heldout_prompts

        cfg, model, tok = load_model(run_dir)
        prompts = heldout_prompts(prepare(cfg.data).val_tokens, n_prompts, prompt_len, tok.eos_id)
        return model, prompts, f"trained checkpoint {run_dir}"
    if not smoke:
        raise SystemExit(f"error: no checkpoint in {run_dir!r}; train one with `python train.py --config "
                         "configs/tiny.yaml train.run_dir=runs/tiny` or pass --smoke")
    from mtpjax.config import ModelConfig
    from mtpjax.nn.model import build_model

    model = build_model(ModelConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, mtp_depth=2), seed=0)
    rng = np.random.default_rng(0)
    return model, rng.integers(0, 256, (n_prompts, prompt_len)).tolist(), "random smoke model"


def load_draft(draft_run_dir: str | None, smoke: bool, model):
    """(draft model or None, what it is): a trained draft run, a random small model in smoke mode, or a reason."""
    if draft_run_dir and Path(draft_run_dir, "checkpoints").exists():
        from mtpjax.train.checkpoint import load_model

        cfg, draft, _ = load_model(draft_run_dir)
        if cfg.model.vocab_size != model.cfg.vocab_size:
            raise SystemExit(f"error: the draft run {draft_run_dir!r} has another vocabulary than the target")
        return draft, f"trained checkpoint {draft_run_dir}"
    if smoke:
        from mtpjax.config import ModelConfig
        from mtpjax.nn.model import build_model

        cfg = ModelConfig(vocab_size=model.cfg.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mtp_depth=0)
        return build_model(cfg, seed=1), "random smoke draft model"
    return None, (f"no checkpoint in {draft_run_dir!r}; train one with `python train.py --config "
                  "configs/draft_tiny.yaml`")


def _ours(model, groups, draft, proposer: str, max_new: int, draft_model=None, variant=None):
    """A closure generating every group once, drafting `draft` (a chain's γ or any decode.draft spelling); it records
    the last stats (tokens, rounds, loops, acceptance; box["tree"]: a wider tree's acceptance by depth and rank).

    `variant`: a proposer object that replaces the named one (the same tree), for variants of a proposer."""
    loops = [make_loop(model, g, max_new_tokens=max_new, draft=draft, proposer=proposer, draft_model=draft_model)
             for g in groups]
    loops = [lp if variant is None else replace(lp, proposer=variant) for lp in loops]
    tree = loops[0].tree
    G = tree.max_depth
    box = {"loop": loops[0]}

    def call():
        toks, rounds, loops_, acc, reach, gen, rows = [], 0, 0, np.zeros(G), np.zeros(G), 0, 0
        nodes = np.zeros(tree.size)
        for g, loop in zip(groups, loops):
            st = run(model, g, loop, draft_model=draft_model)
            jax.block_until_ready(st.n_B)
            res = summarize(st, loop.tree)
            toks += res.tokens
            rounds += res.stats["rounds"]
            loops_ += int(np.asarray(st.rounds_B).max())
            if G:
                acc += res.stats["accepted"]
                reach += res.stats["reached"]
                nodes += res.stats["accepted_by_node"]
            gen += res.stats["generated"]
            rows += len(g)
        box.update(tokens=toks, rounds=rounds, loops=loops_, accepted=acc, reached=reach, generated=gen, rows=rows)
        if not tree.is_chain():
            box["tree"] = acceptance_by_depth_rank(tree, nodes.tolist(), reach.tolist())

    call()  # compile (one bucket per batch size) and warm up
    return call, box


def _peer(peer, groups, max_new: int, lookup: int):
    box = {}

    def call():
        box["tokens"] = [t for g in groups for t in peer_mod.peer_generate(peer, g, max_new, lookup)]

    call()
    return call, box


def bench_batch(model, prompts, batch: int, max_new: int, rounds: int, peer=None, draft=None,
                trees: bool = True) -> dict:
    """Every decoder at one batch size, interleaved; tokens/s, ratios, acceptance, costs, prediction, auto choice;
    `trees`: the MTP chains past the model's depth, trees and hybrids too, each with v, c and its ceiling."""
    D = model.cfg.mtp_depth
    n = max(1, len(prompts) // batch) if batch == 1 else 1
    groups = [prompts[i * batch:(i + 1) * batch] for i in range(n)]
    gens = {"plain": _ours(model, groups, 0, "mtp", max_new)}
    for g in range(1, D + 1):
        gens[f"mtp{g}"] = _ours(model, groups, g, "mtp", max_new)
    if D and trees:
        for g in CHAIN_GAMMAS:
            if g > D:
                gens[f"mtp1_{g}"] = _ours(model, groups, g, "mtp1", max_new)
        for name, spec in {**TREES, **HYBRIDS}.items():
            gens[f"tree{name}"] = _ours(model, groups, spec, "mtp", max_new)
    gd = max(D, 2)
    gens[f"ngram{gd}"] = _ours(model, groups, gd, "ngram", max_new)
    if draft is not None:
        for g in DRAFT_GAMMAS:
            gens[f"model{g}"] = _ours(model, groups, g, "model", max_new, draft)
    if peer is not None:
        gens["peer_greedy"] = _peer(peer, groups, max_new, 0)
        if batch == 1:  # transformers' assisted generation takes one sequence at a time
            gens[f"peer_lookup{gd}"] = _peer(peer, groups, max_new, gd)
    cpu: dict = {}
    times = interleave({k: v[0] for k, v in gens.items()}, rounds, seed=batch, cpu=cpu)
    total = batch * n * max_new
    plain = gens["plain"][1]
    out = {"batch": batch, "max_new": max_new, "runs_per_call": n, "load": load(), "variants": {}}
    for k, (_, box) in gens.items():
        r = {"tokens_per_sec": float(np.median(total / np.asarray(times[k]))),
             "vs_plain": median_ratio(times["plain"], times[k]),
             "vs_plain_cpu": median_ratio(cpu["plain"], cpu[k]),  # CPU time: what a loaded host does not inflate
             "identical_to_plain": box["tokens"] == plain["tokens"]}
        if "loops" in box:
            r["round_cost"] = float(np.median(times[k]) / box["loops"] / (np.median(times["plain"]) / plain["loops"]))
            r["tokens_per_round"] = (box["generated"] - box["rows"]) / max(box["rounds"], 1)
            if box["reached"].size:
                r["acceptance_by_position"] = (box["accepted"] / np.maximum(box["reached"], 1)).tolist()
                r["alpha"] = float(box["accepted"].sum() / max(box["reached"].sum(), 1))
            if "tree" in box:
                r["acceptance_by_depth_rank"] = box["tree"]
        out["variants"][k] = r
    for prefix in ("mtp", "model"):
        _predict(out["variants"], gd, prefix)
    context = decode_context(prompts, max_new)
    if trees:
        out["verify"] = _verify(model, gens, batch, context, rounds, out["variants"], draft)
    if D:
        out["ceiling"] = _ceiling(out["variants"], "mtp", D, lambda g: make_proposer("mtp", chain(g)), model.cfg,
                                  context)
        _auto(model, groups, max_new, out["variants"])
    if draft is not None:
        out["draft_ceiling"] = _ceiling(out["variants"], "model", max(DRAFT_GAMMAS),
                                        lambda g: make_proposer("model", chain(g)), model.cfg, context, draft.cfg)
    for c in (out.get("ceiling"), out.get("draft_ceiling")):
        if c:
            c["context"] = context
    return out


def _verify(model, gens: dict, batch: int, context: int, rounds: int, v: dict, draft=None) -> dict:
    """v(n) measured apart (cache_cliff's loops of n-row forwards, interleaved) for n up to the most rows a variant
    verifies; each speculative variant gets v = v(its rows), c = (round cost - v) per drafting call (the drafting
    and the round's bookkeeping), its ceiling = tokens per round / (v + drafting's floor) and its share of it."""
    from bench.cache_cliff import measure_rows

    loops = {k: box["loop"] for k, (_, box) in gens.items() if "loop" in box and k != "plain"}
    most = max(lp.tree.size + 1 for lp in loops.values())
    most = max(most, 8) if model.cfg.n_layers > 2 else most  # v(1..8) as issue 30 asks; a smoke model: what it uses
    meas = measure_rows(model, list(range(1, most + 1)), [1] if model.cfg.mtp_depth else [], batch, context,
                        rounds=max(rounds, 3))
    for k, lp in loops.items():
        r, prop = v[k], lp.proposer
        rows = prop.tree.size + 1
        calls = (0 if isinstance(prop, NgramProposer)  # lookup: no model call
                 else prop.tree.max_depth if isinstance(prop, MTPProposer)  # a level's nodes in one call; the
                 else prop.tree.size)  # hybrid's n-gram branch adds none
        floor = floor_ratio(prop, model.cfg, context, draft.cfg if draft is not None and k.startswith("model")
                            else None) * prop.tree.size
        r["rows"], r["verify_cost_v"] = rows, meas["v"][rows]
        r["draft_cost_c"] = (r["round_cost"] - r["verify_cost_v"]) / calls if calls else None
        r["draft_floor"] = floor
        r["ceiling"] = r["tokens_per_round"] / (r["verify_cost_v"] + floor)
        r["of_ceiling"] = r["vs_plain"] / r["ceiling"]
    return {"v": meas["v"], "c_chain": meas["c"], "v_cpu": meas["cpu"]["v"], "step_us": meas["step_us"],
            "load": meas["load"], "context": context}


def _predict(v: dict, gd: int, prefix: str) -> None:
    """The predicted speedup E(γ)/(v + γc) of each `prefix` variant from its measured α and round cost (v: the
    n-gram round at γ = gd, c: the rest per draft); the cost model's choice of γ among them."""
    vv = v[f"ngram{gd}"]["round_cost"]
    costs = {}
    for k, r in v.items():
        if k.startswith(prefix) and k[len(prefix):].isdigit():
            g = int(k[len(prefix):])
            r["expected_tokens_per_round"] = expected_tokens(chain(g), by_position(r["acceptance_by_position"]))
            r["predicted_speedup"] = r["expected_tokens_per_round"] / r["round_cost"]
            if g == gd:
                r["verify_cost_v"], r["draft_cost_c"] = vv, (r["round_cost"] - vv) / g
            r["measured_over_predicted"] = r["vs_plain"] / r["predicted_speedup"]
            costs[g] = r["round_cost"]
    if costs:
        alpha = v[f"{prefix}{max(costs)}"]["acceptance_by_position"]
        trees = {chain(g): c for g, c in {0: 1.0, **costs}.items()}
        pick = choose_fastest({t: expected_tokens(t, by_position(alpha)) for t in trees}, trees)
        v[f"cost_model_{prefix}" if prefix != "mtp" else "cost_model"] = {"num_draft": pick.size, "round_cost": costs}


def _ceiling(v: dict, prefix: str, top: int, proposer, cfg, context: int, draft_cfg=None) -> dict:
    """The most any round of this proposer could gain with its measured α: E(γ)/(1 + γr), r(γ) its floor ratio
    (the smaller of the FLOPs it computes and the weights it reads, per draft, over a plain step's)."""
    alpha = v[f"{prefix}{top}"]["acceptance_by_position"]
    gammas = range(1, top + 1)
    work = {g: work_ratio(proposer(g), cfg, context, draft_cfg) for g in gammas}
    reads = {g: weight_ratio(proposer(g), cfg, context, draft_cfg) for g in gammas}
    ratio = lambda g: floor_ratio(proposer(g), cfg, context, draft_cfg)  # noqa: E731
    c = speedup_ceiling(alpha, ratio, top)
    return {"ceiling_r": ratio(c["gamma"] or top), "work_ratio_by_gamma": work, "weight_ratio_by_gamma": reads,
            "alpha_by_position": alpha, "by_gamma": c["by_gamma"], "max": c["max"], "num_draft": c["gamma"],
            "perfect_drafter": speedup_ceiling([1.0], ratio, top)["by_gamma"][top]}


def _auto(model, groups, max_new: int, v: dict) -> None:
    """The decoder's own choice (generate(draft="auto") times its probes) and how the chosen variant did here."""
    from mtpjax.decode import generate

    stats = generate(model, groups[0], max_new_tokens=max_new, draft="auto").stats
    g, shape = stats["drafts"], None if "acceptance_by_depth_rank" not in stats else stats["draft"]
    v["auto"] = {"num_draft": g, "tree": shape, "calibration": stats["calibration"]}
    if shape is None:
        v["auto"].update({k: v["plain" if g == 0 else f"mtp{g}"][k] for k in ("tokens_per_sec", "vs_plain")})
        return
    # a tree won: no variant above decodes it, so it is timed against plain here, interleaved as they were
    fns = {k: (lambda t=t: [generate(model, grp, max_new_tokens=max_new, draft=t) for grp in groups])
           for k, t in (("plain", 0), ("auto", shape))}
    for fn in fns.values():
        fn()  # compiled already (the probe's loops); warm
    times = interleave(fns, 3)
    total = sum(map(len, groups)) * max_new
    v["auto"].update(tokens_per_sec=float(np.median(total / np.asarray(times["auto"]))),
                     vs_plain=median_ratio(times["plain"], times["auto"]))


def markdown_table(res: dict) -> str:
    """The speculative variants of one decode_bench result as docs/benchmarks.md tabulates them: per batch size,
    tokens per round, v, c, the speedup over plain and its ceiling with the share of it reached."""
    batches = [b for b in res["batches"] if "verify" in b]
    names = [k for k in batches[0]["variants"] if "ceiling" in batches[0]["variants"][k]]
    bs = " / ".join(str(b["batch"]) for b in batches)
    lines = [f"| variant | rows | tokens per round (b {bs}) | v (b {bs}) | c (b {bs}) | "
             + " | ".join(f"speedup b{b['batch']} (CPU), ceiling, share" for b in batches) + " | identical |",
             "|---|---|---|---|---|" + "---|" * len(batches) + "---|"]

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    for k in names:
        rows = [b["variants"][k] for b in batches]
        cells = [f"{r['vs_plain']:.2f}× ({r['vs_plain_cpu']:.2f}×), {r['ceiling']:.2f}×, {r['of_ceiling']:.0%}"
                 for r in rows]
        lines.append(f"| {k} | {rows[0]['rows']} | " + " / ".join(f(r["tokens_per_round"]) for r in rows) + " | "
                     + " / ".join(f(r["verify_cost_v"]) for r in rows) + " | "
                     + " / ".join(f(r["draft_cost_c"]) for r in rows) + " | " + " | ".join(cells) + " | "
                     + ("yes" if all(r["identical_to_plain"] for r in rows) else "**no**") + " |")
    auto = [b["variants"].get("auto", {}) for b in batches]
    lines.append("| auto (its choice) | | | | | " + " | ".join(
        f"{a.get('vs_plain', 0):.2f}× ({a.get('tree') or a.get('num_draft')})" for a in auto) + " | |")
    loads = ", ".join(f"b{b['batch']}: {b['load'][0]:.1f}" for b in batches)
    return "\n".join(lines) + f"\n\nLoad average (1 min) at the end of each batch: {loads}."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--draft-run-dir", default="runs/draft_tiny",
                    help="a run with the same tokenizer whose model drafts "
                         "(python train.py --config configs/draft_tiny.yaml)")
    ap.add_argument("--smoke", action="store_true", help="random tiny model, short generations")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded one by one at batch 1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-trees", action="store_true",
                    help="only the chains up to the model's depth: no trees, hybrids or v(n) measured apart")
    ap.add_argument("--json", type=json_path, help="write the results here")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of an earlier --json result and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    model, prompts, source = load_subject(args.run_dir, args.smoke, max(batches + [args.prompts]), args.prompt_len)
    res = {"source": source, "weights_mb": tree_bytes(nnx.state(model, nnx.Param)) / 1e6, "batches": [], "peer": None}
    draft, what = load_draft(args.draft_run_dir, args.smoke, model)
    if draft is None:
        print(f"draft model skipped: {what}")
        res["draft_skipped"] = what
    else:
        res["draft"] = {"source": what, "weights_mb": tree_bytes(nnx.state(draft, nnx.Param)) / 1e6}
    skip = "--no-peer given" if args.no_peer else peer_mod.available()
    peer = None
    if skip:
        print(f"peer skipped: {skip}")
        res["peer_skipped"] = skip
    else:
        peer = peer_mod.build_peer(model)
        import torch
        import transformers

        res["peer"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                       "threads": torch.get_num_threads(),
                       "max_logit_diff": peer_mod.max_logit_diff(model, peer, prompts[0])}
        print(f"peer: transformers {transformers.__version__} / torch {torch.__version__}, "
              f"max |logit diff| vs ours {res['peer']['max_logit_diff']:.2e}")
    for b in batches:
        group = prompts[:max(b, args.prompts if b == 1 else b)]
        r = bench_batch(model, group, b, args.max_new, args.rounds, peer, draft, trees=not args.no_trees)
        res["batches"].append(r)
        for k, v in r["variants"].items():
            if "tokens_per_sec" not in v:
                continue
            extra = "".join(f"  {f} {v[f]:.2f}" for f in ("tokens_per_round", "round_cost", "predicted_speedup")
                            if f in v)
            if k == "auto":
                chose = f"tree {v['tree']}" if v["tree"] else f"{v['num_draft']} drafts"
                extra = f"  {chose}; probe costs " + ", ".join(
                    f"{g}: {c:.2f}" for g, c in v["calibration"]["round_cost"].items())
            cpu = f" (CPU time x{v['vs_plain_cpu']:.2f})" if "vs_plain_cpu" in v else ""
            print(f"  batch {b:3d} {k:14s} {v['tokens_per_sec']:9.1f} tok/s  x{v['vs_plain']:.2f}{cpu} vs plain{extra}")
        for key, name in (("ceiling", "MTP"), ("draft_ceiling", "draft model")):
            if key in r:
                c = r[key]
                rs = ", ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(c["work_ratio_by_gamma"].values(),
                                                                 c["weight_ratio_by_gamma"].values()))
                print(f"  batch {b:3d} {name} ceiling x{c['max']:.2f} at {c['num_draft']} drafts (E/(1+γr), r = FLOPs/"
                      f"weights per γ: {rs}, "
                      f"α {[round(a, 3) for a in c['alpha_by_position']]}; α = 1: x{c['perfect_drafter']:.2f})")
        if "verify" in r:
            m = r["verify"]
            print(f"  batch {b:3d} v(n) measured apart (one-row step {m['step_us']:.0f} us, context {m['context']}): "
                  + "  ".join(f"{n}: {x:.2f}" for n, x in m["v"].items()))
            for k, v in r["variants"].items():
                if "ceiling" in v:
                    c = "-" if v["draft_cost_c"] is None else f"{v['draft_cost_c']:.3f}"
                    print(f"  batch {b:3d} {k:14s} rows {v['rows']}  v {v['verify_cost_v']:.2f}  c {c}  "
                          f"tokens/round {v['tokens_per_round']:.2f}  ceiling x{v['ceiling']:.2f}  "
                          f"reached x{v['vs_plain']:.2f} = {v['of_ceiling']:.0%} of it")
        log(f"  batch {b} done")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
