"""The MTP modules' proposers: level k drafts depth k with module min(k, modules in use) from the committed rows'
stored trunk states; a chain in place (MTPChainProposer), anything wider or a hybrid with extra rows (MTPTreeProposer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.decode.cache import module_caches, read_rows, set_layer, take_rows, write_rows
from mtpjax.decode.ngram import NgramProposer, lookup
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.sampling import choose, row_keys
from mtpjax.decode.tree import sees
from mtpjax.drafts import Tree
from mtpjax.nn.flops import TokenFlops
from mtpjax.nn.model import MTPTransformer


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
        return state.replace(caches=r.caches), Draft.stacked(tokens, qs)

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



def mtp_proposer(modules: int) -> Callable[[Tree], MTPProposer]:
    """The MTP modules' proposer for a tree: in place for a chain, extra rows for anything wider or a hybrid."""
    return lambda tree: (MTPChainProposer if tree == tree.part("mtp") and tree.is_chain() else MTPTreeProposer)(
        tree, modules)
