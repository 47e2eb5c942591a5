"""The MTP objective (docs/design.md §2): segment-aware shifted targets per depth, chunked CE via the shared head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mtpjax.config import LambdaSchedule, LossConfig
from mtpjax.nn.model import MTPOutput, MTPTransformer, shift_left
from mtpjax.nn.speed import expected_tokens


def lambda_schedule(lam: LambdaSchedule) -> optax.Schedule:
    """The MTP weight lambda(step) as an optax schedule, from the parsed `loss.mtp_lambda`."""
    if lam.kind == "constant":
        return optax.constant_schedule(lam.values[0])
    if lam.kind == "piecewise":
        vals, bounds = lam.values, lam.steps
        return lambda step: jnp.asarray(vals, jnp.float32)[jnp.searchsorted(jnp.asarray(bounds), step, side="right")]
    (a, b), (n,) = lam.values, lam.steps
    if lam.kind == "linear":
        return optax.linear_schedule(a, b, n)
    # Written out rather than optax.cosine_decay_schedule, whose end value is init*alpha (wrong for init=0).
    return lambda step: b + (a - b) * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(step, n) / n))


def valid_masks(tokens_BT, segment_ids_BT, depth: int):
    """bool[M, B, T]: depth k at i has a real target x[i+k+1] in the same document."""
    B, T = tokens_BT.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    pos = jnp.arange(T)
    masks = []
    for k in range(depth + 1):
        tgt_seg = shift_left(seg, k + 1)  # 0 past the end, like padding
        masks.append((pos[None, :] + k + 1 < T) & (tgt_seg != 0) & (seg == tgt_seg))
    return jnp.stack(masks)


def targets(tokens_BT, depth: int):
    """int[M, B, T]: x[i+k+1] for depth k (0 past the end)."""
    return jnp.stack([shift_left(tokens_BT, k + 1) for k in range(depth + 1)])


def teacher_hidden(hidden_MBTD):
    """hidden[0] at i+k for k = 1..J (float[J,B,T,D]): what depth k at i is compared with; no gradient flows into it."""
    h0_BTD = jax.lax.stop_gradient(hidden_MBTD[0])
    return jnp.stack([shift_left(h0_BTD, k) for k in range(1, hidden_MBTD.shape[0])])


def soft_ce(student_JBCV, teacher_JBCV, temperature: float):
    """Soft cross-entropy of softmax(student/t) against softmax(teacher/t), times t² (the gradient's scale at t=1)."""
    p_JBCV = jax.nn.softmax(jax.lax.stop_gradient(teacher_JBCV) / temperature, axis=-1)
    logq_JBCV = jax.nn.log_softmax(student_JBCV / temperature, axis=-1)
    return -(p_JBCV * logq_JBCV).sum(-1) * temperature**2


def accept_prob(student_JBCV, teacher_JBCV):
    """Σ_v min(p, q) at temperature 1: the chance that stochastic verification accepts a draft sampled from q."""
    q_JBCV = jax.nn.softmax(student_JBCV, axis=-1)
    p_JBCV = jax.nn.softmax(teacher_JBCV, axis=-1)
    return jax.lax.stop_gradient(jnp.minimum(p_JBCV, q_JBCV).sum(-1))


def _ce_chunk(model: MTPTransformer, h_MBCD, tgt_MBC, teach_JBCD=None, temperature: float = 1.0):
    logits_MBCV = model.logits(h_MBCD)  # float32
    lse_MBC = jax.nn.logsumexp(logits_MBCV, axis=-1)
    tgt_logit_MBC = jnp.take_along_axis(logits_MBCV, tgt_MBC[..., None], axis=-1)[..., 0]
    out = (lse_MBC - tgt_logit_MBC, jnp.argmax(logits_MBCV, axis=-1).astype(jnp.int32))
    if teach_JBCD is None:
        return out
    # The main head again on hidden[0] shifted by k, inside the chunk: [J,B,T,V] teacher logits are never all held.
    teach_JBCV = jax.lax.stop_gradient(model.logits(teach_JBCD))
    return (*out, soft_ce(logits_MBCV[1:], teach_JBCV, temperature), accept_prob(logits_MBCV[1:], teach_JBCV))


def per_position(model: MTPTransformer, hidden_MBTD, tgt_MBT, chunk_size: int = 0, teach_JBTD=None,
                 temperature: float = 1.0):
    """Cross-entropy and argmax per depth and position ([M,B,T] each), and with teacher hidden states ([J,B,T,D])
    also the soft cross-entropy and acceptance probability of depths 1..J ([J,B,T] each); [M,B,T,V] logits are
    never all held at once."""
    M, B, T, D = hidden_MBTD.shape
    C = T if chunk_size in (0, T) else chunk_size
    chunk = lambda args: _ce_chunk(model, *args, temperature=temperature)
    args = (hidden_MBTD, tgt_MBT) if teach_JBTD is None else (hidden_MBTD, tgt_MBT, teach_JBTD)
    if C == T:
        return chunk(args)
    Q = T // C
    to_chunks = lambda x: jnp.moveaxis(x.reshape(*x.shape[:2], Q, C, *x.shape[3:]), 2, 0)  # [Q,M or J,B,C,...]
    from_chunks = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], T)
    # Rematerialized per chunk, so the backward pass also holds one chunk of logits at a time.
    outs = jax.lax.map(jax.checkpoint(chunk), tuple(to_chunks(a) for a in args))
    return tuple(from_chunks(o) for o in outs)


