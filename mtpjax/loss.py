"""The MTP objective (DESIGN §2): segment-aware shifted targets per depth, chunked CE through the shared head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mtpjax.config import LossConfig, parse_lambda
from mtpjax.model import MTPOutput, MTPTransformer, shift_left


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
    """bool[D+1, B, T]: depth k at i has a real target x[i+k+1] in the same document."""
    B, T = tokens_BT.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
    pos = jnp.arange(T)
    masks = []
    for k in range(depth + 1):
        tgt_seg = shift_left(seg, k + 1)  # 0 past the end, like padding
        masks.append((pos[None, :] + k + 1 < T) & (tgt_seg != 0) & (seg == tgt_seg))
    return jnp.stack(masks)


def targets(tokens_BT, depth: int):
    """int[D+1, B, T]: x[i+k+1] for depth k (0 past the end)."""
    return jnp.stack([shift_left(tokens_BT, k + 1) for k in range(depth + 1)])


def _ce_chunk(model: MTPTransformer, h_KBCD, tgt_KBC):
    logits = model.logits(h_KBCD)  # float32 [K, B, C, V]
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt_logit = jnp.take_along_axis(logits, tgt_KBC[..., None], axis=-1)[..., 0]
    return lse - tgt_logit, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def per_position(model: MTPTransformer, hidden_KBTD, tgt_KBT, chunk_size: int = 0):
    """Cross-entropy and argmax per depth and position; [K,B,T,V] logits are never all held at once."""
    K, B, T, D = hidden_KBTD.shape
    C = T if chunk_size in (0, T) else chunk_size
    if C == T:
        return _ce_chunk(model, hidden_KBTD, tgt_KBT)
    n = T // C
    h_NKBCD = hidden_KBTD.reshape(K, B, n, C, D).transpose(2, 0, 1, 3, 4)
    t_NKBC = tgt_KBT.reshape(K, B, n, C).transpose(2, 0, 1, 3)
    # Rematerialized per chunk, so the backward pass also holds one chunk of logits at a time.
    body = jax.checkpoint(lambda args: _ce_chunk(model, *args))
    ce, am = jax.lax.map(body, (h_NKBCD, t_NKBC))
    return ce.transpose(1, 2, 0, 3).reshape(K, B, T), am.transpose(1, 2, 0, 3).reshape(K, B, T)


def expected_accept_length(agreements) -> jax.Array:
    """1 + sum_k prod_{j<=k} a_j: tokens per step if draft k is accepted with probability a_k."""
    total, run = jnp.float32(1.0), jnp.float32(1.0)
    for a in agreements:
        run = run * a
        total = total + run
    return total


def mtp_loss(model: MTPTransformer, out: MTPOutput, tokens_BT, segment_ids_BT=None, *, step,
             cfg: LossConfig = LossConfig(), counts=None):
    """(loss, metrics) of DESIGN §2 with lambda from cfg.mtp_lambda at `step`.

    `counts` (float[D+1]) overrides the per-depth normalizers, so that micro-batches of one batch can be
    normalized by the whole batch's token counts and sum to the full-batch loss exactly.
    """
    D = out.hidden.shape[0] - 1
    valid = valid_masks(tokens_BT, segment_ids_BT, D).astype(jnp.float32)
    tgt = targets(tokens_BT, D)
    ce, am = per_position(model, out.hidden, tgt, cfg.chunk_size)
    n = valid.sum(axis=(1, 2)) if counts is None else counts
    denom = jnp.maximum(1.0, n)
    loss_k = (ce * valid).sum(axis=(1, 2)) / denom
    acc_k = ((am == tgt) * valid).sum(axis=(1, 2)) / denom
    lam = jnp.asarray(lambda_schedule(cfg.mtp_lambda)(step), jnp.float32)
    loss = loss_k[0] + (lam / D) * loss_k[1:].sum() if D else loss_k[0]
    metrics = {"loss/total": loss, "loss/main": loss_k[0], "accuracy/main": acc_k[0], "lambda": lam}
    agreements = []
    for k in range(1, D + 1):
        # Greedy acceptance, teacher-forced: depth k's argmax at i vs the main head's argmax at i+k.
        agree = ((am[k] == shift_left(am[0], k, fill=-1)) * valid[k]).sum() / denom[k]
        metrics[f"loss/mtp_{k}"] = loss_k[k]
        metrics[f"accuracy/mtp_{k}"] = acc_k[k]
        metrics[f"agreement/mtp_{k}"] = agree
        agreements.append(agree)
    if D:
        metrics["expected_accept_length"] = expected_accept_length(agreements)
    return loss, metrics


def token_counts(tokens_BT, segment_ids_BT, depth: int):
    """float[D+1]: number of valid targets per depth (the normalizers mtp_loss uses)."""
    return valid_masks(tokens_BT, segment_ids_BT, depth).astype(jnp.float32).sum(axis=(1, 2))
