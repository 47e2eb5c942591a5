"""The jitted decode loop: one `lax.while_loop` of verify → accept → commit → propose rounds, and its state.

A draft is a tree (a chain is the tree of width one). One round verifies [last committed token, the tree's nodes]
with one cached trunk forward (each row seeing its ancestors), accepts the longest path (greedy match or recursive
rejection sampling), commits what its commit policy makes of that path plus one target token, then asks the
proposer for the next drafts. The proposer owns whatever state it needs (module caches, a draft model's cache); the
invariant (docs/design.md §6) is that at every loop boundary each cache equals a fresh prefill of the committed
sequence wherever its inputs are committed. Plain decoding is the same loop verifying the empty tree.

`Loop` holds only static fields (gemma's sampler loop has the same shape): it is hashed by `jax.jit`, so
everything that varies per call without changing shapes (prompts, budgets, the key, the streaming
callback's id) is a traced input in `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mtpjax.decode import stream
from mtpjax.decode import tree as trees
from mtpjax.decode.cache import keep_path, take_rows, trunk_cache, write_rows
from mtpjax.decode.mesh import lay_out
from mtpjax.decode.protocol import Context, Models, Proposer
from mtpjax.decode.sampling import Sampler, choose, draw, probs, row_keys
from mtpjax.drafts import Tree
from mtpjax.nn.mla import decode_view
from mtpjax.nn.model import for_decoding, unstack_layers


@struct.dataclass
class Request:
    """The traced inputs of one generation."""

    tokens_BP: jax.Array  # prompts, right-padded to the loop's prompt_pad
    plen_B: jax.Array
    budget_B: jax.Array  # new tokens each row may commit (<= max_new; traced, so no recompile)
    key: jax.Array
    stream: jax.Array  # id of the host callback that receives each commit (stream.NONE: none)
    policy: object = None  # the commit policy's own arrays (the loop carries them without looking inside)


@struct.dataclass
class DecodeState:
    """Everything carried through the generation loop, as one pytree."""

    trunk: tuple  # the target's KV cache (a KV per layer, or one stacked KV when layers are scanned)
    seq_BS: jax.Array  # committed tokens [0, n)
    n_B: jax.Array  # committed length per row
    prompt_len_B: jax.Array
    budget_B: jax.Array
    drafts_BG: jax.Array  # drafts proposed for the next round
    q_BGV: jax.Array | None  # the distributions they were drawn from (None when greedy)
    proposer: object  # the proposer's own state (its caches); the loop never looks inside
    done_B: jax.Array
    rounds_B: jax.Array
    # The one acceptance counter: rounds in which node i of the draft tree was accepted. With rounds_B it gives the
    # rest (host.summarize): acceptance by depth sums a depth's nodes, and a depth is reached when the one above it
    # was accepted.
    accepted_BG: jax.Array
    key: jax.Array
    stream: jax.Array
    policy: object = None  # the request's arrays for the commit policy


class CommitPolicy(Protocol):
    """What a round commits given what it accepted: (tokens, count) from the accepted path's tokens, their count,
    and the committed length, with the request's own arrays (Request.policy). Static: part of the loop's hash."""

    def __call__(self, policy, toks_BY, c_B, n_B) -> tuple[jax.Array, jax.Array]: ...


@dataclass(frozen=True)
class Accepted:
    """What a round commits when decoding: the accepted drafts and one target token."""

    def __call__(self, policy, toks_BY, c_B, n_B):
        return toks_BY, c_B


@dataclass(frozen=True)
class Loop:
    """One compiled generation: the proposer, the sampler and the shapes."""

    proposer: Proposer
    sampler: Sampler
    max_new: int
    capacity: int
    prompt_pad: int
    eos_id: int  # -1: none
    stream: bool = False  # emit every commit to the host (to the callback the request's stream id names)
    commits: CommitPolicy = Accepted()  # what a round commits (tokens, count) given what it accepted

    @property
    def tree(self) -> Tree:
        return self.proposer.tree

    def __call__(self, models: Models, req: Request) -> DecodeState:
        # On a mesh every carried array keeps one layout: caches sharded as their producers, rows over the data axes.
        where, B = models.target.placement, req.tokens_BP.shape[0]
        st = lay_out(where, self.prefill(models, req), B)

        def body(carry):
            it, st = carry
            return it + 1, lay_out(where, self.round(models, st, it + 1), B)

        _, st = jax.lax.while_loop(lambda c: jnp.any(~c[1].done_B), body, (jnp.int32(0), st))
        return st

    def emit(self, stream_id, seq, toks_BY, c_B) -> None:
        if self.stream:  # unordered (an ordered effect runs on one device only): the host orders them by `seq`
            jax.debug.callback(stream.emit, stream_id, seq, toks_BY, c_B)

    def prefill(self, models: Models, req: Request) -> DecodeState:
        """Trunk over the prompts, the first token from the last prompt position, then the proposer's start."""
        m, (B, P), S = models.target, req.tokens_BP.shape, self.capacity
        pos_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        h_BPD, trunk = m.trunk(req.tokens_BP, pos_BP, cache=trunk_cache(m.cfg, B, S))
        logits_BV = m.logits(m.final_norm(take_rows(h_BPD, req.plen_B - 1)))
        first_B, _ = choose(self.sampler, logits_BV, row_keys(req.key, 0, 0, B))
        ones_B = jnp.ones_like(req.plen_B)
        first_B = self.commits(req.policy, first_B[:, None], ones_B, req.plen_B)[0][:, 0]
        seq_BS = write_rows(jnp.zeros((B, S), jnp.int32).at[:, :P].set(req.tokens_BP), first_B[:, None], req.plen_B)
        self.emit(req.stream, 0, first_B[:, None], ones_B)
        n_B = req.plen_B + 1
        with jax.named_scope("propose"):
            ctx = Context(seq_BS, n_B, h_BPD, jnp.zeros_like(n_B), self.sampler, req.key, 0)
            pstate, draft = self.proposer.start(models, ctx)
        return DecodeState(
            trunk=trunk, seq_BS=seq_BS, n_B=n_B, prompt_len_B=req.plen_B, budget_B=req.budget_B,
            drafts_BG=draft.tokens_BG, q_BGV=draft.q_BGV, proposer=pstate,
            done_B=(first_B == self.eos_id) | (req.budget_B <= 1), rounds_B=jnp.zeros((B,), jnp.int32),
            accepted_BG=jnp.zeros((B, self.tree.size), jnp.int32),
            key=req.key, stream=req.stream, policy=req.policy)

    def round(self, models: Models, st: DecodeState, it) -> DecodeState:
        """One verify → accept → commit → propose round."""
        m, tree = models.target, self.tree
        start_B = st.n_B - 1
        vt_BY = jnp.concatenate([take_rows(st.seq_BS, start_B)[:, None], st.drafts_BG], axis=1)
        depth_Y, sees_YY = trees.verify_rows(tree)
        pos_BY = start_B[:, None] + jnp.asarray(depth_Y)[None, :]
        sees = None if tree.is_chain() else jnp.asarray(sees_YY)[None]  # a chain: the causal mask
        with jax.named_scope("verify"):
            h_BYD, trunk = m.trunk(vt_BY, pos_BY, sees, cache=st.trunk)
        with jax.named_scope("accept"):
            a_B, toks_BY, path_BY = self.accept(m.logits(m.final_norm(h_BYD)), st, it)
        if not tree.is_chain():  # only the accepted path's entries survive, at the positions it is committed at
            trunk = keep_path(trunk, start_B, path_BY, m.cfg.scan_layers)
            h_BYD = trees.along(tree, h_BYD, path_BY)
        st = st.replace(trunk=trunk)
        with jax.named_scope("commit"):
            on_BG = ~st.done_B[:, None] & trees.accepted_nodes(tree, a_B, path_BY)
            st = self.commit(st.replace(accepted_BG=st.accepted_BG + on_BG), a_B, toks_BY)
        with jax.named_scope("propose"):
            ctx = Context(st.seq_BS, st.n_B, h_BYD, start_B, self.sampler, st.key, it)
            pstate, draft = self.proposer.step(models, st.proposer, ctx)
        return st.replace(proposer=pstate, drafts_BG=draft.tokens_BG, q_BGV=draft.q_BGV)

    def accept(self, logits_BYV, st: DecodeState, it):
        """(accepted depth a_B, the D+1 tokens to commit: the accepted path's drafts then the target's token after
        it, the verification row at each depth of that path)."""
        tree = self.tree
        if self.sampler.greedy:
            g_BY = jnp.argmax(logits_BYV, axis=-1).astype(jnp.int32)
            a_B, path_BY = trees.greedy_path(tree, st.drafts_BG, g_BY)
            bonus_B = take_rows(trees.along(tree, g_BY, path_BY), a_B)
        else:
            B, Y, V = logits_BYV.shape
            p_BYV = probs(self.sampler, logits_BYV.reshape(B * Y, V)).reshape(B, Y, V)
            u_BG = jax.vmap(lambda k: jax.random.uniform(k, (Y - 1,)))(row_keys(st.key, 1, it, B))
            a_B, path_BY, left_BV = trees.sampled_path(tree, st.drafts_BG, st.q_BGV, p_BYV, u_BG)
            bonus_B = draw(row_keys(st.key, 2, it, B), left_BV)
        d_BY = trees.along(tree, jnp.pad(st.drafts_BG, ((0, 0), (1, 0))), path_BY)  # the root's column: not committed
        i = jnp.arange(tree.max_depth + 1)[None, :]
        toks_BY = jnp.where(i < a_B[:, None], jnp.roll(d_BY, -1, axis=1), bonus_B[:, None])
        return a_B, toks_BY, path_BY

    def commit(self, st: DecodeState, a_B, toks_BY) -> DecodeState:
        """Advance each active row by its accepted prefix + 1, cut at EOS and at the length budget."""
        Y = toks_BY.shape[1]
        i = jnp.arange(Y)[None, :]
        c_B = jnp.minimum(a_B + 1, st.budget_B - (st.n_B - st.prompt_len_B))
        toks_BY, c_B = self.commits(st.policy, toks_BY, c_B, st.n_B)
        if self.eos_id >= 0:
            eos_BY = (toks_BY == self.eos_id) & (i < c_B[:, None])
            hit_B = eos_BY.any(axis=1)
            c_B = jnp.where(hit_B, jnp.argmax(eos_BY, axis=1) + 1, c_B)
        else:
            hit_B = jnp.zeros_like(st.done_B)
        active_B = ~st.done_B
        c_B = jnp.where(active_B, c_B, 0)
        seq_BS = write_rows(st.seq_BS, toks_BY, st.n_B)  # past n for inactive rows: scratch
        self.emit(st.stream, jnp.max(st.rounds_B) + 1, toks_BY, c_B)  # a row active now was active every round
        n_B = st.n_B + c_B
        return st.replace(
            seq_BS=seq_BS, n_B=n_B, done_B=st.done_B | hit_B | (n_B - st.prompt_len_B >= st.budget_B),
            rounds_B=st.rounds_B + active_B.astype(jnp.int32))


def run_loop(loop: Loop, graphs: tuple, params: tuple, req: Request) -> DecodeState:
    """The whole generation, from the split target (and draft) models; `execute` is this function jitted."""
    # Views built before the loop: its steps then read MLA's weights as laid out here, once, and each layer's weights
    # where they lie; MoE layers dropless.
    models = Models(*(None if g is None else decode_view(unstack_layers(for_decoding(nnx.merge(g, p))))
                      for g, p in zip(graphs, params)))
    return loop(models, req)


execute = jax.jit(run_loop, static_argnames=("loop", "graphs"))
