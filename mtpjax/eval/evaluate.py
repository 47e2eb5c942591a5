"""Checkpoint evaluation: measured vs predicted speculative speedup (validation metrics: mtpjax.eval.validation).

Costs come from whole-loop timings in one process, never from isolated dispatches: t = seconds per
round of plain decoding; a proposer's round cost = its seconds per round over t = v + γc, where v = the
n-gram round's cost (drafting is nearly free, so a round is one verification of γ+1 tokens) and c the
rest per draft. The predicted speedup is mtpjax.nn.speed's E(γ)/(v + γc) from the measured α by position; a draft
tree's (`wider`) is its E from acceptance by depth and rank over its measured round cost.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax.decode.firstguess import decode_context  # noqa: F401 (also this module's name for it)
from mtpjax.decode.host import execute_request, make_loop, request, run, summarize
from mtpjax.decode.cache import read_rows
from mtpjax.decode.loop import DecodeState, Loop
from mtpjax.decode.proposers import make_proposer
from mtpjax.decode.tree import acceptance_by_depth_rank
from mtpjax.drafts import PLAIN, Tree, chain
from mtpjax.nn.speed import by_position, ceiling, expected_tokens, floor_ratio, weight_ratio, work_ratio


def heldout_prompts(val_tokens, n: int, length: int, eos_id: int) -> list[list[int]]:
    """n prompts of `length` tokens from evenly spaced offsets of the validation stream (no EOS inside)."""
    toks = np.asarray(val_tokens)
    out, starts = [], np.linspace(0, max(0, len(toks) - 4 * length), num=4 * n, dtype=np.int64)
    for s in starts:
        p = toks[s: s + length].tolist()
        if len(p) == length and eos_id not in p:
            out.append(p)
        if len(out) == n:
            break
    return out


def timed_decode(model, prompts, *, draft: Tree | str | int, proposer: str, max_new: int, batch: int = 1,
                 repeats: int = 1, draft_model=None) -> dict:
    """Greedy-decode prompts in groups of `batch` drafting `draft` after a compile warmup; seconds, tokens, rounds,
    acceptance (by depth, and by node)."""
    groups = [prompts[i: i + batch] for i in range(0, len(prompts) - batch + 1, batch)]

    def loop_of(group):
        # all prompts are padded to one bucket, so a single compilation serves every group
        return make_loop(model, group, max_new_tokens=max_new, draft=draft, proposer=proposer,
                         draft_model=draft_model)

    jax.block_until_ready(run(model, groups[0], loop_of(groups[0]), draft_model=draft_model).n_B)  # compile
    secs, tokens, rounds, loops = 0.0, 0, 0, 0
    acc, reach, nodes, outs = 0, 0, 0, []
    for group in groups:
        loop = loop_of(group)
        for _ in range(repeats):
            t0 = time.perf_counter()
            st = run(model, group, loop, draft_model=draft_model)
            jax.block_until_ready(st.n_B)
            secs += time.perf_counter() - t0
        res = summarize(st, loop.tree)
        tokens += res.stats["generated"] * repeats
        rounds += res.stats["rounds"] * repeats  # summed over rows
        loops += int(np.asarray(st.rounds_B).max()) * repeats  # a batch loops until its slowest row is done
        acc = acc + np.asarray(res.stats["accepted"], float) * repeats
        reach = reach + np.asarray(res.stats["reached"], float) * repeats
        nodes = nodes + np.asarray(res.stats["accepted_by_node"], float) * repeats
        outs.extend(res.tokens)
    return {"seconds": secs, "tokens": tokens, "runs": sum(len(g) for g in groups) * repeats, "rounds": rounds,
            "accepted": acc, "reached": reach, "accepted_by_node": nodes, "tokens_per_sec": tokens / secs,
            "sec_per_round": secs / max(loops, 1), "outputs": outs, "tree": loop.tree}


def agreement_on(model, prompts, outputs, depth: int) -> list[float]:
    """Teacher-forced agreement per depth over the generated part of prompt+output sequences.

    Greedy decoding is the main head's argmax chain, so on its own output this is the acceptance the
    drafts should show; a gap between the two means the decoder's draft state is wrong.
    """
    seqs = [p + o for p, o in zip(prompts, outputs)]
    T = min(len(s) for s in seqs)
    toks_BT = jnp.asarray([s[:T] for s in seqs], jnp.int32)
    am_MBT = np.asarray(argmax_by_depth(model, toks_BT))
    P = max(len(p) for p in prompts)
    # position i's depth-k draft predicts x[i+k+1]; the main head at i+k predicts the same token
    return [float((am_MBT[k, :, P - 1: T - k - 1] == am_MBT[0, :, P - 1 + k: T - 1]).mean())
            for k in range(1, depth + 1)]


def agreement_at_round_starts(model, prompts, outputs, gamma: int) -> list[float]:
    """Teacher-forced agreement per depth at the positions where greedy chains of `gamma` drafts start their rounds
    on their own output: the decoder's acceptance by position exactly, when its drafts see training's state.

    The rounds are replayed from one full forward's argmaxes: a round drafting from position i accepts the leading
    depths k whose prediction at i is the main head's at i + k, then commits them and the target's token. Which
    positions start a round depends on the weights, so the agreement over all positions (agreement_on) only
    approximates the acceptance; the replay equals it."""
    L = max(map(len, prompts)) + max(map(len, outputs)) + gamma
    forward = lambda seqs: np.asarray(argmax_by_depth(model, jnp.asarray([s + [0] * (L - len(s)) for s in seqs],
                                                                         jnp.int32)))  # one shape: one compile
    seqs = [p + o for p, o in zip(prompts, outputs)]
    for _ in range(gamma):  # past each output's end, as far as the last round's drafts reach: the greedy continuation
        am_MBT = forward(seqs)
        seqs = [s + [int(am_MBT[0, b, len(s) - 1])] for b, s in enumerate(seqs)]
    am_MBT = forward(seqs)
    accepted, reached = np.zeros(gamma), np.zeros(gamma)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        i, made = len(p) - 1, 1  # the prefill commits one token; the first drafts come from the prompt's end
        while made < len(o):
            a = 0
            while a < gamma and am_MBT[a + 1, b, i] == am_MBT[0, b, i + a + 1]:
                a += 1
            reached[: a + 1] += 1
            accepted[:a] += 1
            i, made = i + a + 1, made + a + 1
    return [float(x / r) if r else 0.0 for x, r in zip(accepted, reached)]


@nnx.jit
def argmax_by_depth(model, toks_BT):
    """int[M, B, T]: each depth's greedy prediction at every position (one jitted full forward)."""
    return jnp.argmax(model.logits(model(toks_BT).hidden), axis=-1)


