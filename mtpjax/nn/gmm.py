"""The MoE's grouped matmul with its own gradients: rows sorted by group, each group's rows times its own matrix.

`grouped_matmul(x_ID, w_EDF, sizes_E, kernel)` computes what `jax.lax.ragged_dot` computes (rows past the groups'
total give zeros). A custom_vjp makes all three matmuls of a backward the kernel's: the input gradient is the same
grouped matmul with each group's matrix transposed, the weight gradient a transposed grouped matmul (tgmm: per group,
its rows' lhsᵀ·dout; an empty group's gradient is zeros).

- TPU: Mosaic megablox (`jax.experimental.pallas.ops.tpu.megablox`'s gmm and tgmm).
- GPU: Pallas-Triton kernels written here. Hopper's Mosaic GPU `ragged_dot_mgpu` has no interpret mode, so it could
  not be checked on a machine without a GPU; these run under `interpret=True` on a CPU and compile for H100 through
  XLA's Triton pipeline.
- CPU: not here (moe.grouped_swiglu's expert blocks).

Shapes: m rows, contracted width k, output width n, E groups (experts). Both kernels walk work items: (group, row
tile) for every row tile a group's rows touch, at most m/tm + E - 1 of them; a tile shared by two
groups is visited once per group, each storing only its own rows (row masks).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A grouped-matmul kernel: "megablox" (Mosaic TPU) or "triton" (Pallas GPU); `interpret`: Pallas interpret mode
    (runs on a CPU)."""

    name: str
    interpret: bool = False


KERNELS = {"tpu": "megablox", "gpu": "triton"}
NAMES = ("mtpjax_gmm", "mtpjax_tgmm")  # the Triton kernels' names, which the compiled program's custom calls carry


def kernel_for(platform: str) -> Kernel | None:
    """The platform's grouped-matmul kernel, None on CPU."""
    return Kernel(KERNELS[platform]) if platform in KERNELS else None


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    t = cap
    while n % t:
        t //= 2
    return t


