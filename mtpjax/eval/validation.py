"""Validation metrics, one way for the training eval (train/evals.py) and `decode.py --eval`.

Each batch gives its loss, accuracy, agreement and accept_prob per depth (accept_prob whatever the target) and
its valid targets per depth; over batches every metric is averaged weighted by those counts, and the expected
tokens per round come from the averaged rates once (a product of rates: averaging per-batch lengths is not
the length of the averages once there are two depths).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpjax.config import LossConfig
from mtpjax.decode.mesh import batch_axes
from mtpjax.eval.bpb import eval_bits_per_byte
from mtpjax.nn.loss import add_expected_lengths, forward, mtp_loss, token_counts
from mtpjax.nn.model import MTPTransformer
from mtpjax.parallel.sharding import replicated, state_shardings

KEPT = ("loss/", "accuracy/", "agreement/", "accept_prob/")  # what a validation reports of mtp_loss's metrics
COUNTS = "counts_M"  # a batch's valid targets per depth, beside its metrics


def batch_metrics(model: MTPTransformer, tokens_BT, seg_BT, *, step, loss_cfg: LossConfig) -> dict:
    """One batch's validation metrics and its valid targets per depth (jittable; the training eval step)."""
    depth = model.cfg.mtp_depth
    met = mtp_loss(model, forward(model, tokens_BT, seg_BT, loss_cfg), tokens_BT, seg_BT, step=step, cfg=loss_cfg,
                   with_accept_prob=True)[1]
    counts = token_counts(tokens_BT, seg_BT, depth, loss_cfg)  # main, mtp_1..mtp_J, then unroll_1..
    return {k: v for k, v in met.items() if k.startswith(KEPT)} | {COUNTS: counts}


def _column(key: str, depth: int) -> int:
    """The column of token_counts a metric is counted over: `*/mtp_k`'s, `*/unroll_u`'s, the main head's otherwise."""
    tail = key.rsplit("/", 1)[-1]
    if tail.startswith("mtp_"):
        return int(tail[len("mtp_"):])
    return depth + int(tail[len("unroll_"):]) if tail.startswith("unroll_") else 0


def mean_metrics(per_batch: list[dict]) -> dict:
    """Token-weighted means of batch_metrics' dicts over batches, then the expected lengths from the means.

    loss/total (the objective, whose parts have their own counts) is weighted by the main head's targets.
    """
    counts = np.asarray([np.asarray(m[COUNTS], np.float64) for m in per_batch])  # [batch, applications + 1]
    depth = sum(k.startswith("agreement/mtp_") for k in per_batch[0])  # the unrolled applications draft no round
    out = {}
    for k in per_batch[0]:
        if k == COUNTS:
            continue
        w = counts[:, _column(k, depth)]
        w = w if w.sum() > 0 else np.ones_like(w)  # no valid target anywhere: each batch's 0 counts alike
        out[k] = float(np.average([float(m[k]) for m in per_batch], weights=w))
    return {k: float(v) for k, v in add_expected_lengths(out, depth).items()}


def validation_metrics(per_batch: list[dict], batches: list[dict], tokenizer=None) -> dict:
    """mean_metrics of the batches' metrics, and bits_per_byte given a tokenizer whose byte lengths are known."""
    out = mean_metrics(per_batch)
    if tokenizer is None:
        return out
    return out | eval_bits_per_byte(batches, [float(m["loss/main"]) for m in per_batch], tokenizer)


def model_metrics(model: MTPTransformer, batches: list[dict], *, step: int, loss_cfg: LossConfig) -> list[dict]:
    """batch_metrics of a loaded model on each batch, on the mesh the model is placed on with the training eval step's
    shardings (parameters by the logical rules, rows over the data axes, metrics replicated); one device off a mesh."""
    graphdef, params = nnx.split(model)
    metrics = functools.partial(_merged_metrics, graphdef=graphdef, loss_cfg=loss_cfg)
    where, step_ = model.placement, jnp.asarray(step, jnp.int32)
    if where.mesh is None:
        one = jax.jit(metrics)
    else:
        mesh = where.mesh
        rows = NamedSharding(mesh, P(batch_axes(where, len(batches[0]["tokens"])), None))
        one = jax.jit(metrics, in_shardings=(state_shardings(params, mesh), rows, rows, replicated(mesh)),
                      out_shardings=replicated(mesh))
    return jax.device_get([one(params, jnp.asarray(b["tokens"], jnp.int32), jnp.asarray(b["segment_ids"], jnp.int32),
                               step_) for b in batches])


def _merged_metrics(params, tokens_BT, seg_BT, step, *, graphdef, loss_cfg: LossConfig) -> dict:
    return batch_metrics(nnx.merge(graphdef, params), tokens_BT, seg_BT, step=step, loss_cfg=loss_cfg)
