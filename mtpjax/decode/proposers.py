"""Proposers: small static objects that draft γ tokens a round, each owning its decode state (the contract:
mtpjax.decode.protocol.Proposer). Draft.q_BGV is the exact distribution each draft was sampled from, None when
greedy (only the tokens matter there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.decode.cache import module_caches, read_rows, set_layer, take_rows, trunk_cache, write_rows
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.sampling import choose, row_keys
from mtpjax.decode.tree import MAX_NODES as MAX_TREE_NODES
from mtpjax.decode.tree import PLAIN, Hybrid, Tree, nodes, sees
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

    @classmethod
    def of(cls, shape: Tree | Hybrid) -> Plain:
        return cls()

    @staticmethod
    def most_drafts(target, draft=None) -> int:
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

    @classmethod
    def of(cls, shape: Tree | Hybrid) -> NgramProposer:
        return cls(nodes(shape))

    @staticmethod
    def most_drafts(target, draft=None) -> int:
        """As many drafts as the longest suffix it matches (max_n), a heuristic bound."""
        return NgramProposer.max_n

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
    """The target's MTP modules drafting a static tree (a chain of γ is the tree `1x…x1`): level k drafts depth k
    with module min(k, modules in use) over a window of committed rows ending at the draft position n-2, a chain's
    nodes in the window at their own positions, a wider tree's as extra rows seeing their ancestors (docs/decoding.md
    §Draft trees). `modules=1`: module 1 drafts every depth (vLLM, SGLang); 0 uses all J. `ngram`: a hybrid, n-gram
    lookup's chain of that many drafts as the root's last branch (a point mass: its q is one-hot)."""

    tree: Tree
    modules: int = 0
    ngram: int = 0
    TREES: ClassVar[bool] = True

    @classmethod
    def of(cls, shape: Tree | Hybrid) -> MTPProposer:
        return cls(shape.tree, ngram=shape.ngram) if isinstance(shape, Hybrid) else cls(shape)

    @property
    def num_draft(self) -> int:
        return self.tree.size + self.ngram

    def parents(self) -> tuple[int, ...]:
        G = self.tree.size
        return self.tree.parents + tuple(-1 if i == 0 else G + i - 1 for i in range(self.ngram))

    def name(self) -> str:
        return Hybrid(self.tree, self.ngram).name() if self.ngram else self.tree.name()

    def in_place(self) -> bool:
        """Whether every node sits in the window at its own position (a chain), needing no rows of its own."""
        return self.tree.is_chain() and not self.ngram

    def problem(self, target, draft) -> str | None:
        cfg = target.cfg
        if cfg.mtp_depth == 0:
            return "this model has no MTP modules (mtp_depth 0); use --proposer ngram or --num-draft 0"
        used, D = self.used(cfg.mtp_depth), self.tree.max_depth
        if cfg.mtp_kind == "parallel" and D > used:
            if self.in_place():
                return f"num_draft={D} exceeds the {used} parallel MTP heads in use; lower --num-draft"
            return (f"tree {self.name()} is {D} deep, beyond the {used} parallel MTP heads in use; "
                    "use a shallower --tree")
        return None

    @staticmethod
    def most_drafts(target, draft=None) -> int:
        """Module k drafts token k: the model's depth."""
        return target.cfg.mtp_depth

    def used(self, depth: int) -> int:
        """Modules that draft from a recomputed window (deeper levels reuse the last of them)."""
        return min(self.tree.max_depth, depth, self.modules or depth)

    def window(self, depth: int) -> int:
        """Committed rows each module recomputes a round, ending at the draft position n-2.

        A round commits up to D+1 tokens (D: the deepest branch, the n-gram one included), whose entries every module
        must now compute. A chain's entries built from its accepted drafts are already right, so D+1 rows cover it;
        a tree's nodes were written elsewhere and module k's rows lag the committed length by k. Fewer rows leave
        entries a later query reads stale.
        """
        if self.in_place():
            return self.tree.max_depth + 1
        return max(self.tree.max_depth, self.ngram) + self.used(depth)

    def start(self, models: Models, ctx: Context):
        (B, S), cfg = ctx.seq_BS.shape, models.target.cfg
        state = MTPState(jnp.zeros((B, S, cfg.d_model), ctx.h_BTD.dtype), module_caches(cfg, B, S))
        return self._step(models, state, ctx, jnp.zeros((B,), jnp.int32), ctx.h_BTD.shape[1])

    def step(self, models: Models, state: MTPState, ctx: Context):
        W = self.window(models.target.cfg.mtp_depth)
        return self._step(models, state, ctx, jnp.maximum(ctx.n_B - 1 - W, 0), W)

    def _step(self, models: Models, state: MTPState, ctx: Context, s_B, W: int):
        """Store the trunk's new states, then draft from the window [s, s+W)."""
        h0_BSD = write_rows(state.h0_BSD, models.target.trunk_state(ctx.h_BTD), ctx.h_start_B)
        return self._draft(models.target, state.replace(h0_BSD=h0_BSD), ctx, s_B, W)

    def _draft(self, m: MTPTransformer, st: MTPState, ctx: Context, s_B, W: int):
        """Level k drafts depth k: a module call, then each node of depth k-1 its children; then the n-gram branch."""
        r = _Round(m, ctx, s_B, W, st, self.used(m.cfg.mtp_depth))
        for k in range(1, self.tree.max_depth + 1):
            with jax.named_scope(f"draft{k}"):  # profiles attribute time per depth
                if k > r.used and self.in_place():
                    self._continue(r, k)
                else:
                    self._level(r, k, min(k, r.used))
                for parent in self.tree.at_depth(k - 1, k - 1) if k > 1 else (-1,):
                    self._children(r, k, parent)
        tokens = [r.tokens[v] for v in range(self.tree.size)]
        qs = [r.qs.get(v) for v in range(self.tree.size)]
        if self.ngram:
            look_BG = lookup(ctx.seq_BS, ctx.n_B, self.ngram, NgramProposer(self.ngram).max_n)
            tokens += [look_BG[:, i] for i in range(self.ngram)]
            if not ctx.sampler.greedy:
                qs += [jax.nn.one_hot(look_BG[:, i], m.cfg.vocab_size, dtype=jnp.float32) for i in range(self.ngram)]
        return st.replace(caches=r.caches), _stack(tokens, qs)

    def extra_nodes(self, k: int, sequential: bool) -> tuple[int, ...]:
        """The nodes level k runs rows for beside the window: a tree's depths 1..k-1 (none for a chain, whose nodes
        are in the window, or for parallel heads, which read no token)."""
        return () if self.in_place() or not sequential else self.tree.at_depth(1, k - 1)

    def _level(self, r: _Round, k: int, mk: int) -> None:
        """Module mk over the window and the level's extra rows (each seeing the committed rows and its ancestors)."""
        m, W, tree = r.m, r.W, self.tree
        nodes = self.extra_nodes(k, r.sequential)
        toks_BW = read_rows(r.seq_BS, r.s_B + mk, W)
        h_in = m.mtp_input(r.wins[mk - 1], r.wins[0])
        if not nodes:
            h_BTD, kv = m.mtp_forward(mk, h_in, toks_BW, r.pos_BW, cache=r.caches[mk - 1])
        else:
            # a node's input: its parent's row one level up (past the modules, the shallow ones recomputed as before)
            ins = [r.out(k - 1 if k <= r.used or tree.depth[v] >= r.used else r.used - 1, tree.parents[v])
                   for v in nodes]
            depth_O = jnp.asarray([tree.depth[v] for v in nodes], jnp.int32)
            pos_BO = (r.n_B - 1 - mk)[:, None] + depth_O[None, :]
            toks_BO = jnp.stack([r.tokens[v] for v in nodes], 1)
            sees_BTT = r.tree_mask(mk, sees(tree, nodes))
            h_BTD, kv = m.mtp_forward(mk, jnp.concatenate([h_in, jnp.stack(ins, 1)], 1),
                                      jnp.concatenate([toks_BW, toks_BO], 1),
                                      jnp.concatenate([r.pos_BW, pos_BO], 1), sees_BTT, cache=r.caches[mk - 1])
        r.caches = set_layer(r.caches, mk - 1, kv)
        r.wins[k] = h_BTD[:, :W]
        r.rows.update({(k, v): h_BTD[:, W + j] for j, v in enumerate(nodes)})
        r.h_BD = take_rows(r.wins[k], r.n_B - 2 - r.s_B)  # the row at the draft position

    def _continue(self, r: _Round, k: int) -> None:
        """A chain past the modules in use: the last module one row further, from its own output and the last draft
        (its cache holds the window and the rows before, all of the chain)."""
        m, used = r.m, r.used
        pos_B = r.n_B - 2 + (k - used)
        h_BTD, kv = m.mtp_forward(used, r.h_BD[:, None], r.tokens[k - 2][:, None], pos_B[:, None],
                                  cache=r.caches[used - 1])
        r.caches = set_layer(r.caches, used - 1, kv)
        r.h_BD = h_BTD[:, 0]

    def _children(self, r: _Round, k: int, parent: int) -> None:
        """Draft the children of `parent` (depth k-1): the top-b distinct tokens when greedy, else b i.i.d. draws
        from q; a chain's draft is written into the sequence, where the window's next module reads it."""
        kids = self.tree.children(parent)
        if not kids:
            return
        ctx, B = r.ctx, r.n_B.shape[0]
        h_BD = r.h_BD if parent < 0 or self.in_place() or not r.sequential else r.rows[k, parent]
        logits_BV = r.m.logits(r.m.head_norm(min(k, r.used), h_BD))
        if len(kids) == 1 or not ctx.sampler.greedy:
            for v in kids:
                r.tokens[v], r.qs[v] = choose(ctx.sampler, logits_BV, row_keys(ctx.key, 11 + v, ctx.it, B))
        else:
            top_BO = jax.lax.top_k(logits_BV, len(kids))[1].astype(jnp.int32)
            for j, v in enumerate(kids):
                r.tokens[v] = top_BO[:, j]
        if self.in_place():
            r.seq_BS = write_rows(r.seq_BS, r.tokens[kids[0]][:, None], r.n_B + k - 1)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each level runs its module over the window and its extra rows (a chain past the modules: one row); the
        head once per expanded node."""
        J, tree = f_target.mtp_depth, self.tree
        W, used = self.window(J), self.used(J)
        rows = sum(1 if k > used and self.in_place() else W + len(self.extra_nodes(k, True))
                   for k in range(1, tree.max_depth + 1))
        return rows * f_target.module + self._expanded() * f_target.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each level reads its module once (whatever its rows); the head once per expanded node."""
        return self.tree.max_depth * f_target.module_matmul + self._expanded() * f_target.head

    def _expanded(self) -> int:
        """Nodes whose children are drafted: the root and every node above the deepest level."""
        return 1 + len(self.tree.at_depth(1, self.tree.max_depth - 1)) if self.tree.size else 0


