"""Checkpoint evaluation: validation loss/agreement per depth, then measured vs predicted speculative speedup.

Costs come from whole-loop timings in one process, never from isolated dispatches: t = seconds per
round of plain decoding; v = seconds per round of n-gram speculation (drafting is nearly free, so a
round is one verification of γ+1 tokens) over t; c = the remaining MTP round time per draft over t.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax.autodraft import speedup_ceiling
from mtpjax.config import Config
from mtpjax.flops import draft_work_ratio
from mtpjax.loss import mtp_loss
from mtpjax.model import MTPTransformer
from mtpjax.sampling import make_sampler
from mtpjax.speculative import make_spec, run, summarize


def validation_metrics(cfg: Config, model: MTPTransformer, batches) -> dict:
    """Mean loss/accuracy/agreement per depth over validation batches."""
    @nnx.jit
    def step(model, toks, seg):
        return mtp_loss(model, model(toks, seg), toks, seg, step=0, cfg=cfg.loss)[1]

    sums, n = {}, 0
    for b in batches:
        met = step(model, jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"]))
        for k, v in met.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items() if k != "lambda"}


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


def timed_decode(model, prompts, *, num_draft: int, proposer: str, max_new: int, batch: int = 1,
                 repeats: int = 1) -> dict:
    """Greedy-decode prompts in groups of `batch` after a compile warmup; seconds, tokens, rounds, acceptance."""
    groups = [prompts[i: i + batch] for i in range(0, len(prompts) - batch + 1, batch)]

    def spec_of(group):
        # all prompts are padded to one bucket, so a single compilation serves every group
        return make_spec(model, group, max_new_tokens=max_new, num_draft=num_draft, proposer=proposer,
                         sampler=make_sampler(), eos_id=None, max_len=None)

    jax.block_until_ready(run(model, groups[0], spec_of(groups[0])).n_B)  # compile
    secs, tokens, rounds, loops = 0.0, 0, 0, 0
    acc, reach, outs = np.zeros(num_draft), np.zeros(num_draft), []
    for group in groups:
        spec = spec_of(group)
        for _ in range(repeats):
            t0 = time.perf_counter()
            st = run(model, group, spec)
            jax.block_until_ready(st.n_B)
            secs += time.perf_counter() - t0
        res = summarize(st)
        tokens += res.stats["generated"] * repeats
        rounds += res.stats["rounds"] * repeats  # summed over rows
        loops += int(np.asarray(st.rounds_B).max()) * repeats  # a batch loops until its slowest row is done
        acc += np.asarray(res.stats["accepted"] or np.zeros(num_draft)) * repeats
        reach += np.asarray(res.stats["reached"] or np.zeros(num_draft)) * repeats
        outs.extend(res.tokens)
    return {"seconds": secs, "tokens": tokens, "runs": sum(len(g) for g in groups) * repeats, "rounds": rounds,
            "accepted": acc, "reached": reach, "tokens_per_sec": tokens / secs,
            "sec_per_round": secs / max(loops, 1), "outputs": outs}


def agreement_on(model, prompts, outputs, depth: int) -> list[float]:
    """Teacher-forced agreement per depth over the generated part of prompt+output sequences.

    Greedy decoding is the main head's argmax chain, so on its own output this is the acceptance the
    drafts should show; a gap between the two means the decoder's draft state is wrong.
    """
    seqs = [p + o for p, o in zip(prompts, outputs)]
    T = min(len(s) for s in seqs)
    toks = jnp.asarray([s[:T] for s in seqs], jnp.int32)
    am = np.asarray(argmax_by_depth(model, toks))  # [D+1, B, T]
    P = max(len(p) for p in prompts)
    # position i's depth-k draft predicts x[i+k+1]; the main head at i+k predicts the same token
    return [float((am[k][:, P - 1: T - k - 1] == am[0][:, P - 1 + k: T - 1]).mean()) for k in range(1, depth + 1)]


@nnx.jit
def argmax_by_depth(model, toks):
    """int[D+1, B, T]: each depth's greedy prediction at every position (one jitted full forward)."""
    return jnp.argmax(model.logits(model(toks).hidden), axis=-1)


