"""The proposer contract: what the loop hands a proposer, what it gets back, and the methods it calls.

A proposer holds only static fields (it is part of the compiled loop's hash); its arrays live in the state
it returns, which the loop carries without looking inside. A draft is a tree of G nodes (mtpjax.drafts.Tree: node i
continues node tree.parents[i], -1 being the last committed token, and says its source), and the loop verifies trees:
one verification and one acceptance rule, acceptance counted by a node's depth (its ancestors) and rank (its place
among its siblings). A chain is the tree of width one; the n-gram and draft-model proposers draft chains, the MTP
modules any static tree (with an n-gram branch beside it).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from mtpjax.decode.sampling import Sampler
from mtpjax.drafts import Tree
from mtpjax.nn.model import MTPTransformer
from mtpjax.nn.speed import DraftCost


class Models(NamedTuple):
    """The target, and the independent draft model when one proposes."""

    target: MTPTransformer
    draft: MTPTransformer | None = None


class Context(NamedTuple):
    """What a proposer sees after a commit."""

    seq_BS: jax.Array  # committed tokens [0, n); past n: scratch
    n_B: jax.Array  # committed length per row
    h_BTD: jax.Array  # the trunk's raw hidden states from its last call (the prompt, or the verified tokens)
    h_start_B: jax.Array  # position of h_BTD's first row
    sampler: Sampler
    key: jax.Array
    it: jax.Array | int  # loop iteration (0: the prefill), for independent random draws


class Draft(NamedTuple):
    """A round's drafts, node i of the tree in column i."""

    tokens_BG: jax.Array
    q_BGV: jax.Array | None  # the exact distributions the drafts were drawn from (None when greedy)

    @classmethod
    def stacked(cls, tokens: list, qs: list) -> Draft:
        """The draft of per-node tokens_B (and q_BV, or Nones when greedy), node i in column i."""
        return cls(jnp.stack(tokens, 1), None if qs[0] is None else jnp.stack(qs, 1))


class Proposer(DraftCost, Protocol):
    """Drafts its `tree` every round and owns the decode state it needs (module caches, a draft model's cache); its
    draft work per round (draft_flops, draft_reads) is counted in TokenFlops records (DraftCost)."""

    tree: Tree  # node i continues node tree.parents[i] (-1: the last committed token)

    def impossible(self, target: MTPTransformer, draft: MTPTransformer | None) -> str | None:
        """What makes a request impossible, said before compiling (None: nothing)."""

    def start(self, models: Models, ctx: Context) -> tuple[object, Draft]:
        """(state, drafts) once, after the prefill committed the first token."""

    def step(self, models: Models, state, ctx: Context) -> tuple[object, Draft]:
        """(state, drafts) after every commit."""