@dataclass(frozen=True)
class Forced:
    """Teacher forcing as the loop's commit policy: commit the request's reference (its policy arrays, at absolute
    positions) one token a round; the drafts are still verified against the target, so acceptance is measured along
    the reference through the decoder's own caches."""

    def __call__(self, ref_BS, toks_BY, c_B, n_B):
        return read_rows(ref_BS, n_B, toks_BY.shape[1]), jnp.minimum(c_B, 1)


def run_forced(model, prompts, loop: Loop, reference, draft_model=None) -> DecodeState:
    """`loop` teacher-forced: row i commits reference[i] (at least loop.max_new tokens) after its prompt."""
    if len(reference) != len(prompts):
        raise ValueError("forced decoding needs one reference continuation per prompt")
    ref_BS = np.zeros((len(prompts), loop.capacity), np.int32)
    for i, (p, r) in enumerate(zip(prompts, reference)):
        if len(r) < loop.max_new:
            raise ValueError(f"reference {i} has {len(r)} tokens, fewer than the {loop.max_new} to decode")
        ref_BS[i, len(p): len(p) + loop.max_new] = r[: loop.max_new]
    forced = dataclasses.replace(loop, commits=Forced())
    return execute_request(forced, model, request(forced, prompts).replace(policy=jnp.asarray(ref_BS)),
                            draft_model)


def forced_acceptance(model, sequences, prompt_len: int, gamma: int, proposer: str = "mtp",
                      draft_model=None) -> list[float]:
    """Acceptance by draft position while decoding walks the reference continuation of each sequence
    (teacher forcing, one token per round). Depth 1 measures what agreement/mtp_1 measures in training,
    on the same kind of text, through the decoder's caches; any proposer (a draft model: `draft_model`)."""
    prompts = [s[:prompt_len] for s in sequences]
    refs = [s[prompt_len:] for s in sequences]
    n = min(len(r) for r in refs)
    loop = make_loop(model, prompts, max_new_tokens=n, draft=gamma, proposer=proposer, draft_model=draft_model)
    return summarize(run_forced(model, prompts, loop, refs, draft_model), loop.tree).stats["acceptance_by_position"]


def speed_report(model, prompts, *, gamma: int, max_new: int, batch: int = 1, repeats: int = 1,
                 draft_model=None, wider: Tree | None = None) -> dict:
    """Plain vs n-gram vs MTP chains of `gamma` (vs a draft model, vs a `wider` draft tree) greedy decoding:
    throughput, acceptance, costs, predictions."""
    kw = dict(max_new=max_new, batch=batch, repeats=repeats)
    plain = timed_decode(model, prompts, draft=PLAIN, proposer="mtp", **kw)
    ngram = timed_decode(model, prompts, draft=gamma, proposer="ngram", **kw)
    rep = {"batch": batch, "gamma": gamma, "plain_tokens_per_sec": plain["tokens_per_sec"],
           "ngram_tokens_per_sec": ngram["tokens_per_sec"],
           "ngram_speedup": ngram["tokens_per_sec"] / plain["tokens_per_sec"],
           "ngram_tokens_per_round": _per_round(ngram)}
    v = ngram["sec_per_round"] / plain["sec_per_round"]
    rep["verify_cost_v"] = v
    exact = ngram["outputs"] == plain["outputs"]
    context = decode_context(prompts, max_new)
    proposers = [("", "mtp", None)] if model.cfg.mtp_depth else []
    if draft_model is not None:
        proposers.append(("model_", "model", draft_model))
    for prefix, name, dm in proposers:
        r, row = _chain_row(model, prompts, gamma, name, dm, plain, v, context, kw)
        exact &= r["outputs"] == plain["outputs"]
        rep[f"{name}_tokens_per_sec"] = r["tokens_per_sec"]
        rep.update({f"{prefix}{k}": x for k, x in row.items()})
    if wider is not None:
        exact &= _tree_report(rep, model, prompts, wider, plain, context, kw)
    if model.cfg.mtp_depth:
        # greedy: the speculative outputs are the plain ones (outputs_identical)
        depth = min(gamma, model.cfg.mtp_depth)
        rep["agreement_on_generated"] = agreement_on(model, prompts, plain["outputs"], depth)
        if gamma <= model.cfg.mtp_depth:
            rep["agreement_at_round_starts"] = agreement_at_round_starts(model, prompts, plain["outputs"], gamma)
    rep["outputs_identical"] = bool(exact)
    return rep


