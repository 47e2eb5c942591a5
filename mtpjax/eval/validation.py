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
from mtpjax.parallel import pipeline
from mtpjax.parallel.sharding import micro_batches_of, replicated, state_shardings

KEPT = ("loss/", "accuracy/", "agreement/", "accept_prob/")  # what a validation reports of mtp_loss's metrics
COUNTS = "counts_M"  # a batch's valid targets per depth, beside its metrics


def batch_metrics(model: MTPTransformer, tokens_BT, seg_BT, *, step, loss_cfg: LossConfig, micro_batches: int = 1,
                  batch_sharding=None) -> dict:
    """One batch's validation metrics and its valid targets per depth (jittable; the training eval step), computed
    `micro_batches` parts at a time (the train step's split, and its memory): each part is normalized by the whole
    batch's counts, as the train step's are, so the parts sum to the whole batch's metrics. On a mesh with pipeline
    stages the parts flow through the stages as the train step's do (parallel/pipeline.py)."""
    B, counts = tokens_BT.shape[0], token_counts(tokens_BT, seg_BT, model.cfg.mtp_depth, loss_cfg)
    if pipeline.stage_count(model) > 1:  # unpipelined, every device would gather and run every stage's blocks
        graphdef, params = nnx.split(model)
        per = pipeline.loss(params, nnx.State({}), tokens_BT, seg_BT, step, graphdef=graphdef, loss_cfg=loss_cfg,
                            micro_batches=micro_batches, counts=counts, with_accept_prob=True)[1][0]
        return {k: v.sum(0) for k, v in per.items() if k.startswith(KEPT)} | {COUNTS: counts}

    def part(xs):
        if batch_sharding is not None:
            xs = tuple(jax.lax.with_sharding_constraint(x, batch_sharding) for x in xs)
        met = mtp_loss(model, forward(model, *xs, loss_cfg), *xs, step=step, cfg=loss_cfg, counts=counts, rows=B,
                       with_accept_prob=True)[1]
        return {k: v for k, v in met.items() if k.startswith(KEPT)}

    if micro_batches == 1:
        return part((tokens_BT, seg_BT)) | {COUNTS: counts}
    per = jax.lax.map(part, (micro_batches_of(tokens_BT, micro_batches), micro_batches_of(seg_BT, micro_batches)))
    return {k: v.sum(0) for k, v in per.items()} | {COUNTS: counts}


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


def model_metrics(model: MTPTransformer, batches: list[dict], *, step: int, loss_cfg: LossConfig,
                  micro_batches: int = 1) -> list[dict]:
    """batch_metrics of a loaded model on each batch, on the mesh the model is placed on with the training eval step's
    shardings (parameters by the logical rules, rows over the data axes, metrics replicated) and micro-batches; one
    device off a mesh."""
    graphdef, params = nnx.split(model)
    where, step_ = model.placement, jnp.asarray(step, jnp.int32)
    if where.mesh is None:
        one = jax.jit(functools.partial(_merged_metrics, graphdef=graphdef, loss_cfg=loss_cfg,
                                        micro_batches=micro_batches))
    else:
        mesh = where.mesh
        rows = NamedSharding(mesh, P(batch_axes(where, len(batches[0]["tokens"])), None))
        part = NamedSharding(mesh, P(batch_axes(where, len(batches[0]["tokens"]) // micro_batches), None))
        metrics = functools.partial(_merged_metrics, graphdef=graphdef, loss_cfg=loss_cfg, micro_batches=micro_batches,
                                    batch_sharding=part)
        one = jax.jit(metrics, in_shardings=(state_shardings(params, mesh), rows, rows, replicated(mesh)),
                      out_shardings=replicated(mesh))
    return jax.device_get([one(params, jnp.asarray(b["tokens"], jnp.int32), jnp.asarray(b["segment_ids"], jnp.int32),
                               step_) for b in batches])


def _merged_metrics(params, tokens_BT, seg_BT, step, *, graphdef, loss_cfg: LossConfig, **parts) -> dict:
    return batch_metrics(nnx.merge(graphdef, params), tokens_BT, seg_BT, step=step, loss_cfg=loss_cfg, **parts)
