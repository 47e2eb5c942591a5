"""The MTP objective (docs/design.md §2): segment-aware shifted targets per depth, chunked CE via the shared head."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mtpjax.config import LossConfig
from mtpjax.nn import head_ce
from mtpjax.nn.model import MTPOutput, MTPTransformer, shift_left
from mtpjax.drafts import chain
from mtpjax.nn.speed import by_position, expected_tokens


def depth_masks(tokens_BT, segment_ids_BT, depths):
    """bool[len(depths), B, T]: depth k at i has a real target x[i+k+1] in the same document."""
    B, T = tokens_BT.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    pos = jnp.arange(T)
    masks = []
    for k in depths:
        tgt_seg = shift_left(seg, k + 1)  # 0 past the end, like padding
        masks.append((pos[None, :] + k + 1 < T) & (tgt_seg != 0) & (seg == tgt_seg))
    return jnp.stack(masks)


def valid_masks(tokens_BT, segment_ids_BT, depth: int):
    """bool[M, B, T]: the masks of depths 0..depth."""
    return depth_masks(tokens_BT, segment_ids_BT, range(depth + 1))


def targets(tokens_BT, depths):
    """int[len(depths), B, T]: x[i+k+1] for each depth k (0 past the end)."""
    return jnp.stack([shift_left(tokens_BT, k + 1) for k in depths])


def scored_depths(cfg: LossConfig, depth: int) -> tuple[int, ...]:
    """The depth each scored MTP application plays: modules 1..D, then module m's u-th reuse as depth m+u."""
    if not depth:
        return ()
    m = 1 if cfg.mtp_unroll_module == "first" else depth
    return (*range(1, depth + 1), *(m + u for u in range(1, cfg.mtp_unroll + 1)))


def forward(model: MTPTransformer, tokens_BT, segment_ids_BT, cfg: LossConfig, trunk: tuple | None = None
            ) -> MTPOutput:
    """The model's forward with the unrolled applications cfg scores (loss.mtp_unroll); `trunk`: the trunk's (raw
    hidden, routing) when computed elsewhere (a pipeline's stages)."""
    depth = model.cfg.mtp_depth
    if not (depth and cfg.mtp_unroll):
        return model(tokens_BT, segment_ids_BT, trunk=trunk)
    return model(tokens_BT, segment_ids_BT, unroll=cfg.mtp_unroll,
                 unroll_module=1 if cfg.mtp_unroll_module == "first" else depth, trunk=trunk)


def soft_ce(student_JBCV, teacher_JBCV, temperature: float):
    """Soft cross-entropy of softmax(student/t) against softmax(teacher/t), times t² (the gradient's scale at t=1)."""
    p_JBCV = jax.nn.softmax(jax.lax.stop_gradient(teacher_JBCV) / temperature, axis=-1)
    logq_JBCV = jax.nn.log_softmax(student_JBCV / temperature, axis=-1)
    return -(p_JBCV * logq_JBCV).sum(-1) * temperature**2


def tv_distance(student_JBCV, teacher_JBCV):
    """1 − Σ_v min(p, q) at temperature 1 (the total variation distance): the chance stochastic verification rejects
    a draft sampled from q; its gradient reaches q only (p is stop-gradient)."""
    q_JBCV = jax.nn.softmax(student_JBCV, axis=-1)
    p_JBCV = jax.nn.softmax(jax.lax.stop_gradient(teacher_JBCV), axis=-1)
    return 1 - jnp.minimum(p_JBCV, q_JBCV).sum(-1)


def accept_prob(student_JBCV, teacher_JBCV):
    """Σ_v min(p, q) at temperature 1: the chance that stochastic verification accepts a draft sampled from q."""
    q_JBCV = jax.nn.softmax(student_JBCV, axis=-1)
    p_JBCV = jax.nn.softmax(teacher_JBCV, axis=-1)
    return jax.lax.stop_gradient(jnp.minimum(p_JBCV, q_JBCV).sum(-1))


