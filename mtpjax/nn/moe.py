"""DeepSeek-V3's mixture of experts: sigmoid routing with a selection-only bias, group-limited top-k, shared experts.

Dropless: every token reaches its k experts, and a token's output depends on no other token (decoding and
speculation see the same function as training). Token-slots are sorted by expert and multiplied group by group:
on GPU/TPU by the platform's grouped-matmul kernel (mtpjax.nn.gmm: Pallas-Triton, Mosaic megablox) where the program
runs per device (one device, or inside the expert-parallel shard_map), by `jax.lax.ragged_dot` where XLA partitions
the MoE over several devices (a Pallas kernel cannot be partitioned); on CPU (where jax 0.10.2's ragged_dot computes
every expert for every row) the sorted rows are cut into blocks of one expert each and multiplied by that expert's
gathered weights (docs/benchmarks.md has the measurement).

Expert parallelism (`ExpertParallel`, from the model's `Placement` when its mesh has an expert axis): inside a
shard_map each device sends its token-slots to the expert-axis shard holding their experts (an all-to-all), that
shard multiplies them by its own experts, and a second all-to-all brings them back; expert weights never leave
their shard. The buffers hold `model.moe_buffer_factor` × the balanced share (`capacity`); a slot past its buffer
is dropped (lightest routing weight first) and counted, never silently: the train step reports the dropped fraction
per block. Factor 0 sizes them for the worst case: dropless, as decoding always runs (nn.model.for_decoding). An
all-to-all of fixed-size buffers, not `jax.lax.ragged_all_to_all`: XLA:CPU 0.10.2 cannot run that op, and the
equalities below are tested on CPU devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P

from mtpjax.config import ModelConfig
from mtpjax.nn import gmm, kernels
from mtpjax.nn.layers import MLP, dtype_of, param, residual_std
from mtpjax.nn.placement import Placement


class ExpertBias(nnx.Variable):
    """The per-expert routing bias: used for selection only, moved by the train step from the expert loads,
    never by the optimizer (it is not an nnx.Param, so no optimizer filter sees it)."""


def route(logits_IE, bias_E, *, k: int, n_group: int, topk_group: int, scale: float):
    """(chosen experts int[I, X], their weights float32[I, X], scores float32[I, E]) of DeepSeek-V3's router.

    Scores are sigmoids; the bias is added for the choice only; a token chooses among its `topk_group` best groups
    (a group's score: the sum of its top-2 biased scores); the weights are the chosen unbiased scores normalized over
    the k, times `scale`.
    """
    s_IE = jax.nn.sigmoid(logits_IE.astype(jnp.float32))
    b_IE = s_IE + bias_E.astype(jnp.float32)[None, :]
    if n_group > 1:
        rows, E = b_IE.shape
        grouped = b_IE.reshape(rows, n_group, E // n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [rows, groups]
        keep = jnp.zeros_like(group_score, bool)
        keep = keep.at[jnp.arange(rows)[:, None], jax.lax.top_k(group_score, topk_group)[1]].set(True)
        b_IE = jnp.where(jnp.repeat(keep, E // n_group, axis=1), b_IE, -jnp.inf)
    idx_IX = jax.lax.top_k(jax.lax.stop_gradient(b_IE), k)[1]
    w_IX = jnp.take_along_axis(s_IE, idx_IX, axis=1)
    w_IX = w_IX / (w_IX.sum(-1, keepdims=True) + 1e-20) * scale
    return idx_IX, w_IX, s_IE


# The values remat "save_kernels" keeps by name (nn.model): the routed rows as the experts get them, their gate and
# up products, and each token-slot's output, so a backward reruns no dispatch and no routed matmul.
SAVED = ("moe_rows", "moe_hidden", "moe_out")


def block_rows(n_slots: int, n_experts: int) -> int:
    """Rows per block of the CPU grouping: padding at most a quarter of the slots, 1 (no padding) for few rows."""
    b = n_slots // (4 * n_experts)
    return 1 if b < 8 else 1 << (b.bit_length() - 1)


def grouped_swiglu(x_ID, e_I, counts_E, w_gate_EDF, w_up_EDF, w_down_EFD, grouping: str | gmm.Kernel):
    """SwiGLU of each row by its expert: rows sorted by expert (e_I ascending), counts_E rows per expert; `grouping`:
    a grouped-matmul kernel, "ragged" (jax.lax.ragged_dot) or "blocks" (CPU)."""
    if grouping == "ragged" or isinstance(grouping, gmm.Kernel):
        gs = counts_E.astype(jnp.int32)
        mm = functools.partial(gmm.grouped_matmul, kernel=grouping) if grouping != "ragged" else jax.lax.ragged_dot
        g_IF, u_IF = (checkpoint_name(mm(x_ID, w, gs), SAVED[1]) for w in (w_gate_EDF, w_up_EDF))
        return mm((jax.nn.silu(g_IF) * u_IF).astype(x_ID.dtype), w_down_EFD, gs)
    rows, D = x_ID.shape
    E = w_gate_EDF.shape[0]
    b = block_rows(rows, E)
    if b == 1:  # one block per row: each row reads exactly its expert's weights (decode's shape)
        pos_I, blocks, block_e = jnp.arange(rows), rows, e_I
    else:
        # Each expert's rows start a fresh block: sum_e ceil(n_e / b) <= rows // b + E blocks.
        blocks = rows // b + E
        nb_E = (counts_E + b - 1) // b
        start_E = jnp.cumsum(nb_E) - nb_E  # first block of each expert
        first_E = jnp.cumsum(counts_E) - counts_E  # first sorted row of each expert
        pos_I = start_E[e_I] * b + jnp.arange(rows) - first_E[e_I]
        block_e = jnp.minimum(jnp.searchsorted(jnp.cumsum(nb_E), jnp.arange(blocks), side="right"), E - 1)
    xp = jnp.zeros((blocks * b, D), x_ID.dtype).at[pos_I].set(x_ID).reshape(blocks, b, D)  # padding rows: zeros
    gate, up = (checkpoint_name(jnp.einsum("nbd,ndf->nbf", xp, w[block_e]), SAVED[1]) for w in (w_gate_EDF, w_up_EDF))
    y = jnp.einsum("nbf,nfd->nbd", (jax.nn.silu(gate) * up).astype(x_ID.dtype), w_down_EFD[block_e])
    return y.reshape(blocks * b, D)[pos_I]


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where the routed experts run: the mesh, its expert axis, the axes that split the batch and the FFN's axis."""

    mesh: Mesh
    batch_axes: tuple[str, ...]
    expert_axis: str = "expert"
    tensor_axis: str | None = "tensor"

    def applies(self, batch: int) -> bool:
        """Whether a batch of this many rows splits evenly over the batch axes (else the MoE runs unsharded, said
        once: every device then computes every expert on the whole batch, their weights gathered)."""
        if self.mesh.shape[self.expert_axis] == 1:
            return False
        shards = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        if batch % shards:
            kernels.note(f"a batch of {batch} rows does not split over the {shards} batch shards "
                         f"({'*'.join(self.batch_axes)}); the routed experts run unsharded, their weights gathered "
                         f"to every device (a batch that is a multiple of {shards} keeps them on their shards)", "moe")
            return False
        return True


def capacity(rows: int, k: int, local_experts: int, shards: int, factor: float) -> int:
    """Rows one shard sends another: `factor` × the balanced share rows·k / shards, at most the worst case
    rows·min(k, local experts) (a shard's every token on each of its experts), which factor 0 asks for."""
    worst = rows * min(k, local_experts)
    return worst if factor <= 0 else min(worst, max(1, math.ceil(factor * rows * k / shards)))


def dispatch_positions(slot_e, slot_w, experts_per_shard: int, shards: int):
    """(slot order: by destination shard, heaviest routing weight first; each ordered slot's destination shard, its
    row in the buffer sent there); `slot_e`, `slot_w`: each token-slot's expert and weight. A buffer of c rows keeps
    each destination's c heaviest slots: an overflow drops the slots that weigh least in their tokens' outputs."""
    dest_S = slot_e // experts_per_shard
    order = jnp.lexsort((-slot_w, dest_S))  # stable: equal weights keep slot order
    dest = dest_S[order]
    per_shard = jnp.bincount(dest, length=shards)
    return order, dest, jnp.arange(slot_e.shape[0]) - (jnp.cumsum(per_shard) - per_shard)[dest]


def _rows(x, idx, fill: bool):
    """x's rows at idx: zeros where idx is out of range (fill), or idx promised in range (a permutation's)."""
    return x.at[idx].get(mode="fill", fill_value=0) if fill else x.at[idx].get(mode="promise_in_bounds")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def move(x, to, readers, fill: bool = True):
    """Rows x[to] (`fill`: zeros where `to` is out of range; else a permutation): a gather whose gradient is a gather
    too, so the dispatch has no scatter either way (XLA:GPU writes a bf16 scatter as u32 copies, and a scatter's JVP
    with masks). `readers` [rows of x, j] lists for each row of x the rows of the result that read it (out of
    range: none)."""
    return _rows(x, to, fill)


def _move_fwd(x, to, readers, fill):
    return move(x, to, readers, fill), readers


def _move_bwd(fill, readers, dy):
    per_reader = _rows(dy, readers, fill)  # [rows of x, j, width]
    dx = per_reader[:, 0] if readers.shape[1] == 1 else per_reader.sum(1, dtype=jnp.float32).astype(dy.dtype)
    return dx, None, None


move.defvjp(_move_fwd, _move_bwd)


def inverse(perm):
    """The inverse of a permutation of 0..n-1."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype), unique_indices=True)


def _routed_on_shard(x_ID, idx_IX, w_IX, real_I, w_gate, w_up, w_down, *, ep: ExpertParallel, grouping: str,
                     factor: float):
    """One device's (routed output, [its real token-slots dropped]): its slots all-to-all'd to their experts' shards in
    buffers of `capacity` rows per shard, multiplied there, sent back.

    A slot past its buffer is dropped: it reaches no expert and adds nothing to its token's output. At the worst-case
    capacity (factor 0) none is. Padding rows are zeros, whose SwiGLU and gradients are zero. Rows move by gathers
    (`move`), each buffer cell reading its slot's token and each slot its cell.
    """
    (rows, D), k = x_ID.shape, idx_IX.shape[1]
    shards, E_l = ep.mesh.shape[ep.expert_axis], w_gate.shape[0]
    cap, slots = capacity(rows, k, E_l, shards, factor), rows * k
    slot_e = idx_IX.reshape(-1)
    order, dest, pos = dispatch_positions(slot_e, w_IX.reshape(-1), E_l, shards)
    kept = pos < cap
    cell_of = jnp.where(kept, dest * cap + pos, shards * cap)  # each ordered slot's cell in the send buffers (or none)
    slot_cell = jnp.zeros((slots,), jnp.int32).at[order].set(cell_of, unique_indices=True)  # by slot i*k + j
    cell_slot = jnp.full((shards * cap,), slots, jnp.int32).at[cell_of].set(order, mode="drop")  # slots: an empty cell
    filled = cell_slot < slots
    send_x = move(x_ID, jnp.where(filled, cell_slot // k, rows), slot_cell.reshape(rows, k))
    send_e = jnp.where(filled, slot_e[jnp.minimum(cell_slot, slots - 1)] % E_l, E_l)
    a2a = functools.partial(jax.lax.all_to_all, axis_name=ep.expert_axis, split_axis=0, concat_axis=0)
    recv_e = a2a(send_e.reshape(shards, cap)).reshape(-1)  # each received row's local expert, E_l: padding
    o = jnp.argsort(recv_e, stable=True)
    inv_o = inverse(o)
    counts = jnp.bincount(recv_e, length=E_l + 1)
    counts = counts[:E_l].at[-1].add(counts[E_l])  # padding rides with the last expert: zeros in, zeros out
    recv_x = a2a(send_x.reshape(shards, cap, D)).reshape(shards * cap, D)
    rows_x = checkpoint_name(move(recv_x, o, inv_o[:, None], False), SAVED[0])
    y = grouped_swiglu(rows_x, jnp.minimum(recv_e[o], E_l - 1), counts, w_gate, w_up, w_down, grouping)
    back = a2a(move(y, inv_o, o[:, None], False).reshape(shards, cap, D)).reshape(shards * cap, D)
    slot_y = checkpoint_name(move(back, slot_cell, cell_slot[:, None]), SAVED[2])
    y_ID = jnp.einsum("nxd,nx->nd", slot_y.reshape(rows, k, D).astype(jnp.float32), w_IX)
    dropped = jnp.sum(~kept & real_I[order // k])
    return y_ID, dropped.astype(jnp.int32)[None]


def expert_parallel_routed(x_ID, idx_IX, w_IX, real_I, w_gate, w_up, w_down, ep: ExpertParallel, grouping: str,
                           factor: float = 0.0):
    """(the routed experts' weighted output [I, D] (float32), the real token-slots dropped (int32[])) with experts
    sharded over ep.expert_axis (shard_map); `real_I`: which rows count (not padding), `factor`: moe_buffer_factor."""
    F, t = w_gate.shape[2], ep.tensor_axis
    # the FFN split over tensor, psum'd
    tp = t if t is not None and ep.mesh.shape[t] > 1 and F % ep.mesh.shape[t] == 0 else None

    def body(*args):
        y, dropped = _routed_on_shard(*args, ep=ep, grouping=grouping, factor=factor)
        return (y if tp is None else jax.lax.psum(y, tp)), dropped

    rows = P(ep.batch_axes, None)
    # check_vma=False: the grouped-matmul kernels (Pallas calls) declare no varying manual axes for their outputs
    y_ID, dropped = jax.shard_map(
        body, mesh=ep.mesh, in_specs=(rows, rows, rows, P(ep.batch_axes), P(ep.expert_axis, None, tp),
                                      P(ep.expert_axis, None, tp), P(ep.expert_axis, tp, None)),
        out_specs=(rows, P(ep.batch_axes)), check_vma=False)(x_ID, idx_IX, w_IX, real_I, w_gate, w_up, w_down)
    return y_ID, dropped.sum()


def grouping_for(platform: str) -> str | gmm.Kernel:
    """The platform's grouped-matmul kernel (GPU, TPU), expert blocks on CPU."""
    return gmm.kernel_for(platform) or "blocks"


def partitioned(grouping: str | gmm.Kernel, devices: int) -> str | gmm.Kernel:
    """The grouping of an MoE that XLA partitions over `devices`: ragged_dot in place of a kernel when more than one
    (no Pallas kernel can be partitioned; inside the expert-parallel shard_map each device runs the kernel)."""
    return "ragged" if devices > 1 and isinstance(grouping, gmm.Kernel) else grouping


def expert_parallel(placement: Placement) -> ExpertParallel | None:
    """The placement's expert-parallel plan: None unless its mesh splits the routed experts."""
    if placement.size(placement.expert_axis) <= 1:
        return None
    return ExpertParallel(placement.mesh, placement.batch_axes, placement.expert_axis, placement.head_axis)


class MoE(nnx.Module):
    """Routed and always-on shared SwiGLU experts: (y, {"load": int[E] non-padding slots per expert (segment id 0 is
    padding), "balance": float[], "dropped": int[] non-padding slots the expert-parallel dispatch dropped})."""

    COMPUTE_WEIGHTS = ("router", "w_gate", "w_up", "w_down")  # read only cast to the compute dtype (as Dense's)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, placement: Placement):
        d, f, E = cfg.d_model, cfg.moe_d_ff, cfg.n_routed_experts
        pdt = dtype_of(cfg.param_dtype)
        self.k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scale, self.dtype = cfg.routed_scaling_factor, dtype_of(cfg.dtype)
        self.router = param(rngs, (d, E), cfg.init_std, ("embed", None), pdt)
        self.bias = ExpertBias(jnp.zeros((E,), jnp.float32), logical_axes=(None,))
        self.w_gate = param(rngs, (E, d, f), cfg.init_std, ("expert", "embed", "mlp"), pdt)
        self.w_up = param(rngs, (E, d, f), cfg.init_std, ("expert", "embed", "mlp"), pdt)
        self.w_down = param(rngs, (E, f, d), residual_std(cfg), ("expert", "mlp", "embed"), pdt)
        if cfg.n_shared_experts:
            self.shared = MLP(cfg, rngs, d_ff=cfg.n_shared_experts * f, placement=placement)
        self.grouping = grouping_for(placement.platform)  # how, not what: all are exact
        self.ep = expert_parallel(placement)
        self.devices = placement.size(placement.mesh.axis_names) if placement.mesh is not None else 1
        self.buffer_factor = cfg.moe_buffer_factor  # expert-parallel only; 0: dropless (for_decoding sets it)

    def __call__(self, x_BTD, seg_BT=None):
        B, T, D = x_BTD.shape
        x_ID = x_BTD.reshape(B * T, D).astype(self.dtype)
        logits_IE = jnp.dot(x_ID, self.router[...].astype(self.dtype), preferred_element_type=jnp.float32)
        idx_IX, w_IX, s_IE = route(logits_IE, self.bias[...], k=self.k, n_group=self.n_group,
                                   topk_group=self.topk_group, scale=self.scale)
        E, k = s_IE.shape[1], self.k
        slot_e = idx_IX.reshape(-1)  # the I·k token-slots' experts, slot i*k + j
        weights = tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
        # segment id 0 is padding: it reaches experts, since the output is per token, but no statistic counts it
        real_BT = jnp.ones((B, T), jnp.float32) if seg_BT is None else (seg_BT != 0).astype(jnp.float32)
        if self.ep is not None and self.ep.applies(B):
            y_ID, dropped = expert_parallel_routed(x_ID, idx_IX, w_IX, real_BT.reshape(-1) > 0, *weights, self.ep,
                                                   self.grouping, self.buffer_factor)
        else:
            order = jnp.argsort(slot_e, stable=True)
            inv = inverse(order)
            rows_x = checkpoint_name(move(x_ID, order // k, inv.reshape(B * T, k), False), SAVED[0])
            slot_y = grouped_swiglu(rows_x, slot_e[order], jnp.bincount(slot_e, length=E), *weights,
                                    partitioned(self.grouping, self.devices))
            y_IXD = checkpoint_name(move(slot_y, inv, order[:, None], False), SAVED[2]).reshape(B * T, k, D)
            y_ID, dropped = jnp.einsum("nxd,nx->nd", y_IXD.astype(jnp.float32), w_IX), jnp.zeros((), jnp.int32)
        y_ID = y_ID.astype(self.dtype)
        if hasattr(self, "shared"):
            y_ID = y_ID + self.shared(x_ID)
        # Sequence-wise balance (DeepSeek-V3 eq. 17-20), summed over rows: f_i = E/(kT)·(row's slots on i),
        # P_i = the row's mean of the scores normalized over all experts; T counts a row's real tokens only
        # (padding is not the sequence's).
        t_B = jnp.maximum(real_BT.sum(1), 1.0)
        f_BE = (jax.nn.one_hot(idx_IX, E, dtype=jnp.float32).sum(1).reshape(B, T, E)
                * real_BT[..., None]).sum(1) * (E / k) / t_B[:, None]
        p_BE = ((s_IE / s_IE.sum(-1, keepdims=True)).reshape(B, T, E) * real_BT[..., None]).sum(1) / t_B[:, None]
        slot_real = jnp.repeat(real_BT.reshape(-1).astype(slot_e.dtype), k)
        aux = {"load": jnp.zeros((E,), jnp.int32).at[slot_e].add(slot_real.astype(jnp.int32)),
               "balance": (f_BE * p_BE).sum(), "dropped": dropped}
        return y_ID.reshape(B, T, D), aux


def next_bias(bias_E, load_E, speed: float):
    """The aux-loss-free balancing step: every expert's bias moves by `speed` toward the mean load (up when under it).

    load may be stacked ([L, E], a scanned trunk); the mean is each layer's own.
    """
    load = load_E.astype(jnp.float32)
    return bias_E + speed * jnp.sign(load.mean(-1, keepdims=True) - load)


def load_metrics(name: str, load_E, bias_E, dropped) -> dict:
    """Per-layer scalars: max/mean expert load, the bias range and the fraction of the token-slots (load's) that the
    dispatch dropped (a stacked [L, E] entry, with [L] dropped, gives one per layer)."""
    if load_E.ndim == 2:
        return {k: v for i in range(load_E.shape[0]) for k, v in load_metrics(f"{name}.{i}", load_E[i], bias_E[i],
                                                                               dropped[i]).items()}
    load = load_E.astype(jnp.float32)
    return {f"moe/{name}/load_max_over_mean": load.max() / jnp.maximum(load.mean(), 1e-9),
            f"moe/{name}/bias_range": bias_E.max() - bias_E.min(),
            f"moe/{name}/dropped_fraction": dropped / jnp.maximum(load.sum(), 1.0)}
