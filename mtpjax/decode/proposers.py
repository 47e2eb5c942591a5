"""Proposers: small static objects that draft a tree a round, one class per drafting algorithm, each owning its
decode state (the contract: mtpjax.decode.protocol.Proposer). Draft.q_BGV is the exact distribution each draft was
sampled from, None when greedy (only the tokens matter there).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.decode.cache import module_caches, read_rows, set_layer, take_rows, trunk_cache, write_rows
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.sampling import choose, row_keys
from mtpjax.decode.tree import sees
from mtpjax.drafts import MAX_NODES, PLAIN, Source, Tree
from mtpjax.nn.flops import TokenFlops
from mtpjax.nn.model import MTPTransformer


def _stack(drafts: list, qs: list) -> Draft:
    return Draft(jnp.stack(drafts, 1), None if qs[0] is None else jnp.stack(qs, 1))


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


@struct.dataclass
class MTPState:
    h0_BSD: jax.Array  # the trunk's state as module 1 reads it (trunk_state) at every committed position
    caches: tuple  # one KV per MTP module


@dataclass(frozen=True)
class MTPProposer(Proposer):
    """What the MTP modules' two drafting algorithms share (MTPChainProposer, MTPTreeProposer): level k drafts depth k
    with module min(k, modules in use) over a window of committed rows ending at the draft position n-2, and the
    window's caches. `modules=1`: module 1 drafts every depth (vLLM, SGLang); 0 uses all J."""

    tree: Tree
    modules: int = 0

    @property
    def mtp(self) -> Tree:
        """The nodes the modules draft."""
        return self.tree.part("mtp")

    def impossible(self, target, draft) -> str | None:
        cfg = target.cfg
        if cfg.mtp_depth == 0:
            return "this model has no MTP modules (mtp_depth 0); use --proposer ngram or decode.draft=0"
        heads, D = self.in_use(cfg.mtp_depth), self.mtp.max_depth
        if cfg.mtp_kind == "parallel" and D > heads:
            return (f"draft {self.tree.name()} is {D} deep, beyond the {heads} parallel MTP heads in use; "
                    f"draft at most {heads} deep (decode.draft)")
        return None

    def in_use(self, depth: int) -> int:
        """Modules that draft from a recomputed window (deeper levels reuse the last of them)."""
        return min(self.mtp.max_depth, depth, self.modules or depth)

    def window(self, depth: int) -> int:
        """Committed rows each module recomputes a round, ending at the draft position n-2."""
        raise NotImplementedError

    def extra_nodes(self, k: int, sequential: bool) -> tuple[int, ...]:
        """The nodes level k runs rows for beside the window."""
        raise NotImplementedError

    def start(self, models: Models, ctx: Context):
        (B, S), cfg = ctx.seq_BS.shape, models.target.cfg
        state = MTPState(jnp.zeros((B, S, cfg.d_model), ctx.h_BTD.dtype), module_caches(cfg, B, S))
        return self._step(models, state, ctx, jnp.zeros((B,), jnp.int32), ctx.h_BTD.shape[1])

    def step(self, models: Models, state: MTPState, ctx: Context):
        W = self.window(models.target.cfg.mtp_depth)
        return self._step(models, state, ctx, jnp.maximum(ctx.n_B - 1 - W, 0), W)

    def _step(self, models: Models, state: MTPState, ctx: Context, s_B, W: int):
        """Store the trunk's new states, then draft from the window [s, s+W)."""
        m = models.target
        h0_BSD = write_rows(state.h0_BSD, m.trunk_state(ctx.h_BTD), ctx.h_start_B)
        return self._draft_from(m, state.replace(h0_BSD=h0_BSD), ctx, s_B, W)

    def _draft_from(self, m: MTPTransformer, state: MTPState, ctx: Context, s_B, W: int):
        """(state, drafts) of one round drafted from the window [s, s+W) of the stored states."""
        r = _Round(m, ctx, s_B, W, state, self.in_use(m.cfg.mtp_depth))
        tokens, qs = self._draft(r)
        return state.replace(caches=r.caches), _stack(tokens, qs)

    def _draft(self, r: _Round) -> tuple[list, list]:
        """(each node's tokens, the distributions they were drawn from) of one round."""
        raise NotImplementedError

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
            last = r.last_module
            ins = [r.out(k - 1 if k <= last or tree.depth[v] >= last else last - 1, tree.parents[v]) for v in nodes]
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

    def _children(self, r: _Round, k: int, parent: int, h_BD) -> tuple[int, ...]:
        """Draft the children of `parent` (depth k-1) from its row h_BD: the top-b distinct tokens when greedy, else
        b i.i.d. draws from q. Returns the children."""
        kids = self.tree.children(parent)
        ctx, B = r.ctx, r.n_B.shape[0]
        logits_BV = r.m.logits(r.m.head_norm(min(k, r.last_module), h_BD))
        if len(kids) == 1 or not ctx.sampler.greedy:
            for v in kids:
                r.tokens[v], r.qs[v] = choose(ctx.sampler, logits_BV, row_keys(ctx.key, 11 + v, ctx.it, B))
        else:
            top_BO = jax.lax.top_k(logits_BV, len(kids))[1].astype(jnp.int32)
            for j, v in enumerate(kids):
                r.tokens[v] = top_BO[:, j]
        return kids

    def level_rows(self, k: int, f_target: TokenFlops) -> int:
        """Rows level k runs its module over."""
        return self.window(f_target.mtp_depth) + len(self.extra_nodes(k, True))

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each level runs its module over its rows; the head once per expanded node."""
        rows = sum(self.level_rows(k, f_target) for k in range(1, self.mtp.max_depth + 1))
        return rows * f_target.module + self._expanded() * f_target.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each level reads its module once (whatever its rows); the head once per expanded node."""
        return self.mtp.max_depth * f_target.module_matmul + self._expanded() * f_target.head

    def _expanded(self) -> int:
        """Nodes whose children are drafted: the root and every node above the deepest level."""
        return 1 + len(self.mtp.at_depth(1, self.mtp.max_depth - 1)) if self.mtp.size else 0