def first_argmax(x, platform: str = "cpu"):
    """jnp.argmax over the last axis (the first index of the maximum) for finite x; on a CPU as a max and a min.

    XLA CPU lowers argmax to a variadic (value, index) reduce that does not vectorize: on the [B,T,V] logits
    of a tiny-config step it cost more than the head's matmul; two plain reductions are 4-9x faster. Elsewhere the
    variadic reduce is one pass, while the min's vocabulary index is a logits-sized int32 array that a GPU's chunked
    loss hoists out of its loop and reads per chunk (small on h100:8: 4.3 GB of a step's 68.5 GB per device).
    """
    if platform != "cpu":
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    V = x.shape[-1]
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


SOFTMAX_STATS = "softmax_stats"  # the name of cross_entropy's row max and exp-sum, which the chunked loss keeps


@jax.custom_vjp
def cross_entropy(logits, tgt):
    """logsumexp(logits) − logits[tgt] along the last axis, its gradient written out as one pass (softmax − one-hot).

    Differentiated as written, take_along_axis's gradient is a scatter-add into a zero buffer the size of the logits;
    and any logits-sized array that depends on nothing in the chunk (an index iota, a broadcast zero) is hoisted out
    of the chunked loss's loop, held whole and read per chunk (8.6 GB of 68.5 GB per device of small's step on h100:8,
    with first_argmax's). Here the one-hot's iota lives inside the backward pass, fused with the softmax."""
    return _cross_entropy_fwd(logits, tgt)[0]


def _cross_entropy_fwd(logits, tgt):
    # jax.nn.logsumexp's own steps, kept (amax, sumexp) so that the backward pass below is its derivative bit for bit
    amax = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    amax = checkpoint_name(jnp.where(jnp.isfinite(amax), amax, 0), SOFTMAX_STATS)
    sumexp = checkpoint_name(jnp.exp(logits - amax).sum(axis=-1), SOFTMAX_STATS)
    lse = jnp.log(sumexp) + amax[..., 0]
    return lse - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0], (logits, tgt, amax, sumexp)


def _cross_entropy_bwd(res, g):
    # Autodiff's own result, in its order: logsumexp's gradient (g / sumexp) · exp(logits − amax), plus the
    # one-hot's −g where the take's transpose would scatter-add it into zeros (x + 0 = x: the same bits).
    logits, tgt, amax, sumexp = res
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == tgt[..., None]
    d_logits = (g / sumexp)[..., None] * jnp.exp(logits - amax)
    return (d_logits + jnp.where(hit, -g[..., None], 0)).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _head(model: MTPTransformer, h_MBCD):
    """The shared head on [M,B,C,D] states: float32 logits [B,M,C,V], rows first so that the batch axes still split
    the rows the head flattens (M first, they would not), the vocabulary over tensor."""
    on = model.placement.constrain
    with jax.named_scope("head"):
        h_BMCD = on(jnp.swapaxes(h_MBCD, 0, 1), "batch", None, "length", "embed")
        return on(model.logits(h_BMCD), "batch", None, "length", "vocab")


def _ce_chunk(model: MTPTransformer, h_MBCD, tgt_MBC, teach_JBCD=None, temperature: float = 1.0):
    logits_BMCV = _head(model, h_MBCD)  # float32
    mb = lambda x_BMC: jnp.swapaxes(x_BMC, 0, 1)  # the chunk's results as [M,B,C]
    ce_BMC = cross_entropy(logits_BMCV, jnp.swapaxes(tgt_MBC, 0, 1))
    out = (mb(ce_BMC), mb(first_argmax(logits_BMCV, model.placement.platform)))
    if teach_JBCD is None:
        return out
    # The main head again on hidden[0] shifted by k, inside the chunk: [J,B,T,V] teacher logits are never all held.
    # The teachers pair with the last J rows: depths 1..J of hidden, or every row of an unrolled stack.
    teach_BJCV = jax.lax.stop_gradient(_head(model, teach_JBCD))
    student_BJCV = logits_BMCV[:, logits_BMCV.shape[1] - teach_BJCV.shape[1]:]
    tv_BJC = tv_distance(student_BJCV, teach_BJCV)
    return (*out, mb(soft_ce(student_BJCV, teach_BJCV, temperature)), mb(jax.lax.stop_gradient(1 - tv_BJC)),
            mb(tv_BJC))