@dataclass(frozen=True)
class ModuleOneProposer(MTPProposer):
    """MTP module 1 drafting every depth, fed its own output (`--proposer mtp1`)."""

    modules: int = 1

    @staticmethod
    def most_drafts(target, draft=None) -> int:
        """One head in use when heads are parallel; else a draft past the modules' depth (module 1 continues)."""
        return 1 if target.cfg.mtp_kind == "parallel" else target.cfg.mtp_depth + 1


class _Round:
    """One round's drafting as it is traced: the window, each level's outputs, the drafts so far, the caches."""

    def __init__(self, m: MTPTransformer, ctx: Context, s_B, W: int, st: MTPState, used: int):
        self.m, self.ctx, self.s_B, self.W, self.used, self.n_B = m, ctx, s_B, W, used, ctx.n_B
        self.sequential, self.seq_BS, self.caches = m.cfg.mtp_kind == "sequential", ctx.seq_BS, st.caches
        self.pos_BW = s_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
        self.wins = {0: read_rows(st.h0_BSD, s_B, W)}  # level k's output over the window
        self.rows: dict = {}  # (level, node) -> that level's output at the node's extra row
        self.h_BD = None  # the row the last level drafts from
        self.tokens: dict = {}
        self.qs: dict = {}

    def out(self, level: int, node: int):
        """The level's output at the node's row (-1: the root's, where that level's module reads x[n-1])."""
        if node >= 0:
            return self.rows[level, node]
        return take_rows(self.wins[level], self.n_B - 1 - min(level, self.used) - self.s_B)

    def tree_mask(self, mk: int, sees_OO) -> jax.Array:
        """[B, W+O, W+O]: window rows causal; node rows see the window rows with committed inputs (position <=
        n-1-mk) and their own ancestors."""
        B, W, nodes = self.n_B.shape[0], self.W, sees_OO.shape[0]
        causal_WW = jnp.arange(W)[None, :] <= jnp.arange(W)[:, None]
        top_BWT = jnp.concatenate([jnp.broadcast_to(causal_WW, (B, W, W)), jnp.zeros((B, W, nodes), bool)], 2)
        committed_BW = self.pos_BW <= (self.n_B - 1 - mk)[:, None]
        bottom_BOT = jnp.concatenate([jnp.broadcast_to(committed_BW[:, None], (B, nodes, W)),
                                      jnp.broadcast_to(jnp.asarray(sees_OO), (B, nodes, nodes))], 2)
        return jnp.concatenate([top_BWT, bottom_BOT], 1)


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

    @classmethod
    def of(cls, shape: Tree | Hybrid) -> DraftModelProposer:
        return cls(nodes(shape))

    @staticmethod
    def most_drafts(target, draft=None) -> int:
        """A draft model k times narrower x shallower than the target drafts up to k tokens a round (at least 1)."""
        if draft is None:
            return 1
        t, d = target.cfg, draft.cfg
        return max(1, min(MAX_TREE_NODES, (t.d_model * t.n_layers) // (d.d_model * d.n_layers)))

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


PROPOSERS = {"mtp": MTPProposer, "mtp1": ModuleOneProposer, "ngram": NgramProposer, "model": DraftModelProposer}


def make_proposer(name: str, shape: Tree | Hybrid) -> Proposer:
    """The proposer a request names drafting `shape`; the empty tree is plain decoding whatever the name."""
    return Plain() if shape == PLAIN else PROPOSERS[name].of(shape)
