"""Pipeline parallelism over the `stage` mesh axis: a GPipe or circular (mesh.stage_repeats) schedule of the scanned
trunk's blocks, written as one `jax.shard_map` over that axis with `ppermute` shifting each stage's activations to
the next (`run_stages`).

Where each part lives (docs/scaling-out.md): the stacked blocks [L, ...] are split over `stage` by the sharding
rules (stage s holds blocks s·L/S .. (s+1)·L/S − 1), so a checkpoint's layout does not depend on the stage count;
an uneven mesh.stage_layers gathers each stage's blocks and pads them to the largest count, and a circular schedule
fetches the chunks each stage runs (`stage_blocks`).
The embedding is read on entry (the first stage's input); after the pipeline drains, the last stage's outputs are
sent by rows to the stages (`drain`: each device sends its own batch shard's rows, never the whole batch), and the
final norm, the MTP modules, the shared head and the loss run one micro-batch at a time as the unpipelined step runs
them, each stage on its 1/S of the rows (or, where a micro-batch's rows do not divide over the stages, on every S-th
micro-batch: `tail_layout`): in a GPipe schedule the tail runs after the drain, so the last stage alone would leave
the others idle through it (and every stage repeating it would compute it S times). The embedding (and
a tied head) is one parameter read at both ends; autodiff sums the gradient of its uses: the pipeline input's
cotangent (summed over stages by shard_map's transpose) and the modules' reads (summed over the stages' rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from mtpjax.config import LossConfig
from mtpjax.nn.loss import forward, mtp_loss
from mtpjax.nn.model import MTPTransformer, placed, scan_blocks
from mtpjax.nn.placement import Placement
from mtpjax.parallel.sharding import micro_batches_of


def bubble(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """The idle fraction of each stage: (S − 1) / (R·M + S − 1) ticks (R = 1: GPipe; R > 1: a circular pipeline)."""
    return (stages - 1) / (repeats * micro_batches + stages - 1)


def schedule_line(stages: int, micro_batches: int, repeats: int = 1) -> str:
    """The schedule and its bubble, as `plan` and `compile` name them."""
    kind, R = ("GPipe", "") if repeats == 1 else (f"circular, mesh.stage_repeats={repeats}", "R·")
    return (f"mesh.stage={stages} x train.micro_batches={micro_batches} ({kind}), bubble (S-1)/({R}M+S-1) = "
            f"{bubble(stages, micro_batches, repeats):.1%}")


def stage_lines(blocks_bytes: int, other_bytes: int, stages: int, micro_batches: int, n_layers: int,
                stage_layers: tuple[int, ...] = (), repeats: int = 1) -> list[str]:
    """What `plan` says of a pipelined run: the schedule's bubble and the state (parameters and optimizer) one stage
    holds: its share of the trunk's stored blocks, and the parts every stage holds whole (embedding/head, final norm,
    MTP modules: every stage runs the tail on its share of the rows); an uneven split's ticks and storage, or the
    chunks a circular pipeline gathers."""
    held = stored_blocks(n_layers, stages)
    per = blocks_bytes * held / n_layers
    circular = (f"  each stage stores its {held} contiguous blocks and gathers the {repeats} chunks of "
                f"{n_layers // (stages * repeats)} it runs (stage s: chunks s, s+{stages}, ...) every step")
    return [f"pipeline: {schedule_line(stages, micro_batches, repeats)}",
            f"  state per stage (before the other mesh axes split it): {(per + other_bytes) / 2**30:.3f} GiB = "
            f"trunk blocks {per / 2**30:.3f} GiB "
            f"({held} of {n_layers} blocks' {blocks_bytes / 2**30:.3f}) + embedding/head, final norm, MTP modules "
            f"{other_bytes / 2**30:.3f} GiB (on every stage; {other_bytes / max(per, 1):.2f}x a stage's blocks)",
            *([f"  {uneven_line(stage_layers, n_layers)}"] if len(set(stage_layers)) > 1 else []),
            *([circular] if repeats > 1 else [])]


def stored_blocks(n_layers: int, stages: int) -> int:
    """Blocks of the stacked trunk each stage stores: its even share, or all of them where the stages do not divide
    the stack (the checkpoint's [L, ...] layout is kept; an uneven mesh.stage_layers gathers each stage's own)."""
    return n_layers // stages if n_layers % stages == 0 else n_layers


def uneven_line(stage_layers: tuple[int, ...], n_layers: int) -> str:
    """What an uneven mesh.stage_layers costs: every tick runs the largest stage's count (the rest is padding)."""
    S, top = len(stage_layers), max(stage_layers)
    return (f"mesh.stage_layers={list(stage_layers)}: each tick runs {top} blocks on every stage ({top * S - n_layers} "
            f"of the {top * S} padding, passed through: {1 - n_layers / (top * S):.1%} of the stages' block work); "
            f"each stage stores {stored_blocks(n_layers, S)} of the {n_layers} blocks and gathers the {top} it runs")


