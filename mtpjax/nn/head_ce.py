"""The shared head fused with its cross-entropy (TPU, Pallas Mosaic): logits made a tile at a time in on-chip memory.

`head_cross_entropy(h_ID, w, tgt_I, plan)` returns what `cross_entropy(head_product(h, w), tgt)` and the logits'
first argmax return, without writing a float32 logit to HBM: XLA writes the head's logits, then reads them for the
row max, the exp-sum and the argmax, and its backward writes and reads them again (about 10 GB of `small`'s 48.6 GB
per chip and step on a v6e-8). Forward kernel: per tile of rows, the vocabulary in tiles, an online logsumexp, the
target's logit and the first argmax. Backward kernel: the tile's logits recomputed, the softmax's gradient
(softmax − one-hot, times the row's cotangent) written once in the compute dtype for the weight's gradient (one XLA
product) and multiplied into the rows' gradient in place. On a mesh each device runs its rows and its vocabulary
shard (`jax.shard_map`); the shards' statistics combine over the vocabulary axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtpjax.nn.model import head_weight_grad

LANES = 128  # a row's statistics are held as [rows, 128] (the lane width), as Pallas's TPU flash attention holds them
NAME = "mtpjax_head_ce"  # the kernels' names (then _fwd or _bwd, _tile<rows>), which parallel.hlo reads


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the fused head runs: the weight's layout ([V,D] when tied to the embedding), the tiles, interpret mode
    (a CPU), and the mesh axes the rows and the vocabulary split over (none: one device)."""

    vocab_first: bool
    interpret: bool = False
    rows: int = 1024
    vocab: int = 512
    mesh: Mesh | None = None
    row_axes: tuple[str, ...] | None = None
    vocab_axis: str | None = None

    def vocab_size(self, w) -> int:
        """The vocabulary `w` holds (a device's shard of it inside the shard_map)."""
        return w.shape[0] if self.vocab_first else w.shape[1]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _tile_logits(h_ref, w_ref, vocab_first: bool):
    """float32 [rows, vocab tile]: the tile's logits."""
    dims = (((1,), (1,)), ((), ())) if vocab_first else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(h_ref[...], w_ref[...], dims, preferred_element_type=jnp.float32)


def _tile(h_ref, w_ref, t_ref, j, tv: int, V: int, vocab_first: bool):
    """The tile's (vocabulary ids, logits with ids past V (padding) at -inf, where each row's target is, lanes a
    per-row value repeats over to span the tile)."""
    s = _tile_logits(h_ref, w_ref, vocab_first)
    col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) + j * tv
    s = s if V % tv == 0 else jnp.where(col < V, s, -jnp.inf)
    reps = tv // LANES
    return col, s, col == jnp.tile(t_ref[...], (1, reps)), reps


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, tl_ref, av_ref, ai_ref, *, tv: int, V: int, vocab_first: bool):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _start():
        for ref, v in ((m_ref, -jnp.inf), (l_ref, 0.0), (tl_ref, 0.0), (av_ref, -jnp.inf), (ai_ref, 0.0)):
            ref[...] = jnp.full(ref.shape, v, jnp.float32)

    col, s, hit, reps = _tile(h_ref, w_ref, t_ref, j, tv, V, vocab_first)
    tl_ref[...] += jnp.sum(jnp.where(hit, s, 0.0), axis=1)[:, None]
    smax = jnp.max(s, axis=1)[:, None]
    first = jnp.min(jnp.where(s == smax, col.astype(jnp.float32), float(V)), axis=1)[:, None]
    better = smax > av_ref[...]  # strictly: an earlier tile keeps a tie (argmax's first index)
    ai_ref[...] = jnp.where(better, first, ai_ref[...])
    av_ref[...] = jnp.where(better, smax, av_ref[...])
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, smax)
    p_sum = jnp.sum(jnp.exp(s - jnp.tile(m_next, (1, reps))), axis=1)[:, None]
    l_ref[...] = l_ref[...] * jnp.exp(m_prev - m_next) + p_sum
    m_ref[...] = m_next