@dataclass(frozen=True)
class MTPChainProposer(MTPProposer):
    """The MTP modules drafting a chain in place: each draft is written into the sequence at its own position, where
    the window's next module reads it, so the window needs no rows of its own for the nodes; past the modules in
    use the last one continues one row at a time."""

    def window(self, depth: int) -> int:
        """A round commits up to γ+1 tokens, whose entries every module must now compute; those built from accepted
        drafts are already right, so γ+1 rows cover them (fewer leave entries a later query reads stale)."""
        return self.tree.max_depth + 1

    def extra_nodes(self, k: int, sequential: bool) -> tuple[int, ...]:
        return ()

    def _draft(self, r: _Round) -> tuple[list, list]:
        for k in range(1, self.tree.max_depth + 1):
            with jax.named_scope(f"draft{k}"):  # profiles attribute time per depth
                if k > r.last_module:
                    self._continue(r, k)
                else:
                    self._level(r, k, k)
                (v,) = self._children(r, k, k - 2, r.h_BD)
                r.seq_BS = write_rows(r.seq_BS, r.tokens[v][:, None], r.n_B + k - 1)
        return [r.tokens[v] for v in range(self.tree.size)], [r.qs.get(v) for v in range(self.tree.size)]

    def _continue(self, r: _Round, k: int) -> None:
        """Past the modules in use: the last module one row further, from its own output and the last draft (its
        cache holds the window and the rows before, all of the chain)."""
        m, last = r.m, r.last_module
        pos_B = r.n_B - 2 + (k - last)
        h_BTD, kv = m.mtp_forward(last, r.h_BD[:, None], r.tokens[k - 2][:, None], pos_B[:, None],
                                  cache=r.caches[last - 1])
        r.caches = set_layer(r.caches, last - 1, kv)
        r.h_BD = h_BTD[:, 0]

    def level_rows(self, k: int, f_target: TokenFlops) -> int:
        return 1 if k > self.in_use(f_target.mtp_depth) else self.window(f_target.mtp_depth)