def tiles(kernel: Kernel, m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) from the shapes. Triton: powers of two >= 16 (its dot's minimum) dividing k and n where one does,
    rows padded up to tm. Mosaic: row tiles a multiple of 128 (tgmm reads lhsᵀ, rows minor) or all rows; k and n
    whole up to 1024 (megablox masks an irregular last tile)."""
    if kernel.name == "triton":
        tm = 64 if m >= 64 else max(16, 1 << (m - 1).bit_length())
        return tm, max(16, _pow2_divisor(k, 64)), max(16, _pow2_divisor(n, 128))
    return min(512, -(-m // 128) * 128), min(k, 1024), min(n, 1024)


def work_items(sizes_E, m: int, tm: int):
    """(each item's group, its row tile) and each group's [start, end) rows with a sentinel group E of no rows:
    items past the last real one point at it (they load and store nothing)."""
    E = sizes_E.shape[0]
    end = jnp.cumsum(sizes_E)
    start = end - sizes_E
    first = start // tm
    n_tiles = jnp.where(sizes_E > 0, (end - 1) // tm - first + 1, 0)
    item_end = jnp.cumsum(n_tiles)
    w = jnp.arange(m // tm + E - 1)
    g = jnp.searchsorted(item_end, w, side="right").astype(jnp.int32)  # E past the last item
    gc = jnp.minimum(g, E - 1)
    t = jnp.where(g < E, first[gc] + w - (item_end - n_tiles)[gc], 0).astype(jnp.int32)
    bounds = lambda v: jnp.concatenate([v, jnp.zeros((1,), jnp.int32)]).astype(jnp.int32)
    return g, t, bounds(start), bounds(end)


def _gmm_kernel(g_ref, t_ref, start_ref, end_ref, x_ref, w_ref, out_ref, *, tm, tk, tn, transpose):
    """out tile (item w, column tile j) = the item's group's rows of x times that group's matrix (rows masked)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    w, j = pl.program_id(0), pl.program_id(1)
    g, t = g_ref[w], t_ref[w]
    rows = t * tm + jnp.arange(tm)
    live = ((rows >= start_ref[g]) & (rows < end_ref[g]))[:, None]
    k = x_ref.shape[1]

    def body(i, acc):
        a = plgpu.load(x_ref.at[pl.ds(t * tm, tm), pl.ds(i * tk, tk)], mask=live, other=0.0)
        if transpose:
            b = plgpu.load(w_ref.at[g, pl.ds(j * tn, tn), pl.ds(i * tk, tk)]).T
        else:
            b = plgpu.load(w_ref.at[g, pl.ds(i * tk, tk), pl.ds(j * tn, tn)])
        return acc + plgpu.dot(a, b.astype(a.dtype))

    @pl.when(g < w_ref.shape[0])  # the sentinel's items (past the last real one) read and write nothing
    def _():
        acc = jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tm, tn), jnp.float32))
        plgpu.store(out_ref.at[pl.ds(t * tm, tm), pl.ds(j * tn, tn)], acc.astype(out_ref.dtype), mask=live)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, tm, tk, tn):
    """out[g] tile (i, j) = the sum over group g's row tiles of lhs[rows, i-tile]ᵀ · dout[rows, j-tile]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s, e = start_ref[g], end_ref[g]

    def body(t, acc):
        rows = t * tm + jnp.arange(tm)
        live = ((rows >= s) & (rows < e))[:, None]
        a = plgpu.load(lhs_ref.at[pl.ds(t * tm, tm), pl.ds(i * tk, tk)], mask=live, other=0.0)
        b = plgpu.load(dout_ref.at[pl.ds(t * tm, tm), pl.ds(j * tn, tn)], mask=live, other=0.0)
        return acc + plgpu.dot(a.T, b.astype(a.dtype))

    first = s // tm
    last = jnp.where(e > s, (e + tm - 1) // tm, first)  # an empty group: no tile, a zero gradient
    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((tk, tn), jnp.float32))
    plgpu.store(out_ref.at[g, pl.ds(i * tk, tk), pl.ds(j * tn, tn)], acc.astype(out_ref.dtype))


def _triton_call(body, grid, out_shape, name, interpret, *args):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl.pallas_call(body, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3))(*args)


def triton_gmm(x_ID, w_EDF, sizes_E, *, transpose=False, interpret=False):
    """lhs rows times their group's matrix (transposed: rhs is [E, n, k]); sum(sizes) == m, m a multiple of tm."""
    m, k = x_ID.shape
    n = w_EDF.shape[1] if transpose else w_EDF.shape[2]
    tm, tk, tn = tiles(Kernel("triton"), m, k, n)
    g, t, start, end = work_items(sizes_E, m, tm)
    body = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, transpose=transpose)
    return _triton_call(body, (g.shape[0], n // tn), jax.ShapeDtypeStruct((m, n), x_ID.dtype), NAMES[0], interpret,
                        g, t, start, end, x_ID, w_EDF)


def triton_tgmm(x_ID, dy_IF, sizes_E, *, interpret=False):
    """Per group, its rows' lhsᵀ · dout: [E, k, n] (the weight gradient)."""
    (m, k), n, E = x_ID.shape, dy_IF.shape[1], sizes_E.shape[0]
    tm, tk, tn = tiles(Kernel("triton"), m, k, n)
    _, _, start, end = work_items(sizes_E, m, tm)
    body = functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn)
    return _triton_call(body, (E, k // tk, n // tn), jax.ShapeDtypeStruct((E, k, n), x_ID.dtype), NAMES[1],
                        interpret, start, end, x_ID, dy_IF)


def _products(kernel: Kernel):
    """(gmm(lhs, rhs, sizes, transpose), tgmm(lhs, dout, sizes)) of a kernel, tiles from each call's shapes."""
    if kernel.name == "triton":
        return (functools.partial(triton_gmm, interpret=kernel.interpret),
                functools.partial(triton_tgmm, interpret=kernel.interpret))
    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")  # the package exports a gmm

    def gmm(lhs, rhs, sizes, transpose=False):
        tiling = tiles(kernel, lhs.shape[0], lhs.shape[1], rhs.shape[1 if transpose else 2])
        return mb.gmm(lhs, rhs, sizes, lhs.dtype, tiling, transpose_rhs=transpose, interpret=kernel.interpret)

    def tgmm(lhs, dout, sizes):
        tiling = tiles(kernel, lhs.shape[0], lhs.shape[1], dout.shape[1])
        return mb.tgmm(lhs.T, dout, sizes, lhs.dtype, tiling, interpret=kernel.interpret)

    return gmm, tgmm


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(x_ID, w_EDF, sizes_E, kernel):
    return _products(kernel)[0](x_ID, w_EDF, sizes_E)


def _gmm_fwd(x_ID, w_EDF, sizes_E, kernel):
    return _gmm(x_ID, w_EDF, sizes_E, kernel), (x_ID, w_EDF, sizes_E)


def _gmm_bwd(kernel, res, dy_IF):
    x_ID, w_EDF, sizes_E = res
    gmm, tgmm = _products(kernel)
    d_lhs = gmm(dy_IF.astype(x_ID.dtype), w_EDF, sizes_E, transpose=True)
    d_rhs = tgmm(x_ID, dy_IF.astype(x_ID.dtype), sizes_E).astype(w_EDF.dtype)
    return d_lhs, d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _padded(x, axis: int, size: int):
    extra = size - x.shape[axis]
    return x if extra == 0 else jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


def grouped_matmul(x_ID, w_EDF, sizes_E, kernel: Kernel):
    """jax.lax.ragged_dot(lhs, rhs, sizes) by `kernel`, differentiable (the custom_vjp's three kernel matmuls).

    Rows past the groups' total are zeroed and, with the rows padded up to the row tile, ride with the last group
    (zeros in, zeros out); k and n are zero-padded where no tile of Triton's divides them."""
    (m, k), n = x_ID.shape, w_EDF.shape[2]
    sizes_E = sizes_E.astype(jnp.int32)
    tm, tk, tn = tiles(kernel, m, k, n)
    mp = -(-m // tm) * tm
    kp, np_ = (-(-k // tk) * tk, -(-n // tn) * tn) if kernel.name == "triton" else (k, n)
    total = sizes_E.sum()
    x = jnp.where((jnp.arange(m) < total)[:, None], x_ID, 0)
    x = _padded(_padded(x, 0, mp), 1, kp)
    w = _padded(_padded(w_EDF, 1, kp), 2, np_)
    y = _gmm(x, w.astype(x.dtype), sizes_E.at[-1].add(mp - total), kernel)
    return y[:m, :n]
