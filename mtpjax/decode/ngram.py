"""Prompt lookup: n-gram drafts continue the latest earlier occurrence of the committed sequence's longest suffix;
alone (NgramProposer) or as a hybrid tree's n-gram branch (mtpjax.decode.mtp_proposers)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mtpjax.decode.cache import take_rows
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.drafts import Tree
from mtpjax.nn.flops import TokenFlops


@dataclass(frozen=True)
class NgramProposer(Proposer):
    """Prompt lookup: continue the latest earlier occurrence of the longest matching suffix (<= max_n)."""

    tree: Tree  # a chain
    max_n: int = 3  # the longest suffix matched; also the most drafts auto probes (a heuristic bound)

    def impossible(self, target, draft) -> str | None:
        return None

    def start(self, models: Models, ctx: Context):
        return self.step(models, None, ctx)

    def step(self, models: Models, state, ctx: Context):
        drafts = lookup(ctx.seq_BS, ctx.n_B, self.tree.size, self.max_n)
        q = None
        if not ctx.sampler.greedy:  # a deterministic draft: q is one-hot
            q = jax.nn.one_hot(drafts, models.target.cfg.vocab_size, dtype=jnp.float32)
        return None, Draft(drafts, q)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        return 0.0

    draft_reads = draft_flops


def lookup(seq_BS, n_B, G: int, max_n: int):
    """G tokens following the latest earlier match of the committed sequence's longest suffix (<= max_n)."""
    S = seq_BS.shape[1]
    pos_S = jnp.arange(S)
    best_B = jnp.full(n_B.shape, -1, jnp.int32)
    for m in range(max_n, 0, -1):
        eq_BS = (pos_S[None, :] < n_B[:, None] - 1) & (pos_S[None, :] >= m - 1)
        for t in range(m):
            tail_B = take_rows(seq_BS, jnp.maximum(n_B - 1 - t, 0))
            eq_BS &= jnp.roll(seq_BS, t, axis=1) == tail_B[:, None]
        eq_BS &= (n_B >= m + 1)[:, None]
        at_B = jnp.max(jnp.where(eq_BS, pos_S[None, :], -1), axis=1).astype(jnp.int32)
        best_B = jnp.where(best_B < 0, at_B, best_B)
    idx_BG = jnp.minimum(best_B[:, None] + 1 + jnp.arange(G)[None, :], n_B[:, None] - 1)
    last_B = take_rows(seq_BS, n_B - 1)
    drafts_BG = jnp.where(best_B[:, None] >= 0, jnp.take_along_axis(seq_BS, idx_BG, axis=1), last_B[:, None])
    return drafts_BG.astype(jnp.int32)
