"""Proposers: small static objects that draft γ tokens a round, each owning its decode state (the contract:
mtpjax.decode.protocol.Proposer). Draft.q_BGV is the exact distribution each draft was sampled from, None when
greedy (only the tokens matter there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.decode.cache import module_caches, read_rows, set_layer, take_rows, trunk_cache, write_rows
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.sampling import choose, row_keys
from mtpjax.nn.flops import TokenFlops
from mtpjax.nn.model import MTPTransformer


def _stack(drafts: list, qs: list) -> Draft:
    return Draft(jnp.stack(drafts, 1), None if qs[0] is None else jnp.stack(qs, 1))


@dataclass(frozen=True)
class Plain(Proposer):
    """No drafts: plain decoding is the same loop with γ = 0."""

    num_draft: int = 0

    def problem(self, target, draft) -> str | None:
        return None

    def most_drafts(self, target) -> int:
        return 0

    def start(self, models: Models, ctx: Context):
        return self.step(models, None, ctx)

    def step(self, models: Models, state, ctx: Context):
        return None, Draft(jnp.zeros((ctx.n_B.shape[0], 0), jnp.int32), None)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        return 0.0

    draft_reads = draft_flops


@dataclass(frozen=True)
class NgramProposer(Proposer):
    """Prompt lookup: continue the latest earlier occurrence of the longest matching suffix (<= max_n)."""

    num_draft: int
    max_n: int = 3

    def problem(self, target, draft) -> str | None:
        return None

    def most_drafts(self, target) -> int:
        return 3

    def start(self, models: Models, ctx: Context):
        return self.step(models, None, ctx)

    def step(self, models: Models, state, ctx: Context):
        drafts = lookup(ctx.seq_BS, ctx.n_B, self.num_draft, self.max_n)
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


@struct.dataclass
class MTPState:
    h0_BSD: jax.Array  # the trunk's state as module 1 reads it (trunk_state) at every committed position
    caches: tuple  # one KV per MTP module


@dataclass(frozen=True)
class MTPProposer(Proposer):
    """The target's own MTP modules: module k drafts token k of the round from depth k-1's state and draft k-1.

    Past the modules in use the last one continues autoregressively from its own output. `modules=1` drafts
    every token with module 1 (as vLLM and SGLang do); 0 uses all J modules.
    """

    num_draft: int
    modules: int = 0

    def problem(self, target, draft) -> str | None:
        cfg = target.cfg
        if cfg.mtp_depth == 0:
            return "this model has no MTP modules (mtp_depth 0); use --proposer ngram or --num-draft 0"
        if cfg.mtp_kind == "parallel" and self.num_draft > self.used(cfg.mtp_depth):
            return (f"num_draft={self.num_draft} exceeds the {self.used(cfg.mtp_depth)} parallel MTP heads in use; "
                    "lower --num-draft")
        return None

    def most_drafts(self, target) -> int:
        J = target.cfg.mtp_depth
        if target.cfg.mtp_kind == "parallel" or not self.modules:
            return min(J, self.modules or J)
        return max(J, 3)  # a reused module drafts any number of tokens

    def used(self, depth: int) -> int:
        """Modules that draft from a recomputed window (the rest of the γ drafts reuse the last of them)."""
        return min(self.num_draft, depth, self.modules or depth)

    def window(self) -> int:
        """Rows each module recomputes a round, ending at the draft position n-2.

        A round commits up to γ+1 tokens, whose entries every module must now compute; entries built from a
        rejected draft (module k at i reads x[i+k]) lie inside those γ+1 rows too. Fewer rows leave entries
        a later query reads stale.
        """
        return self.num_draft + 1

    def start(self, models: Models, ctx: Context):
        cfg = models.target.cfg
        B, S = ctx.seq_BS.shape
        h0_BSD = write_rows(jnp.zeros((B, S, cfg.d_model), ctx.h_BTD.dtype), models.target.trunk_state(ctx.h_BTD),
                            ctx.h_start_B)
        state = MTPState(h0_BSD=h0_BSD, caches=module_caches(cfg, B, S))
        return self._draft(models.target, state, ctx, jnp.zeros((B,), jnp.int32), ctx.h_BTD.shape[1])

    def step(self, models: Models, state: MTPState, ctx: Context):
        state = state.replace(h0_BSD=write_rows(state.h0_BSD, models.target.trunk_state(ctx.h_BTD), ctx.h_start_B))
        W = self.window()
        return self._draft(models.target, state, ctx, jnp.maximum(ctx.n_B - 1 - W, 0), W)

    def _draft(self, m: MTPTransformer, st: MTPState, ctx: Context, start_B, W: int):
        """Module k over the window [start, start+W) (its last row at n-2 drafts token k); then the reuse steps."""
        G, B, used = self.num_draft, ctx.n_B.shape[0], self.used(m.cfg.mtp_depth)
        pos_BW = start_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
        out_B = ctx.n_B - 2 - start_B  # the window row at the draft position
        h0_BWD = read_rows(st.h0_BSD, start_B, W)
        h_prev_BWD, seq_BS, caches = h0_BWD, ctx.seq_BS, st.caches
        drafts, qs = [], []
        for k in range(1, G + 1):
            with jax.named_scope(f"draft{k}"):  # profiles attribute time per depth
                if k <= used:
                    toks_BW = read_rows(seq_BS, start_B + k, W)
                    h_BWD, kv = m.mtp_forward(k, m.mtp_input(h_prev_BWD, h0_BWD), toks_BW, pos_BW, cache=caches[k - 1])
                    caches, h_prev_BWD, h_BD = set_layer(caches, k - 1, kv), h_BWD, take_rows(h_BWD, out_B)
                else:  # the last module in use continues from its own output
                    pos_B = ctx.n_B - 2 + (k - used)
                    h_BTD, kv = m.mtp_forward(used, h_BD[:, None], drafts[-1][:, None], pos_B[:, None],
                                              cache=caches[used - 1])
                    caches, h_BD = set_layer(caches, used - 1, kv), h_BTD[:, 0]
                logits_BV = m.logits(m.head_norm(min(k, used), h_BD))
                d_B, q_BV = choose(ctx.sampler, logits_BV, row_keys(ctx.key, 10 + k, ctx.it, B))
                seq_BS = write_rows(seq_BS, d_B[:, None], ctx.n_B + k - 1)  # module k+1 reads draft k
                drafts.append(d_B)
                qs.append(q_BV)
        return st.replace(caches=caches), _stack(drafts, qs)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each module in use runs its block over the window; reuse steps one row; the head once per draft."""
        G, used = self.num_draft, self.used(f_target.mtp_depth)
        return (used * self.window() + (G - used)) * f_target.module + G * f_target.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Every module call reads its module once (whatever its rows), the head once per draft."""
        return self.num_draft * (f_target.module_matmul + f_target.head)


@dataclass(frozen=True)
class DraftModelProposer(Proposer):
    """An independent small model with the target's vocabulary, drafting γ tokens with its own KV cache.

    Each round it first runs its trunk over the last committed tokens (`catch_up`), then drafts one token per
    step. Entries past them, built from rejected drafts, are masked and overwritten: the rollback is the
    committed length alone.
    """

    num_draft: int

    def problem(self, target, draft) -> str | None:
        if draft is None:
            return "proposer 'model' needs a draft model: pass draft=... (decode.py --draft-run-dir RUN)"
        tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
        if tv != dv:
            return (f"the draft model's vocabulary ({dv} ids) differs from the target's ({tv}); "
                    "draft with a model trained on the same tokenizer")
        return None

    def most_drafts(self, target) -> int:
        return 4

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
        dm, G, B, rows = models.draft, self.num_draft, ctx.n_B.shape[0], self.catch_up()
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
        return cache, _stack(drafts, qs)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """The catch-up rows, γ-1 single-row steps, and the draft model's head once per draft."""
        G = self.num_draft
        return (self.catch_up() + G - 1) * f_draft.trunk + G * f_draft.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """γ calls of the draft model (the catch-up and γ-1 steps), each reading its weights once."""
        return self.num_draft * (f_draft.trunk_matmul + f_draft.head)


PROPOSERS = {"mtp": MTPProposer, "mtp1": functools.partial(MTPProposer, modules=1), "ngram": NgramProposer,
             "model": DraftModelProposer}


def make_proposer(name: str, num_draft: int):
    """The proposer a request names; γ = 0 is plain decoding whatever the name."""
    return Plain() if num_draft == 0 else PROPOSERS[name](num_draft)