def forced_acceptance(model, sequences, prompt_len: int, num_draft: int) -> list[float]:
    """Acceptance by draft position while decoding walks the reference continuation of each sequence
    (teacher forcing, one token per round). Depth 1 measures what agreement/mtp_1 measures in training,
    on the same kind of text, through the decoder's caches."""
    prompts = [s[:prompt_len] for s in sequences]
    refs = [s[prompt_len:] for s in sequences]
    n = min(len(r) for r in refs)
    spec = make_spec(model, prompts, max_new_tokens=n, num_draft=num_draft, proposer="mtp", sampler=make_sampler(),
                     eos_id=None, max_len=None)
    return summarize(run(model, prompts, dataclasses.replace(spec, forced=True), reference=refs)).stats[
        "acceptance_by_position"]


def ideal_tokens_per_round(alpha: float, gamma: int) -> float:
    """E = (1 - α^(γ+1)) / (1 - α): expected tokens per round with i.i.d. acceptance α."""
    return gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def decode_context(prompts, max_new: int) -> int:
    """Mean context length while decoding these prompts max_new tokens further (for flops.draft_work_ratio)."""
    return int(np.mean([len(p) for p in prompts])) + max_new // 2


def speed_report(model, prompts, *, num_draft: int, max_new: int, batch: int = 1, repeats: int = 1) -> dict:
    """Plain vs n-gram vs MTP greedy decoding: throughput, acceptance, costs (c, v), predicted speedup."""
    kw = dict(max_new=max_new, batch=batch, repeats=repeats)
    plain = timed_decode(model, prompts, num_draft=0, proposer="mtp", **kw)
    ngram = timed_decode(model, prompts, num_draft=num_draft, proposer="ngram", **kw)
    rep = {"batch": batch, "num_draft": num_draft, "plain_tokens_per_sec": plain["tokens_per_sec"],
           "ngram_tokens_per_sec": ngram["tokens_per_sec"],
           "ngram_speedup": ngram["tokens_per_sec"] / plain["tokens_per_sec"],
           "ngram_tokens_per_round": _per_round(ngram)}
    t = plain["sec_per_round"]
    v = ngram["sec_per_round"] / t
    rep["verify_cost_v"] = v
    exact = ngram["outputs"] == plain["outputs"]
    if model.cfg.mtp_depth:
        mtp = timed_decode(model, prompts, num_draft=num_draft, proposer="mtp", **kw)
        exact &= mtp["outputs"] == plain["outputs"]
        alpha_pos = (mtp["accepted"] / np.maximum(mtp["reached"], 1)).tolist()
        alpha = float(mtp["accepted"].sum() / max(mtp["reached"].sum(), 1))
        c = max(0.0, (mtp["sec_per_round"] / t - v) / num_draft)
        E = ideal_tokens_per_round(alpha, num_draft)
        rep.update({
            "mtp_tokens_per_sec": mtp["tokens_per_sec"], "speedup": mtp["tokens_per_sec"] / plain["tokens_per_sec"],
            "acceptance_by_position": alpha_pos, "alpha": alpha, "tokens_per_round": _per_round(mtp),
            "expected_tokens_per_round": E, "draft_cost_c": c, "predicted_speedup": E / (v + num_draft * c),
            "draft_time_fraction": num_draft * c / (v + num_draft * c),
            # the most this γ could give with these α even if verifying cost one plain step and a draft its FLOPs
            "speedup_ceiling": speedup_ceiling(alpha_pos, draft_work_ratio(model.cfg, decode_context(prompts, max_new)),
                                               num_draft)["by_gamma"][num_draft],
            "agreement_on_generated": agreement_on(model, prompts, mtp["outputs"], min(num_draft, model.cfg.mtp_depth)),
        })
    rep["outputs_identical"] = bool(exact)
    return rep


def _per_round(r: dict) -> float:
    # each row's first token comes from the prefill, not from a round
    return (r["tokens"] - r["runs"]) / max(r["rounds"], 1)