def _fused_chunk(model: MTPTransformer, plan: head_ce.Plan, h_MBCD, tgt_MBC):
    """_ce_chunk's (cross-entropy, argmax) from the fused head (nn/head_ce.py): no logits in HBM."""
    on = model.placement.constrain
    with jax.named_scope("head"):
        h_BMCD = on(jnp.swapaxes(h_MBCD, 0, 1), "batch", None, "length", "embed")
        ce_I, am_I = head_ce.head_cross_entropy(h_BMCD.reshape(-1, h_BMCD.shape[-1]),
                                                model.head_weight(h_BMCD.dtype)[0], jnp.swapaxes(tgt_MBC, 0, 1).ravel(),
                                                plan)
    return tuple(jnp.swapaxes(x_I.reshape(h_BMCD.shape[:3]), 0, 1) for x_I in (ce_I, am_I))


HEAD_INTERPRET_ENV = "MTPJAX_HEAD_INTERPRET"  # "1": off a TPU, the fused head runs in Pallas interpret mode (tests)


def head_plan(model: MTPTransformer, cfg: LossConfig, B: int) -> head_ce.Plan | None:
    """How the fused head runs for B rows on the model's placement; None: XLA's head (loss.head_kernel=xla, off a
    TPU, or inside a pipeline's stages)."""
    pl = model.placement
    interpret = pl.platform != "tpu" and os.environ.get(HEAD_INTERPRET_ENV) == "1"
    if cfg.head_kernel == "xla" or pl.stage_axis or not (pl.platform == "tpu" or interpret):
        return None
    mesh = pl.mesh if pl.mesh is not None and pl.mesh.size > 1 else None
    vocab = pl.head_axis if mesh and pl.head_axis and model.cfg.vocab_size % mesh.shape[pl.head_axis] == 0 else None
    return head_ce.Plan(model.cfg.tie_embeddings, interpret, mesh=mesh, row_axes=(pl.rows_axes(B) if mesh else ())
                        or None, vocab_axis=vocab)


def per_position(model: MTPTransformer, hidden_MBTD, tgt_MBT, chunk_size: int = 0, teach_JBTD=None,
                 temperature: float = 1.0, fused: head_ce.Plan | None = None):
    """Cross-entropy and argmax per depth and position ([M,B,T] each), and with teacher hidden states ([J,B,T,D],
    for the last J of the M rows) also the soft cross-entropy, acceptance probability and TV distance of those
    ([J,B,T] each); [M,B,T,V] logits are never all held at once (`fused`: never written at all, no teacher)."""
    M, B, T, D = hidden_MBTD.shape
    C = T if chunk_size in (0, T) else chunk_size
    fused = fused if teach_JBTD is None else None
    chunk = lambda args: _ce_chunk(model, *args, temperature=temperature)
    if fused is not None:
        chunk = lambda args: _fused_chunk(model, fused, *args)
    args = (hidden_MBTD, tgt_MBT) if teach_JBTD is None else (hidden_MBTD, tgt_MBT, teach_JBTD)
    if C == T:
        return chunk(args)
    Q = T // C
    to_chunks = lambda x: jnp.moveaxis(x.reshape(*x.shape[:2], Q, C, *x.shape[3:]), 2, 0)  # [Q,M or J,B,C,...]
    from_chunks = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], T)
    # Rematerialized per chunk, so the backward pass also holds one chunk of logits at a time; the softmax's row max
    # and exp-sum ([B,M,C] each) are kept, so the backward reads the recomputed logits once (the softmax gradient)
    # where recomputing them would read them twice more (4.3 GB of small's 66.7 GB a device on h100:8).
    remat = jax.checkpoint(chunk, policy=jax.checkpoint_policies.save_only_these_names(SOFTMAX_STATS))
    outs = jax.lax.map(remat if fused is None else chunk, tuple(to_chunks(a) for a in args))  # fused: no logits held
    return tuple(from_chunks(o) for o in outs)