def _bwd_kernel(h_ref, w_ref, t_ref, lse_ref, d_ref, dh_ref, g_ref, *, tv: int, V: int, vocab_first: bool):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _start():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    _, s, hit, reps = _tile(h_ref, w_ref, t_ref, j, tv, V, vocab_first)
    p = jnp.exp(s - jnp.tile(lse_ref[...], (1, reps)))
    g = ((p - jnp.where(hit, 1.0, 0.0)) * jnp.tile(d_ref[...], (1, reps))).astype(g_ref.dtype)
    g_ref[...] = g
    dims = (((1,), (0,)), ((), ())) if vocab_first else (((1,), (1,)), ((), ()))
    dh_ref[...] += jax.lax.dot_general(g, w_ref[...], dims, preferred_element_type=jnp.float32)


def _lanes(x_I, rows: int):
    """A per-row vector as the kernels hold it: [rows padded, 128], the value repeated along the lanes."""
    x_I = jnp.pad(x_I, (0, rows - x_I.shape[0]))
    return jnp.broadcast_to(x_I[:, None], (rows, LANES))


VMEM_LIMIT = 32 * 2**20  # the kernels' on-chip memory (every TPU generation has at least this much)


def _vmem(tr: int, tv: int, D: int, item: int) -> int:
    """Bytes a (tr, tv) tiling holds on chip: the blocks double-buffered (rows, the weight's tile, the rows' float32
    gradient, the softmax gradient's tile, the per-row vectors) and the logits tile's float32 temporaries."""
    return 2 * (tr * D * item + tv * D * item + tr * D * 4 + tr * tv * item + 5 * tr * LANES * 4) + 5 * tr * tv * 4


