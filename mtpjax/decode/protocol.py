"""The proposer contract: what the loop hands a proposer, what it gets back, and the methods it calls.

A proposer holds only static fields (it is part of the compiled loop's hash); its arrays live in the state
it returns, which the loop carries without looking inside. A draft is a tree of G nodes given by `parents()`
(node i continues node parents()[i], -1 being the last committed token), and the loop verifies trees: one
verification and one acceptance rule, acceptance counted by a node's depth (its ancestors) and rank (its place among
its siblings). A chain (node i continues node i-1, `chain`) is the tree of width one; the n-gram and draft-model
proposers draft chains, the MTP modules any static tree.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import jax

from mtpjax.config.specs import Hybrid, Tree
from mtpjax.decode.sampling import Sampler
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


def chain(num_draft: int) -> tuple[int, ...]:
    """The parents of a chain of drafts: each continues the one before it."""
    return tuple(range(-1, num_draft - 1))


class Proposer(DraftCost, Protocol):
    """Drafts `num_draft` tokens a round and owns the decode state it needs (module caches, a draft model's cache);
    its draft work per round (draft_flops, draft_reads) is counted in TokenFlops records (DraftCost)."""

    TREES: ClassVar[bool] = False  # drafts any static tree (else chains only)

    @classmethod
    def of(cls, shape: Tree | Hybrid) -> Proposer:
        """The proposer drafting `shape` (a chain unless TREES)."""

    def problem(self, target: MTPTransformer, draft: MTPTransformer | None) -> str | None:
        """What makes a request impossible, said before compiling (None: nothing)."""

    @staticmethod
    def most_drafts(target: MTPTransformer, draft: MTPTransformer | None = None) -> int:
        """The largest γ `num_draft="auto"` probes, from the models (a question of the class, not of an instance)."""

    def start(self, models: Models, ctx: Context) -> tuple[object, Draft]:
        """(state, drafts) once, after the prefill committed the first token."""

    def step(self, models: Models, state, ctx: Context) -> tuple[object, Draft]:
        """(state, drafts) after every commit."""

    def parents(self) -> tuple[int, ...]:
        """The draft tree: node i continues node parents()[i] (-1: the last committed token)."""
        return chain(self.num_draft)