def _chain_row(model, prompts, gamma: int, name: str, dm, plain: dict, v: float, context: int, kw: dict):
    """(the timed decode of proposer `name` drafting chains of `gamma`, its speed report's entries against `plain`
    and the n-gram round's verify cost `v`)."""
    proposer = make_proposer(name, chain(gamma))
    r = timed_decode(model, prompts, draft=gamma, proposer=name, draft_model=dm, **kw)
    alpha_pos = (r["accepted"] / np.maximum(r["reached"], 1)).tolist()
    cost, dcfg = r["sec_per_round"] / plain["sec_per_round"], None if dm is None else dm.cfg
    floor = floor_ratio(proposer, model.cfg, context, dcfg)
    e = expected_tokens(chain(gamma), by_position(alpha_pos))
    return r, {
        "speedup": r["tokens_per_sec"] / plain["tokens_per_sec"],
        "acceptance_by_position": alpha_pos, "alpha": float(r["accepted"].sum() / max(r["reached"].sum(), 1)),
        "tokens_per_round": _per_round(r), "expected_tokens_per_round": e,
        "round_cost": cost, "draft_cost_c": max(0.0, (cost - v) / gamma), "predicted_speedup": e / cost,
        "draft_time_fraction": max(0.0, cost - v) / cost,
        "work_ratio_r": work_ratio(proposer, model.cfg, context, dcfg),
        "weight_ratio_r": weight_ratio(proposer, model.cfg, context, dcfg),
        # a bound: verifying the γ+1 rows costs at least one plain step, a draft at least its floor r
        "speedup_ceiling": ceiling(chain(gamma), by_position(alpha_pos), floor),
        # an estimate, not a bound: verification at the v measured on the n-gram round (drafting a lookup), whose
        # own bookkeeping a measured speedup can beat
        "floor_draft_speedup": ceiling(chain(gamma), by_position(alpha_pos), floor, max(1.0, v)),
    }


def _per_round(r: dict) -> float:
    # each row's first token comes from the prefill, not from a round
    return (r["tokens"] - r["runs"]) / max(r["rounds"], 1)


def _tree_report(rep: dict, model, prompts, wider: Tree, plain: dict, context: int, kw: dict) -> bool:
    """The `tree_*` keys: the tree's speed, acceptance by depth (a list by rank per depth), expected tokens from it,
    its ceiling (verification at least a plain step) and its estimate over v of its rows, measured as the n-gram
    round verifying as many (drafting is a lookup); whether its outputs are plain's."""
    r = timed_decode(model, prompts, draft=wider, proposer="mtp", **kw)
    shape = r["tree"]
    rows = timed_decode(model, prompts, draft=shape.size, proposer="ngram", **kw)
    t = plain["sec_per_round"]
    v, cost = rows["sec_per_round"] / t, r["sec_per_round"] / t
    by = acceptance_by_depth_rank(shape, r["accepted_by_node"], r["reached"])
    e = expected_tokens(shape, by)
    # r of the ceiling: one module call per depth at a chain draft's floor (a level drafts all its nodes at once)
    floor = floor_ratio(make_proposer("mtp", chain(shape.max_depth)), model.cfg, context)
    rep.update({"tree": shape.name(), "tree_nodes": shape.size, "tree_tokens_per_sec": r["tokens_per_sec"],
                "tree_speedup": r["tokens_per_sec"] / plain["tokens_per_sec"], "tree_tokens_per_round": _per_round(r),
                **{f"tree_acceptance_depth{d + 1}": a for d, a in enumerate(by)},
                "tree_expected_tokens_per_round": e, "tree_round_cost": cost, "tree_verify_cost_v": v,
                "tree_predicted_speedup": e / cost,
                "tree_speedup_ceiling": ceiling(shape, by, floor),
                "tree_floor_draft_speedup": ceiling(shape, by, floor, max(1.0, v))})
    return r["outputs"] == plain["outputs"]
