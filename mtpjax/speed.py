"""The speculation arithmetic, in one place: E(γ), the draft-work ratio r, the ceiling, the predicted speedup.

A round with γ drafts verifies γ+1 tokens and commits E(γ) of them on average, where draft i is accepted
(all before it accepted) with rate α_i:

    E(γ) = 1 + Σ_{i=1..γ} Π_{j<=i} α_j                (constant α: (1 - α^(γ+1)) / (1 - α))

Measured against a plain decode step, a round costs v + γc (v: verifying γ+1 tokens, c: one draft), so

    predicted speedup = E(γ) / (v + γc)              (v + γc: the round's measured cost)
    ceiling           = E(γ) / (1 + γr)              (v >= 1; r: a draft's FLOPs over a plain step's)

r counts the rows a round's drafting really computes (an MTP module recomputes a window, a draft model
catches up on the committed tokens), so the ceiling is the speedup with drafts running at the trunk's
speed per FLOP and verification as cheap as one plain step. Everything here is plain arithmetic on
numbers or traced scalars: the training metric `expected_accept_length` calls `expected_tokens` under jit.
"""

from __future__ import annotations

from mtpjax.config import ModelConfig
from mtpjax.flops import flops_per_token


def expected_tokens(alpha_by_pos, gamma: int):
    """E(γ): tokens per round with γ drafts when draft i is accepted (all before it accepted) with rate
    alpha_by_pos[i]; past the list its last rate is reused ([α]: the constant-α case). Jittable."""
    total, run = 1.0, 1.0
    for i in range(gamma):
        run = run * (alpha_by_pos[min(i, len(alpha_by_pos) - 1)] if len(alpha_by_pos) else 0.0)
        total = total + run
    return total


def work_ratio(proposer, model_cfg: ModelConfig, context: int, draft_cfg: ModelConfig | None = None) -> float:
    """r: the FLOPs one round's drafting computes per draft, over one plain decode step's (trunk + head).

    `proposer` counts its own rows (`draft_flops`); `context` is the mean decode context (attention keys).
    """
    G = proposer.num_draft
    if G == 0:
        return 0.0
    f = flops_per_token(model_cfg, context)
    fd = flops_per_token(draft_cfg, context) if draft_cfg is not None else None
    return proposer.draft_flops(f, fd) / (G * (f["trunk"] + f["head"]))


def ceiling(alpha_by_pos, gamma: int, r: float) -> float:
    """E(γ) / (1 + γr): the speedup with v = 1 and c = r."""
    return expected_tokens(alpha_by_pos, gamma) / (1.0 + gamma * r)


def speedup_ceiling(alpha_by_pos, work_ratio, max_gamma: int) -> dict:
    """Best ceiling over γ <= max_gamma; `work_ratio` is r (a number) or a function γ -> r.

    Returns {"by_gamma": {γ: bound}, "max": the best bound, "num_draft": its γ}; γ = 0 (plain) bounds at 1.
    """
    r = work_ratio if callable(work_ratio) else (lambda g: work_ratio)
    by = {g: ceiling(alpha_by_pos, g, r(g) if g else 0.0) for g in range(max_gamma + 1)}
    best = max(by, key=lambda g: by[g])
    return {"by_gamma": by, "max": by[best], "num_draft": best}


def predicted_speedup(alpha_by_pos, gamma: int, round_cost: float) -> float:
    """E(γ) over the measured cost of a round with γ drafts relative to a plain round (round_cost = v + γc)."""
    return expected_tokens(alpha_by_pos, gamma) / round_cost


def choose_num_draft(alpha_by_pos, round_cost: dict) -> int:
    """The γ maximizing the predicted speedup E(γ) / cost(γ), where cost(γ) is the measured time of a round with
    γ drafts relative to a plain round at the same batch size (cost(0) = 1: plain decoding, always a candidate).

    Batched verification is compute-bound sooner, so at large batch cost(γ) grows and this picks fewer
    drafts, down to 0: speculation is then never slower than plain decoding (up to measurement noise).
    """
    rates = {0: 1.0}
    for g, c in round_cost.items():
        if g > 0 and c > 0:
            rates[g] = predicted_speedup(alpha_by_pos, g, c)
    return max(sorted(rates), key=lambda g: rates[g])