@dataclass(frozen=True)
class MTPTreeProposer(MTPProposer):
    """The MTP modules drafting a wider tree: its nodes are extra rows beside the window, each seeing its ancestors
    (docs/decoding.md §Draft trees); n-gram nodes (a hybrid) are lookup's chain as the root's last branch (a point
    mass: its q is one-hot)."""

    def window(self, depth: int) -> int:
        """A round commits up to D+1 tokens (D: the deepest branch, the n-gram one included); a tree's nodes were
        written elsewhere and module k's rows lag the committed length by k, so D + modules in use rows."""
        return max(self.mtp.max_depth, self.tree.count("ngram")) + self.in_use(depth)

    def extra_nodes(self, k: int, sequential: bool) -> tuple[int, ...]:
        """A tree's depths 1..k-1 (none for parallel heads, which read no token)."""
        return self.mtp.at_depth(1, k - 1) if sequential else ()

    def _draft(self, r: _Round) -> tuple[list, list]:
        for k in range(1, self.mtp.max_depth + 1):
            with jax.named_scope(f"draft{k}"):  # profiles attribute time per depth
                self._level(r, k, min(k, r.last_module))
                for parent in self.mtp.at_depth(k - 1, k - 1) if k > 1 else (-1,):
                    if self.mtp.children(parent):
                        self._children(r, k, parent, r.h_BD if parent < 0 or not r.sequential else r.rows[k, parent])
        G, L = self.mtp.size, self.tree.count("ngram")
        tokens, qs = [r.tokens[v] for v in range(G)], [r.qs.get(v) for v in range(G)]
        if L:
            look_BG = lookup(r.ctx.seq_BS, r.ctx.n_B, L, NgramProposer.max_n)
            tokens += [look_BG[:, i] for i in range(L)]
            if not r.ctx.sampler.greedy:
                qs += [jax.nn.one_hot(look_BG[:, i], r.m.cfg.vocab_size, dtype=jnp.float32) for i in range(L)]
        return tokens, qs


class _Round:
    """One round's drafting as it is traced: the window, each level's outputs, the drafts so far, the caches."""

    def __init__(self, m: MTPTransformer, ctx: Context, s_B, W: int, st: MTPState, last_module: int):
        self.m, self.ctx, self.s_B, self.W, self.last_module, self.n_B = m, ctx, s_B, W, last_module, ctx.n_B
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
        return take_rows(self.wins[level], self.n_B - 1 - min(level, self.last_module) - self.s_B)

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
        return cache, _stack(drafts, qs)

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """The catch-up rows, γ-1 single-row steps, and the draft model's head once per draft."""
        G = self.tree.size
        return (self.catch_up() + G - 1) * f_draft.trunk + G * f_draft.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """γ calls of the draft model (the catch-up and γ-1 steps), each reading its weights once."""
        return self.tree.size * (f_draft.trunk_matmul + f_draft.head)


def model_drafts(target: MTPTransformer, draft: MTPTransformer | None) -> int:
    """A draft model k times narrower x shallower than the target drafts up to k tokens a round (at least 1)."""
    if draft is None:
        return 1
    t, d = target.cfg, draft.cfg
    return max(1, min(MAX_NODES, (t.d_model * t.n_layers) // (d.d_model * d.n_layers)))


def mtp_proposer(modules: int) -> Callable[[Tree], MTPProposer]:
    """The MTP modules' proposer for a tree: in place for a chain, extra rows for anything wider or a hybrid."""
    return lambda tree: (MTPChainProposer if tree == tree.part("mtp") and tree.is_chain() else MTPTreeProposer)(
        tree, modules)


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