def expected_accept_length(agreements) -> jax.Array:
    """E(γ) of mtpjax.nn.speed from the teacher-forced agreements: tokens per step if draft k is accepted w.p. a_k."""
    return jnp.asarray(expected_tokens(chain(len(agreements)), by_position(agreements)), jnp.float32)


def add_expected_lengths(metrics: dict, depth: int) -> dict:
    """metrics with the expected tokens per round from the greedy (agreement) and, where logged, the stochastic
    (accept_prob) acceptance rates of depths 1..J."""
    if depth:
        metrics["expected_accept_length"] = expected_accept_length(
            [metrics[f"agreement/mtp_{k}"] for k in range(1, depth + 1)])
        if "accept_prob/mtp_1" in metrics:
            metrics["expected_accept_length_sampled"] = expected_accept_length(
                [metrics[f"accept_prob/mtp_{k}"] for k in range(1, depth + 1)])
    return metrics


def _names(depth: int, apps: int) -> list[str]:
    """Metric names of the scored applications: mtp_k for depth k, unroll_u for the u-th reuse."""
    return [f"mtp_{k}" for k in range(1, depth + 1)] + [f"unroll_{u}" for u in range(1, apps - depth + 1)]


def mtp_loss(model: MTPTransformer, out: MTPOutput, tokens_BT, segment_ids_BT=None, *, step,
             cfg: LossConfig = LossConfig(), counts=None, with_accept_prob: bool = False, rows=None):
    """(loss, metrics) of docs/design.md §2 with λ per application at `step` (loss.mtp_lambda, mtp_lambda_depths),
    depth targets from cfg.mtp_target and the unrolled applications of `out` (from forward(..., cfg)) scored too.

    `counts` (float[1 + D + U]) overrides the per-depth normalizers, so that micro-batches of one batch can be
    normalized by the whole batch's token counts and sum to the full-batch loss exactly (`rows`, the whole batch's
    rows, does the same for the MoE balance loss). `accept_prob/mtp_k`
    needs the main head on shifted states; it is computed when a self or tv target needs them or when asked.
    """
    depth = out.hidden.shape[0] - 1
    depths = (0, *scored_depths(cfg, depth))
    apps = len(depths) - 1
    got = 0 if out.unrolled is None else out.unrolled.shape[0]
    if got != apps - depth:
        raise ValueError(f"loss.mtp_unroll scores {apps - depth} unrolled applications, the output has {got}: "
                         "run the model through nn.loss.forward(model, tokens, segments, cfg)")
    weights = cfg.mtp_target.weights if depth else (1.0, 0.0, 0.0)
    valid = depth_masks(tokens_BT, segment_ids_BT, depths).astype(jnp.float32)  # [1 + apps, B, T]
    tgt = targets(tokens_BT, depths)
    teach = depth > 0 and (weights[1] > 0 or weights[2] > 0 or with_accept_prob)
    ce, am, *teacher_terms = _per_application(model, out, tgt, depths, cfg, teach)
    n = valid.sum(axis=(1, 2)) if counts is None else counts
    denom = jnp.maximum(1.0, n)
    depth_mean = lambda x, valid: (x * valid).sum(axis=(1, 2)) / denom[-x.shape[0]:]
    teacher_means = [depth_mean(t, valid[1:]) for t in teacher_terms]  # self, accept_prob, tv: [apps] each
    losses = _target_mix(depth_mean(ce, valid), teacher_means, weights)
    lam = cfg.mtp_lambda(step)
    lams = cfg.mtp_lambda_depths.at(step, cfg.mtp_lambda, apps)
    if cfg.mtp_lambda_depths.kind == "same":  # this order keeps a run without a curriculum's loss bit for bit
        loss = losses[0] + (lam / apps) * losses[1:].sum() if apps else losses[0]
    else:
        loss = losses[0] + (lams * losses[1:]).sum() / apps if apps else losses[0]
    accs = depth_mean((am == tgt).astype(jnp.float32), valid)
    metrics = {"loss/total": loss, "loss/main": losses[0], "accuracy/main": accs[0], "lambda": lam}
    if out.routing and cfg.moe_seq_aux_loss > 0:
        balance = balance_loss(out.routing, tokens_BT.shape[0] if rows is None else rows)
        metrics["loss/total"] = loss = loss + cfg.moe_seq_aux_loss * balance
        metrics["loss/moe_balance"] = balance
    for a, name in enumerate(_names(depth, apps), start=1):
        # Greedy acceptance, teacher-forced: the application's argmax at i vs the main head's argmax at i+k.
        agree = ((am[a] == shift_left(am[0], depths[a], fill=-1)) * valid[a]).sum() / denom[a]
        metrics |= {f"loss/{name}": losses[a], f"accuracy/{name}": accs[a], f"agreement/{name}": agree,
                    f"lambda/{name}": lams[a - 1]}
        if teach:
            metrics[f"accept_prob/{name}"] = teacher_means[1][a - 1]
    return loss, add_expected_lengths(metrics, depth)