def stage_count(model: MTPTransformer) -> int:
    """Pipeline stages the model is placed over (1: no pipeline)."""
    return model.placement.size(model.placement.stage_axis)


def trunk(model: MTPTransformer, tok_ABT, seg_ABT, layout: str):
    """The trunk over A micro-batches through the stages: (raw hidden [A,B,T,D], routing info stacked [A, ...]),
    drained for the tail's `layout` (tail_layout); "micro-batches" gives the hidden states as that tail takes them,
    [A/S, S·B, T, D] (side_by_side). The schedule is `run_stages`'."""
    pl = model.placement
    st, keep_L, runs = stage_state(model)
    # The first stage's input, the embedding's first use: held as the shard_map takes it (every stage, the batch
    # axes' rows), so it needs no gather over the stages.
    x_ABTD = pl.constrain(model.embed_tokens(pl.constrain(tok_ABT, None, "batch", "length")), None, "batch",
                          "length", "embed")
    G = pl.size(pl.spec(("batch",), tok_ABT.shape[1:2])[0])  # the batch shards outside the stages
    padded = runs is not None and not all(runs[1])
    run = functools.partial(run_stages, model, layout=layout, shards=G, padded=padded)
    h, aux = jax.shard_map(run, mesh=pl.mesh, in_specs=(P(pl.stage_axis), P(pl.stage_axis), P(), P()),
                           out_specs=(P(None, None, pl.stage_axis) if layout else P(), P(None, pl.stage_axis)),
                           axis_names=frozenset({pl.stage_axis}), check_vma=False)(st, keep_L, x_ABTD, seg_ABT)
    if runs:  # routing info [A, the blocks the stages ran, ...] put in block order, the padding's dropped
        order = [p for p in np.argsort(runs[0], kind="stable") if runs[1][p]]
        aux = jax.tree.map(lambda v: v[:, np.asarray(order)], aux)
    # [A, B, T, D]; "micro-batches": [A/S, S·B, T, D], rows ordered (shard, stage, row), as side_by_side's
    h_ABTD = tail_placement(model, layout).constrain(h.reshape(h.shape[0], -1, *h.shape[-2:]), None, "batch",
                                                      "length", "embed")
    return h_ABTD, ({"blocks": aux} if aux else {})


