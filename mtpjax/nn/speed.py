"""The speculation arithmetic, in one place: E(γ), the draft-work ratio r, the ceiling, the predicted speedup.

A round with γ drafts verifies γ+1 tokens and commits E(γ) of them on average, where draft i is accepted
(all before it accepted) with rate α_i:

    E(γ) = 1 + Σ_{i=1..γ} Π_{j<=i} α_j                (constant α: (1 - α^(γ+1)) / (1 - α))

Measured against a plain decode step, a round costs v + γc (v: verifying γ+1 tokens, c: one draft), so

    predicted speedup = E(γ) / (v + γc)              (v + γc: the round's measured cost)
    ceiling           = E(γ) / (v(γ+1) + γr)         (c >= r; v(n): one forward of n rows over one row's)

A tree generalizes both: E sums each node's chance of acceptance (by depth and rank), and its drafting costs one
module call per depth, so its ceiling is E / (v(nodes+1) + depth·r), a chain's being the tree of width one.

v(n) is measured (bench/cache_cliff.py --rows, decode.py --eval's verification round); where nothing was
measured it is 1, the bound of free rows (`verify_cost`: a number, or a function of the rows verified).

A draft's work is counted as a round really does it: `work_ratio` counts every row it computes (an MTP
module recomputes a window of γ+1 rows, a draft model first catches up on the committed tokens), in FLOPs
over a plain step's; `weight_ratio` counts the weights it reads (once per call, whatever the rows). Where
a decode step is compute-bound the FLOPs set the cost, where it waits on memory the weights do, and the
ceiling takes r as the smaller (`floor_ratio`), so it bounds the speedup in either regime. Everything here
is plain arithmetic on numbers or traced scalars: the training metric `expected_accept_length` calls
`expected_tokens` under jit.
"""

from __future__ import annotations

from typing import Protocol

from mtpjax.config import ModelConfig
from mtpjax.drafts import PLAIN, Tree, chain
from mtpjax.nn.flops import TokenFlops


class DraftCost(Protocol):
    """What the arithmetic reads of a proposer (mtpjax.decode.protocol.Proposer): its tree, one round's draft work."""

    tree: Tree

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """FLOPs one round of drafting computes, every row counted."""

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """The weights one round of drafting reads, as matmul FLOPs of one row."""


def by_position(alpha_by_pos) -> list:
    """A chain's acceptance as expected_tokens reads it, from α by draft position: one rank per depth."""
    return [[a] for a in alpha_by_pos]


def expected_tokens(tree: Tree, acceptance) -> float:
    """Tokens per round of a draft tree: 1 + Σ over nodes of the chance the node is accepted, the product along its
    path of a[d][r], the chance that the rank-r child is the one accepted at depth d once its parent is (siblings
    are exclusive: Σ_r a[d][r] <= 1). Past a depth's or rank's list its last entry is reused, so a chain with
    a[d] = [α_d] (by_position) is E(γ), and [[α]] the constant-α case. Jittable (the rates may be traced)."""
    a = acceptance

    def rate(d: int, r: int):
        row = a[min(d, len(a)) - 1] if len(a) else []
        return row[min(r, len(row) - 1)] if len(row) else 0.0

    reach: list = []
    for v, p in enumerate(tree.parents):
        reach.append((1.0 if p < 0 else reach[p]) * rate(tree.depth[v], tree.rank[v]))
    return 1.0 + sum(reach)


def ceiling(tree: Tree, acceptance, r: float, verify_cost: float = 1.0) -> float:
    """A round's speedup bound: its expected tokens over the verification of its rows (`verify_cost`, v(n) in plain
    steps, measured where it is known: it is not 1 past a few rows) plus its drafting, one call per depth at r each
    (r: a draft's floor_ratio; a level drafts all its nodes in one call, so a chain of γ pays γr)."""
    return expected_tokens(tree, acceptance) / (verify_cost + tree.max_depth * r)