def expected_accept_length(agreements) -> jax.Array:
    """E(γ) of mtpjax.nn.speed from the teacher-forced agreements: tokens per step if draft k is accepted w.p. a_k."""
    return jnp.asarray(expected_tokens(list(agreements), len(agreements)), jnp.float32)


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


def mtp_loss(model: MTPTransformer, out: MTPOutput, tokens_BT, segment_ids_BT=None, *, step,
             cfg: LossConfig = LossConfig(), counts=None, with_accept_prob: bool = False, rows=None):
    """(loss, metrics) of docs/design.md §2 with λ from cfg.mtp_lambda at `step` and depth targets from cfg.mtp_target.

    `counts` (float[M]) overrides the per-depth normalizers, so that micro-batches of one batch can be
    normalized by the whole batch's token counts and sum to the full-batch loss exactly (`rows`, the whole batch's
    rows, does the same for the MoE balance loss). `accept_prob/mtp_k`
    needs the main head on shifted states; it is computed when the self target needs them or when asked.
    """
    depth = out.hidden.shape[0] - 1
    w_self = cfg.mtp_target.weight("self") if depth else 0.0
    valid_MBT = valid_masks(tokens_BT, segment_ids_BT, depth).astype(jnp.float32)
    tgt_MBT = targets(tokens_BT, depth)
    teach = depth > 0 and (w_self > 0 or with_accept_prob)
    per = per_position(model, out.hidden, tgt_MBT, cfg.chunk_size, teacher_hidden(out.hidden) if teach else None,
                       cfg.distill_temperature)
    ce_MBT, am_MBT = per[:2]
    n_M = valid_MBT.sum(axis=(1, 2)) if counts is None else counts
    denom_M = jnp.maximum(1.0, n_M)
    depth_mean = lambda x_MBT, valid_MBT: (x_MBT * valid_MBT).sum(axis=(1, 2)) / denom_M[-x_MBT.shape[0]:]
    loss_M = depth_mean(ce_MBT, valid_MBT)
    if w_self > 0:  # depth k at i learns the main head's distribution at i+k (a position valid for both)
        self_J = depth_mean(per[2], valid_MBT[1:])
        loss_M = loss_M.at[1:].set((1 - w_self) * loss_M[1:] + w_self * self_J)
    acc_M = depth_mean((am_MBT == tgt_MBT).astype(jnp.float32), valid_MBT)
    lam = jnp.asarray(lambda_schedule(cfg.mtp_lambda)(step), jnp.float32)
    loss = loss_M[0] + (lam / depth) * loss_M[1:].sum() if depth else loss_M[0]
    metrics = {"loss/total": loss, "loss/main": loss_M[0], "accuracy/main": acc_M[0], "lambda": lam}
    if out.routing and cfg.moe_seq_aux_loss > 0:
        balance = balance_loss(out.routing, tokens_BT.shape[0] if rows is None else rows)
        metrics["loss/total"] = loss = loss + cfg.moe_seq_aux_loss * balance
        metrics["loss/moe_balance"] = balance
    if teach:
        accept_J = depth_mean(per[3], valid_MBT[1:])
    for k in range(1, depth + 1):
        # Greedy acceptance, teacher-forced: depth k's argmax at i vs the main head's argmax at i+k.
        agree = ((am_MBT[k] == shift_left(am_MBT[0], k, fill=-1)) * valid_MBT[k]).sum() / denom_M[k]
        metrics[f"loss/mtp_{k}"] = loss_M[k]
        metrics[f"accuracy/mtp_{k}"] = acc_M[k]
        metrics[f"agreement/mtp_{k}"] = agree
        if teach:
            metrics[f"accept_prob/mtp_{k}"] = accept_J[k - 1]
    return loss, add_expected_lengths(metrics, depth)


def balance_loss(routing: dict, rows) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (unweighted): summed over the MoE layers, averaged over the rows."""
    return sum(aux["balance"].sum() for aux in routing.values()) / rows


def token_counts(tokens_BT, segment_ids_BT, depth: int):
    """float[M]: number of valid targets per depth (the normalizers mtp_loss uses)."""
    return valid_masks(tokens_BT, segment_ids_BT, depth).astype(jnp.float32).sum(axis=(1, 2))
