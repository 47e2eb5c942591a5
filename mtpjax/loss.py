"""The MTP objective (DESIGN §2): segment-aware shifted targets per depth, chunked CE through the shared head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mtpjax.config import LossConfig, parse_lambda
from mtpjax.model import MTPOutput, MTPTransformer, shift_left
from mtpjax.speed import expected_tokens


def lambda_schedule(spec: str) -> optax.Schedule:
    """The MTP weight lambda(step) as an optax schedule, from a `loss.mtp_lambda` string."""
    kind, p = parse_lambda(spec)
    if kind == "constant":
        return optax.constant_schedule(p["value"])
    if kind == "piecewise":
        vals, bounds = p["values"], p["boundaries"]
        return lambda step: jnp.asarray(vals, jnp.float32)[jnp.searchsorted(jnp.asarray(bounds), step, side="right")]
    if kind == "linear":
        return optax.linear_schedule(p["init"], p["end"], p["steps"])
    # Written out rather than optax.cosine_decay_schedule, whose end value is init*alpha (wrong for init=0).
    a, b, n = p["init"], p["end"], p["steps"]
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


def _ce_chunk(model: MTPTransformer, h_MBCD, tgt_MBC):
    logits_MBCV = model.logits(h_MBCD)  # float32
    lse_MBC = jax.nn.logsumexp(logits_MBCV, axis=-1)
    tgt_logit_MBC = jnp.take_along_axis(logits_MBCV, tgt_MBC[..., None], axis=-1)[..., 0]
    return lse_MBC - tgt_logit_MBC, jnp.argmax(logits_MBCV, axis=-1).astype(jnp.int32)


def per_position(model: MTPTransformer, hidden_MBTD, tgt_MBT, chunk_size: int = 0):
    """Cross-entropy and argmax per depth and position; [M,B,T,V] logits are never all held at once."""
    M, B, T, D = hidden_MBTD.shape
    C = T if chunk_size in (0, T) else chunk_size
    if C == T:
        return _ce_chunk(model, hidden_MBTD, tgt_MBT)
    U = T // C
    h_UMBCD = hidden_MBTD.reshape(M, B, U, C, D).transpose(2, 0, 1, 3, 4)
    t_UMBC = tgt_MBT.reshape(M, B, U, C).transpose(2, 0, 1, 3)
    # Rematerialized per chunk, so the backward pass also holds one chunk of logits at a time.
    body = jax.checkpoint(lambda args: _ce_chunk(model, *args))
    ce_UMBC, am_UMBC = jax.lax.map(body, (h_UMBCD, t_UMBC))
    return ce_UMBC.transpose(1, 2, 0, 3).reshape(M, B, T), am_UMBC.transpose(1, 2, 0, 3).reshape(M, B, T)


def expected_accept_length(agreements) -> jax.Array:
    """E(D) of mtpjax.speed from the teacher-forced agreements: tokens per step if draft k is accepted w.p. a_k."""
    return jnp.asarray(expected_tokens(list(agreements), len(agreements)), jnp.float32)


def mtp_loss(model: MTPTransformer, out: MTPOutput, tokens_BT, segment_ids_BT=None, *, step,
             cfg: LossConfig = LossConfig(), counts=None):
    """(loss, metrics) of DESIGN §2 with lambda from cfg.mtp_lambda at `step`.

    `counts` (float[M]) overrides the per-depth normalizers, so that micro-batches of one batch can be
    normalized by the whole batch's token counts and sum to the full-batch loss exactly.
    """
    depth = out.hidden.shape[0] - 1
    valid_MBT = valid_masks(tokens_BT, segment_ids_BT, depth).astype(jnp.float32)
    tgt_MBT = targets(tokens_BT, depth)
    ce_MBT, am_MBT = per_position(model, out.hidden, tgt_MBT, cfg.chunk_size)
    n_M = valid_MBT.sum(axis=(1, 2)) if counts is None else counts
    denom_M = jnp.maximum(1.0, n_M)
    loss_M = (ce_MBT * valid_MBT).sum(axis=(1, 2)) / denom_M
    acc_M = ((am_MBT == tgt_MBT) * valid_MBT).sum(axis=(1, 2)) / denom_M
    lam = jnp.asarray(lambda_schedule(cfg.mtp_lambda)(step), jnp.float32)
    loss = loss_M[0] + (lam / depth) * loss_M[1:].sum() if depth else loss_M[0]
    metrics = {"loss/total": loss, "loss/main": loss_M[0], "accuracy/main": acc_M[0], "lambda": lam}
    agreements = []
    for k in range(1, depth + 1):
        # Greedy acceptance, teacher-forced: depth k's argmax at i vs the main head's argmax at i+k.
        agree = ((am_MBT[k] == shift_left(am_MBT[0], k, fill=-1)) * valid_MBT[k]).sum() / denom_M[k]
        metrics[f"loss/mtp_{k}"] = loss_M[k]
        metrics[f"accuracy/mtp_{k}"] = acc_M[k]
        metrics[f"agreement/mtp_{k}"] = agree
        agreements.append(agree)
    if depth:
        metrics["expected_accept_length"] = expected_accept_length(agreements)
    return loss, metrics


def token_counts(tokens_BT, segment_ids_BT, depth: int):
    """float[M]: number of valid targets per depth (the normalizers mtp_loss uses)."""
    return valid_masks(tokens_BT, segment_ids_BT, depth).astype(jnp.float32).sum(axis=(1, 2))