def work_ratio(proposer: DraftCost, model_cfg: ModelConfig, context: int,
               draft_cfg: ModelConfig | None = None) -> float:
    """The FLOPs one round's drafting computes per draft over a plain decode step's (trunk + head), every row
    counted (an MTP module recomputes its window). A draft's cost where decoding is compute-bound."""
    f, fd = _flops(model_cfg, context, draft_cfg)
    return _per_draft(proposer, proposer.draft_flops(f, fd), f.plain_step)


def weight_ratio(proposer: DraftCost, model_cfg: ModelConfig, context: int,
                 draft_cfg: ModelConfig | None = None) -> float:
    """The weights one round's drafting reads per draft over those a plain decode step reads (each call reads
    its weights once, whatever its rows). A draft's cost where decoding is bound by reading weights."""
    f, fd = _flops(model_cfg, context, draft_cfg)
    return _per_draft(proposer, proposer.draft_reads(f, fd), f.plain_reads)


def floor_ratio(proposer: DraftCost, model_cfg: ModelConfig, context: int,
                draft_cfg: ModelConfig | None = None) -> float:
    """r of the ceiling: a draft costs at least the smaller of its FLOP and weight shares of a plain step
    (roofline: time >= max(FLOPs / peak, bytes / bandwidth) for the draft and the plain step alike)."""
    args = (proposer, model_cfg, context, draft_cfg)
    return min(work_ratio(*args), weight_ratio(*args))


def _flops(model_cfg: ModelConfig, context: int, draft_cfg: ModelConfig | None) -> tuple:
    draft = None if draft_cfg is None else TokenFlops.per_token(draft_cfg, context)
    return TokenFlops.per_token(model_cfg, context), draft


def _per_draft(proposer: DraftCost, draft: float, plain: float) -> float:
    G = proposer.tree.size
    return draft / (G * plain) if G else 0.0


def verify_cost_of(verify_cost, rows: int) -> float:
    """v(rows) from a number (every row count alike), a function rows -> v, or a {rows: v} table (measured
    row counts; between or past them the next larger one measured, else the largest); one row costs 1."""
    if rows <= 1:
        return 1.0
    if callable(verify_cost):
        return verify_cost(rows)
    if isinstance(verify_cost, dict):
        return verify_cost[min((n for n in verify_cost if n >= rows), default=max(verify_cost))]
    return verify_cost


def speedup_ceiling(alpha_by_pos, work_ratio, max_gamma: int, verify_cost=1.0) -> dict:
    """Best ceiling over chains of γ <= max_gamma; `work_ratio` is r (a number) or a function γ -> r; `verify_cost`
    is v of the γ+1 verified rows (verify_cost_of: a number, a function or a measured table; 1: free rows).

    Returns {"by_gamma": {γ: bound}, "max": the best bound, "gamma": its γ}; γ = 0 (plain) bounds at 1.
    """
    r = work_ratio if callable(work_ratio) else (lambda g: work_ratio)
    a = by_position(alpha_by_pos)
    by = {g: ceiling(chain(g), a, r(g) if g else 0.0, verify_cost_of(verify_cost, g + 1)) for g in range(max_gamma + 1)}
    best = max(by, key=lambda g: by[g])
    return {"by_gamma": by, "max": by[best], "gamma": best}


def choose_fastest(expected: dict, round_cost: dict, margin: float = 1.0) -> Tree:
    """The draft tree maximizing the predicted speedup expected[k] / round_cost[k] (the first of equals, in the dict's
    order), where round_cost is a round's measured time over a plain round's at the same batch size; PLAIN unless
    that beats plain and by `margin` (decode.py asks for more than the timing noise). Batched verification is
    compute-bound sooner, so at large batch costs grow and this picks fewer drafts, down to plain: speculation is
    then never slower than plain decoding (up to measurement noise)."""
    rates = {k: expected[k] / c for k, c in round_cost.items() if k != PLAIN and c > 0 and k in expected}
    best = max(rates, key=lambda k: rates[k], default=PLAIN)
    return best if best != PLAIN and rates[best] > 1.0 and rates[best] >= margin else PLAIN
