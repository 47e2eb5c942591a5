"""Draft trees from the MTP modules: the module at depth k extends every node of depth k-1 from its parent's token and
hidden state (sequential modules), or every node from the trunk's state (parallel heads, which read no token).

Level k (drafting depth k) runs module m(k) = min(k, modules in use) once over a window of committed rows and one
row per tree node of depths 1..k-1, each row seeing the committed rows and its own ancestors. A node of depth e sits
where that module reads its token (position n-1+e-m); its input state is the previous level's output at its
parent's row (past the modules in use the last one continues from its own output, as the chain does). Rows whose
inputs are not committed are written past every committed entry, so no tree row outlives its round: each round
recomputes the window, and a window of depth + modules rows covers every entry a round can commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mtpjax.decode.cache import module_caches, read_rows, set_layer, take_rows, write_rows
from mtpjax.decode.protocol import Context, Draft, Models, Proposer
from mtpjax.decode.proposers import MTPState, NgramProposer, lookup
from mtpjax.decode.sampling import choose, probs, row_keys
from mtpjax.decode.tree import Tree
from mtpjax.nn.flops import TokenFlops
from mtpjax.nn.model import MTPTransformer


@dataclass(frozen=True)
class TreeMTPProposer(Proposer):
    """The target's MTP modules drafting a static tree (`decode.tree`); `modules=1`: module 1 drafts every depth."""

    tree: Tree
    modules: int = 0
    ngram: int = 0  # hybrid: a chain of this many n-gram lookup drafts as the root's last branch

    @property
    def num_draft(self) -> int:
        return self.tree.size + self.ngram

    def parents(self) -> tuple[int, ...]:
        G = self.tree.size
        return self.tree.parents + tuple(-1 if i == 0 else G + i - 1 for i in range(self.ngram))

    def name(self) -> str:
        return self.tree.name() + (f"+ngram{self.ngram}" if self.ngram else "")

    def problem(self, target, draft) -> str | None:
        cfg = target.cfg
        if cfg.mtp_depth == 0:
            return "this model has no MTP modules (mtp_depth 0); use --proposer ngram or --num-draft 0"
        if cfg.mtp_kind == "parallel" and self.tree.max_depth > self.used(cfg.mtp_depth):
            return (f"tree {self.tree.name()} is {self.tree.max_depth} deep, beyond the {self.used(cfg.mtp_depth)} "
                    "parallel MTP heads in use; use a shallower --tree")
        return None

    def most_drafts(self, target) -> int:
        return self.tree.size

    def used(self, depth: int) -> int:
        return min(self.tree.max_depth, depth, self.modules or depth)

    def window(self, depth: int) -> int:
        """Committed rows each level recomputes a round: a round commits up to D+1 tokens (D: the deepest branch,
        the n-gram one included), and module k's rows lag the committed length by k."""
        return max(self.tree.max_depth, self.ngram) + self.used(depth)

    def start(self, models: Models, ctx: Context):
        cfg = models.target.cfg
        B, S = ctx.seq_BS.shape
        h0_BSD = write_rows(jnp.zeros((B, S, cfg.d_model), ctx.h_BTD.dtype), models.target.trunk_state(ctx.h_BTD),
                            ctx.h_start_B)
        state = MTPState(h0_BSD=h0_BSD, caches=module_caches(cfg, B, S))
        return self._draft(models.target, state, ctx, jnp.zeros((B,), jnp.int32), ctx.h_BTD.shape[1])

    def step(self, models: Models, state: MTPState, ctx: Context):
        state = state.replace(h0_BSD=write_rows(state.h0_BSD, models.target.trunk_state(ctx.h_BTD), ctx.h_start_B))
        W = self.window(models.target.cfg.mtp_depth)
        return self._draft(models.target, state, ctx, jnp.maximum(ctx.n_B - 1 - W, 0), W)

    def _draft(self, m: MTPTransformer, st: MTPState, ctx: Context, s_B, W: int):
        tree = self.tree
        used, seq = self.used(m.cfg.mtp_depth), m.cfg.mtp_kind == "sequential"
        n_B, pos_BW = ctx.n_B, s_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
        wins = {0: read_rows(st.h0_BSD, s_B, W)}  # level k's output over the window
        rows: dict = {}  # (level, node) -> that level's output at the node's row
        tokens_G: list = [None] * tree.size
        qs_G: list = [None] * tree.size
        caches = st.caches
        for k in range(1, tree.max_depth + 1):
            mk = min(k, used)
            nodes = tree.at_depth(1, k - 1) if seq else ()

            def out(level, node):
                if node >= 0:
                    return rows[level, node]
                return take_rows(wins[level], n_B - 1 - min(level, used) - s_B)  # the root's row

            ins = [out(k - 1 if k <= used or tree.depth[v] >= used else used - 1, tree.parents[v]) for v in nodes]
            win_in = wins[mk - 1]
            with jax.named_scope(f"draft{k}"):
                h_BWD, kv = self._level(m, mk, win_in, wins[0], pos_BW, n_B, s_B, nodes, ins, tokens_G,
                                        ctx.seq_BS, caches[mk - 1])
            caches = set_layer(caches, mk - 1, kv)
            wins[k] = h_BWD[:, :W]
            for j, v in enumerate(nodes):
                rows[k, v] = h_BWD[:, W + j]
            for parent in tree.at_depth(k - 1, k - 1) if k > 1 else (-1,):
                kids = tree.children(parent)
                if not kids:
                    continue
                src = -1 if not seq else parent  # parallel heads: every node extends from the trunk's row
                h_BD = out(k, src)
                logits_BV = m.logits(m.head_norm(mk, h_BD))
                toks, q = self._children(ctx, logits_BV, kids)
                for j, v in enumerate(kids):
                    tokens_G[v], qs_G[v] = toks[:, j], None if q is None else q
        if self.ngram:  # a point mass: its q is one-hot, so the rejection rule uses it as any other sibling's
            look_BL = lookup(ctx.seq_BS, n_B, self.ngram, NgramProposer(self.ngram).max_n)
            tokens_G += [look_BL[:, i] for i in range(self.ngram)]
            if qs_G[0] is not None:
                qs_G += [jax.nn.one_hot(look_BL[:, i], m.cfg.vocab_size, dtype=jnp.float32) for i in range(self.ngram)]
        return st.replace(caches=caches), Draft(jnp.stack(tokens_G, 1),
                                                None if qs_G[0] is None else jnp.stack(qs_G, 1))

    def _level(self, m, mk, win_in, h0_BWD, pos_BW, n_B, s_B, nodes, ins, tokens_G, seq_BS, cache):
        """Module mk over the window rows and the tree rows of `nodes`: (outputs, updated cache)."""
        W = pos_BW.shape[1]
        toks_BW = read_rows(seq_BS, s_B + mk, W)
        h_in = m.mtp_input(win_in, h0_BWD)
        if not nodes:
            return m.mtp_forward(mk, h_in, toks_BW, pos_BW, cache=cache)
        depth = jnp.asarray([self.tree.depth[v] for v in nodes], jnp.int32)
        pos_BN = (n_B - 1 - mk)[:, None] + depth[None, :]
        toks_BN = jnp.stack([tokens_G[v] for v in nodes], 1)
        h_BND = jnp.stack(ins, 1)
        N = len(nodes)
        # Window rows: causal. Tree rows: the window rows with committed inputs (position <= n-1-mk) and ancestors.
        causal_WW = jnp.arange(W)[None, :] <= jnp.arange(W)[:, None]
        top_BWT = jnp.concatenate([jnp.broadcast_to(causal_WW, (n_B.shape[0], W, W)),
                                   jnp.zeros((n_B.shape[0], W, N), bool)], 2)
        committed_BW = pos_BW <= (n_B - 1 - mk)[:, None]
        bottom_BNT = jnp.concatenate([jnp.broadcast_to(committed_BW[:, None], (n_B.shape[0], N, W)),
                                      jnp.broadcast_to(jnp.asarray(self.tree.sees(nodes)), (n_B.shape[0], N, N))], 2)
        sees_BTT = jnp.concatenate([top_BWT, bottom_BNT], 1)
        return m.mtp_forward(mk, jnp.concatenate([h_in, h_BND], 1), jnp.concatenate([toks_BW, toks_BN], 1),
                             jnp.concatenate([pos_BW, pos_BN], 1), sees_BTT, cache=cache)

    def _children(self, ctx: Context, logits_BV, kids: tuple[int, ...]):
        """A node's children: the top-b distinct tokens when greedy, else b i.i.d. draws from q (and q)."""
        if ctx.sampler.greedy:
            return jax.lax.top_k(logits_BV, len(kids))[1].astype(jnp.int32), None
        B = logits_BV.shape[0]
        q_BV = probs(ctx.sampler, logits_BV)
        toks = [choose(ctx.sampler, logits_BV, row_keys(ctx.key, 10 + v, ctx.it, B))[0] for v in kids]
        return jnp.stack(toks, 1), q_BV

    def draft_flops(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Level k runs its module over the window and the nodes above depth k; the head once per expanded node."""
        tree, W = self.tree, self.window(f_target.mtp_depth)
        rows = sum(W + len(tree.at_depth(1, k - 1)) for k in range(1, tree.max_depth + 1))
        expanded = 1 + len(tree.at_depth(1, tree.max_depth - 1))
        return rows * f_target.module + expanded * f_target.head

    def draft_reads(self, f_target: TokenFlops, f_draft: TokenFlops | None) -> float:
        """Each level reads its module once; the head once per expanded node."""
        expanded = 1 + len(self.tree.at_depth(1, self.tree.max_depth - 1))
        return self.tree.max_depth * f_target.module_matmul + expanded * f_target.head