def _per_application(model: MTPTransformer, out: MTPOutput, tgt, depths: tuple, cfg: LossConfig, teach: bool):
    """per_position's terms ([1 + apps, B, T] each, the teacher's [apps, B, T]) of the depths, then the unrolled."""
    depth = out.hidden.shape[0] - 1
    h0_BTD = jax.lax.stop_gradient(out.hidden[0])
    shifted = lambda ks: jnp.stack([shift_left(h0_BTD, k) for k in ks]) if teach else None
    fused = head_plan(model, cfg, tgt.shape[1])
    pers = [per_position(model, out.hidden, tgt[:depth + 1], cfg.chunk_size, shifted(depths[1:depth + 1]),
                         cfg.distill_temperature, fused)]
    if out.unrolled is not None and out.unrolled.shape[0]:
        pers.append(per_position(model, out.unrolled, tgt[depth + 1:], cfg.chunk_size, shifted(depths[depth + 1:]),
                                 cfg.distill_temperature, fused))
    return tuple(jnp.concatenate(x) for x in zip(*pers))


def _target_mix(losses, teacher_means: list, weights: tuple):
    """Per-application losses with loss.mtp_target's mix: depth k at i learns the main head's distribution at i+k
    (a position valid for both) from the soft cross-entropy (self) and the TV distance (tv) besides the data."""
    w_data, w_self, w_tv = weights
    if w_data >= 1:
        return losses
    mixed = w_data * losses[1:]
    if w_self > 0:
        mixed = mixed + w_self * teacher_means[0]
    if w_tv > 0:
        mixed = mixed + w_tv * teacher_means[2]
    return losses.at[1:].set(mixed)


def balance_loss(routing: dict, rows) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (unweighted): summed over the MoE layers, averaged over the rows."""
    return sum(aux["balance"].sum() for aux in routing.values()) / rows


def token_counts(tokens_BT, segment_ids_BT, depth: int, cfg: LossConfig | None = None):
    """float[1 + D + U]: number of valid targets per depth and unrolled application (the normalizers mtp_loss uses)."""
    depths = (0, *scored_depths(cfg, depth)) if cfg is not None else range(depth + 1)
    return depth_masks(tokens_BT, segment_ids_BT, depths).astype(jnp.float32).sum(axis=(1, 2))