def tiles(n: int, V: int, D: int, item: int, plan: Plan) -> tuple[int, int]:
    """(row tile, vocabulary tile): the plan's, halved (the vocabulary's first, to 128; then the rows', to 8) until
    they fit in three quarters of VMEM_LIMIT; no larger than the rows and the vocabulary need."""
    tr, tv = min(plan.rows, _round_up(n, 8)), min(plan.vocab, _round_up(V, LANES))
    while _vmem(tr, tv, D, item) > VMEM_LIMIT * 3 // 4 and (tv > LANES or tr > 8):
        tv, tr = (tv // 2, tr) if tv > LANES else (tv, max(8, tr // 2))
    return tr, tv


def _call(kernel, h_ID, w, row_vecs, outs, plan: Plan, name: str):
    """`kernel` over a grid of (row tile, vocabulary tile), rows and vocabulary padded to whole tiles."""
    n, D = h_ID.shape
    V = plan.vocab_size(w)
    tr, tv = tiles(n, V, D, h_ID.dtype.itemsize, plan)
    Ip, Vp = _round_up(n, tr), _round_up(V, tv)
    h_ID = jnp.pad(h_ID, ((0, Ip - n), (0, 0)))
    w = jnp.pad(w, ((0, Vp - V), (0, 0)) if plan.vocab_first else ((0, 0), (0, Vp - V)))
    row_spec = pl.BlockSpec((tr, LANES), lambda i, j: (i, 0))
    w_spec = (pl.BlockSpec((tv, D), lambda i, j: (j, 0)) if plan.vocab_first
              else pl.BlockSpec((D, tv), lambda i, j: (0, j)))
    specs = {"row": row_spec, "dh": pl.BlockSpec((tr, D), lambda i, j: (i, 0)),
             "g": pl.BlockSpec((tr, tv), lambda i, j: (i, j))}
    shapes = {"row": (Ip, LANES), "dh": (Ip, D), "g": (Ip, Vp)}
    out = pl.pallas_call(
        functools.partial(kernel, tv=tv, V=V, vocab_first=plan.vocab_first),
        grid=(Ip // tr, Vp // tv),
        in_specs=[pl.BlockSpec((tr, D), lambda i, j: (i, 0)), w_spec] + [row_spec] * len(row_vecs),
        out_specs=[specs[k] for k, _ in outs],
        out_shape=[jax.ShapeDtypeStruct(shapes[k], dt) for k, dt in outs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=plan.interpret, name=f"{name}_tile{tr}",  # parallel.hlo reads the row tile from the name
    )(h_ID, w, *(_lanes(v, Ip) for v in row_vecs))
    return [o[:n, :V] if k == "g" else o[:n] if k == "dh" else o[:n, 0] for o, (k, _) in zip(out, outs)]


def _local(plan: Plan, tgt_I, V_local: int):
    """(targets as ids within this device's vocabulary shard, -1 where another shard holds them; the shard's first
    id)."""
    off = jax.lax.axis_index(plan.vocab_axis) * V_local if plan.vocab_axis else 0
    return jnp.where((tgt_I >= off) & (tgt_I < off + V_local), tgt_I - off, -1).astype(jnp.int32), off


def _fwd_local(plan: Plan, h_ID, w, tgt_I):
    """One device's (ce, first argmax, logsumexp) over its rows, its shard's statistics combined over the vocabulary
    axis."""
    t, off = _local(plan, tgt_I, plan.vocab_size(w))
    mx, sumexp, picked, best, arg = _call(_fwd_kernel, h_ID, w, [t], [("row", jnp.float32)] * 5, plan, f"{NAME}_fwd")
    arg = arg.astype(jnp.int32) + off
    if plan.vocab_axis:  # the shards' logsumexp merged; the target's logit is one shard's; the first of the maxima
        ax = plan.vocab_axis
        mx_all = jax.lax.pmax(mx, ax)
        sumexp, picked = jax.lax.psum(sumexp * jnp.exp(mx - mx_all), ax), jax.lax.psum(picked, ax)
        best_all = jax.lax.pmax(best, ax)
        arg, mx = jax.lax.pmin(jnp.where(best == best_all, arg, jnp.iinfo(jnp.int32).max), ax), mx_all
    lse = jnp.log(sumexp) + mx
    return lse - picked, arg, lse


def _bwd_local(plan: Plan, h_ID, w, tgt_I, lse_I, d_I):
    """One device's (rows' gradient, its rows' × shard's softmax gradient in the compute dtype)."""
    t = _local(plan, tgt_I, plan.vocab_size(w))[0]
    dh, g = _call(_bwd_kernel, h_ID, w, [t, lse_I, d_I.astype(jnp.float32)],
                  [("dh", jnp.float32), ("g", h_ID.dtype)], plan, f"{NAME}_bwd")
    return (jax.lax.psum(dh, plan.vocab_axis) if plan.vocab_axis else dh), g


def _per_device(plan: Plan, body, args, specs, out_specs):
    """`body` on each device's rows and vocabulary shard (jax.shard_map), or directly off a mesh."""
    if plan.mesh is None or plan.mesh.size == 1:
        return body(*args)
    return jax.shard_map(body, mesh=plan.mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)


def _specs(plan: Plan):
    r, v = plan.row_axes, plan.vocab_axis
    return P(r, None), (P(v, None) if plan.vocab_first else P(None, v)), P(r), P(r, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def head_cross_entropy(h_ID, w, tgt_I, plan: Plan):
    """(cross-entropy float32[I], first argmax int32[I]) of the logits h @ w (w [V,D] when plan.vocab_first) against
    the targets, the logits never written to HBM."""
    return _head_ce_fwd(h_ID, w, tgt_I, plan)[0]


def _head_ce_fwd(h_ID, w, tgt_I, plan: Plan):
    h_spec, w_spec, r_spec, _ = _specs(plan)
    ce, ai, lse = _per_device(plan, functools.partial(_fwd_local, plan), (h_ID, w, tgt_I),
                              (h_spec, w_spec, r_spec), (r_spec, r_spec, r_spec))
    return (ce, ai), (h_ID, w, tgt_I, lse)


def _head_ce_bwd(plan: Plan, res, cot):
    h_ID, w, tgt_I, lse = res
    h_spec, w_spec, r_spec, g_spec = _specs(plan)
    dh, g_IV = _per_device(plan, functools.partial(_bwd_local, plan), (h_ID, w, tgt_I, lse, cot[0]),
                           (h_spec, w_spec, r_spec, r_spec, r_spec), (h_spec, g_spec))
    dw = head_weight_grad(h_ID, g_IV, plan.vocab_first)
    return dh.astype(h_ID.dtype), dw.astype(w.dtype), None


head_cross_entropy.defvjp(_head_ce_fwd, _head_ce_bwd)
