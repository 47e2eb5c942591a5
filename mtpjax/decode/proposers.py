"""Proposers: small static objects that draft a tree a round, one class per drafting algorithm, each owning its
decode state (the contract: mtpjax.decode.protocol.Proposer). Draft.q_BGV is the exact distribution each draft was
sampled from, None when greedy (only the tokens matter there). Here: plain decoding, a draft model, and what a
request's `proposer=` name drafts with (DRAFTERS); the MTP modules' are mtp_proposers, prompt lookup's ngram.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtpjax.decode.cache import read_rows, trunk_cache
from mtpjax.decode.mtp_proposers import mtp_proposer
from mtpjax.decode.ngram import NgramProposer
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.sampling import choose, row_keys
from mtpjax.drafts import PLAIN, Source, Tree
from mtpjax.nn.flops import TokenFlops
from mtpjax.nn.model import MTPTransformer


@dataclass(frozen=True)
class Plain(Proposer):
    """No drafts: plain decoding is the same loop verifying the empty tree."""

    tree: Tree = PLAIN

    def impossible(self, target, draft) -> str | None:
        return None

    def start(self, models: Models, ctx: Context):
        return self.step(models, None, ctx)

    def step(self, models: Models, state, ctx: Context):
        return None, Draft(jnp.zeros((ctx.n_B.shape[0], 0), jnp.int32), None)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        return 0.0

    draft_reads = draft_flops


@dataclass(frozen=True)
class DraftModelProposer(Proposer):
    """An independent small model with the target's vocabulary, drafting γ tokens with its own KV cache.

    Each round it first runs its trunk over the last committed tokens (`catch_up`), then drafts one token per
    step. Entries past them, built from rejected drafts, are masked and overwritten: the rollback is the
    committed length alone.
    """

    tree: Tree  # a chain

    def impossible(self, target, draft) -> str | None:
        if draft is None:
            return "proposer 'model' needs a draft model: pass draft_model=... (decode.py --draft-run-dir RUN)"
        tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
        if tv != dv:
            return (f"the draft model's vocabulary ({dv} ids) differs from the target's ({tv}); "
                    "draft with a model trained on the same tokenizer")
        return None

    def start(self, models: Models, ctx: Context):
        dm, (B, S), T = models.draft, ctx.seq_BS.shape, ctx.h_BTD.shape[1]  # the prefill's rows: the prompts
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        _, cache = dm.trunk(ctx.seq_BS[:, :T], pos_BT, cache=trunk_cache(dm.cfg, B, S))
        return self.step(models, cache, ctx)

    def catch_up(self) -> int:
        """Committed tokens the draft model runs each round before drafting: the newest, and the one before it
        (missing when every draft was accepted). Fewer leave that entry stale."""
        return 2

    def step(self, models: Models, cache, ctx: Context):
        dm, G, B, rows = models.draft, self.tree.size, ctx.n_B.shape[0], self.catch_up()
        start_B = ctx.n_B - rows
        pos_BT = start_B[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
        h_BTD, cache = dm.trunk(read_rows(ctx.seq_BS, start_B, rows), pos_BT, cache=cache)
        h_BD = h_BTD[:, rows - 1]
        drafts, qs = [], []
        for k in range(1, G + 1):
            with jax.named_scope(f"draft{k}"):
                d_B, q_BV = choose(ctx.sampler, dm.logits(dm.final_norm(h_BD)), row_keys(ctx.key, 10 + k, ctx.it, B))
                drafts.append(d_B)
                qs.append(q_BV)
                if k < G:
                    h_BTD, cache = dm.trunk(d_B[:, None], (ctx.n_B - 1 + k)[:, None], cache=cache)
                    h_BD = h_BTD[:, 0]
        return cache, Draft.stacked(drafts, qs)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """The catch-up rows, γ-1 single-row steps, and the draft model's head once per draft."""
        G = self.tree.size
        return (self.catch_up() + G - 1) * f_draft.trunk + G * f_draft.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """γ calls of the draft model (the catch-up and γ-1 steps), each reading its weights once."""
        return self.tree.size * (f_draft.trunk_matmul + f_draft.head)


def model_drafts(target: MTPTransformer, draft: MTPTransformer | None) -> int:
    """A draft model k times narrower x shallower than the target drafts up to k tokens a round (at least 1; auto
    probes at most drafts.MAX_NODES)."""
    if draft is None:
        return 1
    t, d = target.cfg, draft.cfg
    return max(1, (t.d_model * t.n_layers) // (d.d_model * d.n_layers))



@dataclass(frozen=True)
class Drafter:
    """What a request's `proposer=` name drafts with: its nodes' source, whether it drafts trees (else chains), the
    most drafts `auto` probes, and its proposer for a tree."""

    source: Source
    trees: bool
    most_drafts: Callable[[MTPTransformer, MTPTransformer | None], int]
    proposer: Callable[[Tree], Proposer]


DRAFTERS = {
    "mtp": Drafter("mtp", True, lambda t, d: t.cfg.mtp_depth, mtp_proposer(0)),  # module k drafts token k
    # module 1 in use when heads are parallel; else a draft past the modules' depth (module 1 continues)
    "mtp1": Drafter("mtp", True, lambda t, d: 1 if t.cfg.mtp_kind == "parallel" else t.cfg.mtp_depth + 1,
                    mtp_proposer(1)),
    "ngram": Drafter("ngram", False, lambda t, d: NgramProposer.max_n, NgramProposer),
    "model": Drafter("model", False, model_drafts, DraftModelProposer),
}


def make_proposer(name: str, tree: Tree) -> Proposer:
    """The proposer a request names drafting `tree`; the empty tree is plain decoding whatever the name."""
    return Plain() if tree == PLAIN else DRAFTERS[name].proposer(tree.drafted_by(DRAFTERS[name].source))