def run_stages(model: MTPTransformer, st, keep_L, x_ABTD, seg_ABT, *, layout: str, shards: int, padded: bool):
    """One stage's ticks (inside the shard_map over the stages): (its share of the drained hidden states, its
    blocks' routing info [A, blocks it ran, ...]).

    At tick t of R·A + S − 1, stage s makes pass t − s: chunk r = (t − s) // A of its R on micro-batch (t − s) mod
    A (R = mesh.stage_repeats; 1 is GPipe). The first stage takes a micro-batch's embedding on its first pass and,
    on a later one, what the last stage sent it A − S ticks before. A tick outside its passes (the bubble) computes
    on a finite stand-in whose results are dropped, so neither values nor gradients reach the loss from it."""
    pl = model.placement
    axis, S, A, R = pl.stage_axis, stage_count(model), x_ABTD.shape[0], pl.stage_repeats
    s, K = jax.lax.axis_index(axis), keep_L.shape[0] // R  # K: blocks per chunk
    pos_BT = jnp.broadcast_to(jnp.arange(x_ABTD.shape[2], dtype=jnp.int32), x_ABTD.shape[1:3])
    # Inside, the blocks' own shard_maps (fused attention, expert parallelism) must name the mesh as this context
    # sees it (stage manual): the blocks are re-placed on it, their state unchanged.
    inner = dataclasses.replace(pl, mesh=jax.sharding.get_abstract_mesh())
    gdef = nnx.split(placed(model, inner).blocks)[0]

    def tick(carry, t):
        state_BTD, loop_ABTD, out_ABTD = carry
        n = jnp.clip(t - s, 0, A * R - 1)  # this stage's pass (clipped in the bubble)
        r, m = n // A, n % A
        x_BTD = x_ABTD[m]
        if R > 1:  # the first stage keeps what the last sent (micro-batch t − S; before tick S, nothing: slot A)
            j = jnp.where(t >= S, (t - S) % A, A)  # until that micro-batch's next pass
            loop_ABTD = jax.lax.dynamic_update_index_in_dim(loop_ABTD, state_BTD, j, 0)
            x_BTD = jnp.where(r == 0, x_BTD, loop_ABTD[m])
        layers = None if R == 1 else r * K + jnp.arange(K)  # chunk r's blocks, each read inside its remat
        y_BTD, _, aux = scan_blocks(gdef, st, jnp.where(s == 0, x_BTD, state_BTD), pos_BT, seg_ABT[m], None,
                                    model.cfg.remat, keep_L if padded else None, layers)
        # the trunk's output, the last stage's last pass of micro-batch m, kept (not stacked over every tick; any
        # other tick's goes to slot A)
        done = (s == S - 1) & (t - s >= (R - 1) * A)
        out_ABTD = jax.lax.dynamic_update_index_in_dim(out_ABTD, y_BTD, jnp.where(done, m, A), 0)
        ring = jax.lax.ppermute(y_BTD, axis, [(i, (i + 1) % S) for i in range(S)])
        return (ring, loop_ABTD, out_ABTD), aux

    spare = jnp.zeros((A + 1, *x_ABTD.shape[1:]), x_ABTD.dtype)  # A micro-batches' slots and one for the rest
    (_, _, last), aux = jax.lax.scan(tick, (spare[0], spare if R > 1 else None, spare), jnp.arange(A * R + S - 1))
    last = last[:A].reshape(A, shards, x_ABTD.shape[1] // shards, *x_ABTD.shape[2:])
    h = drain(inner.constrain(last, None, "batch", None, "length", "embed"), axis, layout)
    aux = jax.tree.map(lambda v: jax.lax.dynamic_slice_in_dim(v, s, A * R), aux)  # stage s's ticks s .. s + R·A − 1
    return h, jax.tree.map(lambda v: jnp.swapaxes(v.reshape(R, A, *v.shape[1:]), 0, 1).reshape(
        A, R * v.shape[1], *v.shape[2:]), aux)


def stage_state(model: MTPTransformer):
    """(the blocks' state as the stages take it, which of its layers are real, stage_blocks' layout or None): each
    stage's blocks side by side where they are not its contiguous share."""
    st, layout = nnx.state(model.blocks), stage_blocks(model.placement, model.cfg.n_layers)
    R, S = model.placement.stage_repeats, stage_count(model)
    if layout and R > 1:  # a transpose, not stage_blocks' index gather: XLA gathers the whole stack for that
        st = jax.tree.map(lambda v: circular(v, S, R), st)
    elif layout:
        st = jax.tree.map(lambda v: v[np.asarray(layout[0])], st)
    return st, jnp.asarray(layout[1] if layout else [True] * model.cfg.n_layers), layout


def stage_blocks(pl: Placement, n_layers: int) -> tuple[list[int], list[bool]] | None:
    """The stacked blocks each stage runs, stage after stage, and which of them are real; None where each runs its
    contiguous share once. An uneven mesh.stage_layers pads each stage to the largest count (padding repeats the
    stage's last block); a circular pipeline (mesh.stage_repeats R) gives stage s chunks s, s + S, ... of L/(S·R)."""
    counts, R = pl.stage_layers, pl.stage_repeats
    if R > 1:
        return circular(np.arange(n_layers), pl.size(pl.stage_axis), R).tolist(), [True] * n_layers
    if len(set(counts)) <= 1:
        return None
    top, starts = max(counts), np.cumsum((0, *counts[:-1]))
    return ([int(b) + min(i, n - 1) for b, n in zip(starts, counts) for i in range(top)],
            [i < n for n in counts for i in range(top)])


def circular(v, S: int, R: int):
    """A stacked [L, ...] in circular order: each stage's chunks s, s + S, ... side by side ([R, S, K] as [S, R, K])."""
    return v.reshape(R, S, -1, *v.shape[1:]).swapaxes(0, 1).reshape(v.shape)


def drain(last, axis: str, layout: str):
    """The last stage's outputs [A, shards, rows/shards, T, D] sent on by ppermute, which moves each device's batch
    shard alone (XLA's psum and psum_scatter over the manual stage axis gather the other batch axes' shards first):
    to stage j its share j of each shard's rows ("rows"), or micro-batches j, j+S, ... ("micro-batches"), or all."""
    S = jax.lax.axis_size(axis)
    parts = {"rows": lambda: jnp.split(last, S, axis=2), "micro-batches": lambda: [last[j::S] for j in range(S)],
             "": lambda: [last] * S}[layout]()
    mine = jnp.where(jax.lax.axis_index(axis) == S - 1, parts[S - 1], 0)
    return sum((jax.lax.ppermute(parts[j], axis, [(S - 1, j)]) for j in range(S - 1)), mine)


def tail_layout(model: MTPTransformer, rows: int, micro_batches: int) -> str:
    """How the tail's work splits over the stages: "rows" (stage s takes share s of each micro-batch's rows: they
    divide over every batch axis and the stages), "micro-batches" (they do not, as at scale with a row or two per
    device: S micro-batches run side by side as one batch, stage s taking micro-batch s of each S), or "" (neither
    divides: every stage runs the whole tail)."""
    pl, S = model.placement, stage_count(model)
    if rows % (pl.size(pl.batch_axes) * S) == 0:
        return "rows"
    return "micro-batches" if rows % pl.size(pl.batch_axes) == 0 and micro_batches % S == 0 else ""


def tail_placement(model: MTPTransformer, layout: str) -> Placement:
    """Where the tail runs: with a layout, the stages are one more batch axis (the innermost, as `drain` hands each
    batch shard's rows on); without, every stage runs it whole."""
    pl = model.placement
    if not layout:
        return pl
    rules = tuple((k, (*v, pl.stage_axis) if k == "batch" else v) for k, v in pl.activation_rules)
    return dataclasses.replace(pl, batch_axes=(*pl.batch_axes, pl.stage_axis), activation_rules=rules)


def side_by_side(x_A, stages: int, shards: int):
    """[A, B, ...] as [A/S, S·B, ...]: micro-batches s of each S side by side, rows ordered (shard, stage, row) as
    the "micro-batches" tail holds them."""
    A, B = x_A.shape[:2]
    x = x_A.reshape(A // stages, stages, shards, B // shards, *x_A.shape[2:])
    return jnp.swapaxes(x, 1, 2).reshape(A // stages, stages * B, *x_A.shape[2:])


def loss(train: nnx.State, frozen: nnx.State, tokens_BT, seg_BT, step, *, graphdef, loss_cfg: LossConfig,
         micro_batches: int, counts, with_accept_prob: bool = False):
    """(loss, (metrics stacked per micro-batch, expert loads)) of one batch through the pipeline: the trunk's stages
    over every micro-batch, then the MTP modules, head and loss per micro-batch (normalized by the whole batch's
    `counts`, so the parts sum to the batch's loss as the unpipelined step's do). The train step differentiates it;
    the eval step (eval/validation.py) runs it as it is, `with_accept_prob`."""
    tok_ABT, seg_ABT = micro_batches_of(tokens_BT, micro_batches), micro_batches_of(seg_BT, micro_batches)
    model = nnx.merge(graphdef, train, frozen)
    layout = tail_layout(model, tok_ABT.shape[1], micro_batches)
    h_ABTD, routing = trunk(model, tok_ABT, seg_ABT, layout)
    if layout == "micro-batches":  # the tokens as the drain laid the states out; routing info is summed over rows
        S, pl = stage_count(model), model.placement
        tok_ABT, seg_ABT = (side_by_side(x, S, pl.size(pl.batch_axes)) for x in (tok_ABT, seg_ABT))
        routing = jax.tree.map(lambda v: v.reshape(v.shape[0] // S, S, *v.shape[1:]).sum(1), routing)
    rows, where = tokens_BT.shape[0], tail_placement(model, layout)
    tail_graph = nnx.split(placed(model, where))[0]

    def tail(_, xs):
        tok_BT, seg_BT, h_BTD, rout = xs
        tok_BT, seg_BT = (where.constrain(x, "batch", "length") for x in (tok_BT, seg_BT))
        model = nnx.merge(tail_graph, train, frozen)
        out = forward(model, tok_BT, seg_BT, loss_cfg, trunk=(h_BTD, rout))
        value, met = mtp_loss(model, out, tok_BT, seg_BT, step=step, cfg=loss_cfg, counts=counts, rows=rows,
                              with_accept_prob=with_accept_prob)
        return None, (value, met, {k: (aux["load"], aux["dropped"]) for k, aux in out.routing.items()})

    _, (values, mets, loads) = jax.lax.scan(tail, None, (tok_ABT, seg_ABT, h_ABTD, routing))
    return values.sum(), (mets, loads)
