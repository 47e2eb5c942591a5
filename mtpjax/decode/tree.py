"""Verifying a static draft tree (mtpjax.drafts.Tree): the masks that verify it, the rules that walk it to its
longest accepted path (greedy match, recursive rejection), and its acceptance by depth and rank.

Node i (0-based, parents before children) continues node parents[i]; -1 is the last committed token, the root. In
the verification rows the root is row 0 and node i row i+1; a row sees the committed cache and its own ancestors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.drafts import Tree
from mtpjax.decode.cache import take_rows


def sees(tree: Tree, nodes: tuple[int, ...]) -> np.ndarray:
    """[T, T] bool: row r (node nodes[r]) sees row c when nodes[c] is nodes[r] or one of its ancestors."""
    anc = [tree.ancestors(v) for v in nodes]
    return np.array([[c in anc[r] for c in nodes] for r in range(len(nodes))], bool).reshape(len(nodes), len(nodes))


def verify_rows(tree: Tree):
    """(depth of each verification row, [Y,Y] mask of what each row sees): the root then the nodes."""
    nodes = (-1,) + tuple(range(tree.size))
    return np.array((0,) + tree.depth, np.int32), sees(tree, nodes)


def greedy_path(tree: Tree, drafts_BG, g_BY):
    """(accepted depth a_B, path_BY: the verification row at each depth 0..D, root first): a node is accepted when
    it and every ancestor equal the target's argmax after their parent; the path ends at the first deepest one
    (siblings from different sources may repeat a token: the path is then one of the equal ones)."""
    ok = []
    for i, p in enumerate(tree.parents):
        hit_B = drafts_BG[:, i] == g_BY[:, p + 1]
        ok.append(hit_B if p < 0 else hit_B & ok[p])
    B = drafts_BG.shape[0]
    if not ok:
        return jnp.zeros((B,), jnp.int32), jnp.zeros((B, 1), jnp.int32)
    depth_G = jnp.asarray(tree.depth, jnp.int32)
    score_BG = jnp.where(jnp.stack(ok, 1), depth_G[None], 0)
    a_B = score_BG.max(1).astype(jnp.int32)
    if tree.is_chain():  # one node per depth: the path is the rows in order
        return a_B, jnp.broadcast_to(jnp.arange(tree.max_depth + 1, dtype=jnp.int32), (B, tree.max_depth + 1))
    best_B = jnp.argmax(score_BG, axis=1)
    table = np.zeros((tree.size, tree.max_depth + 1), np.int32)  # node -> its verification row at each depth
    for v in range(tree.size):
        u = v
        while u >= 0:
            table[v, tree.depth[u]] = u + 1
            u = tree.parents[u]
    path_BY = jnp.where(a_B[:, None] > 0, jnp.asarray(table)[best_B], 0)
    return a_B, path_BY


def accepted_nodes(tree: Tree, a_B, path_BY):
    """[B, G] bool: the nodes on each row's accepted path."""
    depth_G = jnp.asarray(tree.depth, jnp.int32)
    row_BG = jnp.take_along_axis(path_BY, jnp.broadcast_to(depth_G[None], (a_B.shape[0], tree.size)), axis=1)
    return (depth_G[None] <= a_B[:, None]) & (row_BG == jnp.arange(1, tree.size + 1)[None])


def acceptance_by_depth_rank(tree: Tree, accepted_by_node, reached_by_depth) -> list[list[float]]:
    """a[d][r] as nn.speed.expected_tokens reads it: the share of the rounds that reached depth d+1 in which
    its rank-r node (summed over the parents at that depth) was the one accepted."""
    parents = [(-1,) if d == 0 else tree.at_depth(d, d) for d in range(tree.max_depth)]
    out = [[0.0] * max(len(tree.children(p)) for p in ps) for ps in parents]
    for v in range(tree.size):
        d, r = tree.depth[v] - 1, tree.rank[v]
        out[d][r] += accepted_by_node[v] / reached_by_depth[d] if reached_by_depth[d] else 0.0
    return out


def residual(p_BV, q_BV):
    """The target left after a draft from q is rejected: norm(max(p - q, 0)) (p itself where nothing is left)."""
    r_BV = jnp.maximum(p_BV - q_BV, 0.0)
    mass = r_BV.sum(-1, keepdims=True)
    return jnp.where(mass > 0, r_BV / jnp.where(mass > 0, mass, 1.0), p_BV)


def sampled_path(tree: Tree, drafts_BG, q_BGV, p_BYV, u_BG):
    """(a_B, path_BY, the distribution the token after the path is drawn from) by recursive rejection (SpecInfer):
    from the root, each child in rank order is accepted with min(1, p(x)/q(x)) for the q it was drawn from (siblings
    drawn independently); each rejection turns p into residual(p, q); accepting moves to the child and its fresh p;
    when every child is rejected, the token comes from what is left of p. Exact for any independent drafts."""
    B = drafts_BG.shape[0]
    kids = [tree.children(v) for v in range(-1, tree.size)]  # by verification row
    width = max(map(len, kids))
    table_YC = jnp.asarray([list(k) + [-1] * (width - len(k)) for k in kids], jnp.int32)
    cur_B, a_B = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32)
    stopped_B = jnp.zeros((B,), bool)
    left_BV = take_rows(p_BYV, cur_B)
    rows = [cur_B]
    for _ in range(tree.max_depth):
        p_BV, moved_B, nxt_B = take_rows(p_BYV, cur_B), jnp.zeros((B,), bool), cur_B
        for j in range(width):
            c_B = table_YC[cur_B, j]
            live_B = ~stopped_B & ~moved_B & (c_B >= 0)
            c_B = jnp.maximum(c_B, 0)
            x_B = take_rows(drafts_BG, c_B)
            q_BV = take_rows(q_BGV, c_B)
            px_B, qx_B = take_rows(p_BV, x_B), take_rows(q_BV, x_B)
            ok_B = live_B & (take_rows(u_BG, c_B) * qx_B < px_B)
            p_BV = jnp.where((live_B & ~ok_B)[:, None], residual(p_BV, q_BV), p_BV)
            moved_B, nxt_B = moved_B | ok_B, jnp.where(ok_B, c_B + 1, nxt_B)
        stop_now_B = ~stopped_B & ~moved_B
        left_BV = jnp.where(stop_now_B[:, None], p_BV, left_BV)
        stopped_B, cur_B, a_B = stopped_B | stop_now_B, nxt_B, a_B + moved_B
        rows.append(jnp.where(moved_B, nxt_B, 0))
    left_BV = jnp.where(stopped_B[:, None], left_BV, take_rows(p_BYV, cur_B))
    return a_B, jnp.stack(rows, 1), left_BV


def along(tree: Tree, x_BY, path_BY):
    """x's rows along each batch row's path (x may have trailing axes); a chain's path is its rows in order."""
    if tree.is_chain():
        return x_BY[:, : tree.max_depth + 1]
    return jax.vmap(lambda x, p: x[p])(x_BY, path_BY)
