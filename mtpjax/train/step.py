"""TrainState and the jitted programs of training: sharded init, the train step (micro-batched, guarded), eval.

The step functions are top-level; `make_programs` binds their static parts with functools.partial and
jits them once with explicit shardings and a donated state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from mtpjax.config import Config, LossConfig
from mtpjax.eval.validation import batch_metrics
from mtpjax.nn.loss import add_expected_lengths, forward, mtp_loss, token_counts
from mtpjax.nn.model import MTPTransformer, build_model, moe_layers
from mtpjax.nn.moe import load_metrics, next_bias
from mtpjax.train.optim import decay_mask, global_norm, lr_schedule, make_tx, trainable, with_lr
from mtpjax.parallel import pipeline
from mtpjax.parallel.sharding import batch_sharding, micro_batches_of, replicated, run_placement, state_shardings


@struct.dataclass
class TrainState:
    """Everything a train step reads and writes, and what a checkpoint holds besides the data position."""

    params: nnx.State  # nnx.state(model): every variable of the model
    opt: Any  # optax state of make_tx over the trainable part of params (optim.trainable: all, or the MTP modules)
    step: jax.Array  # int32[]: batches consumed, skipped ones included; λ(step) and lr(step) read it
    rng: jax.Array  # uint32[2]: key data of the run's key; step s would draw from fold_in(key, s)


def split_trainable(params: nnx.State, what=nnx.Param) -> tuple[nnx.State, nnx.State]:
    """(the part the optimizer updates, the rest) of a model state; `what` is optim.trainable's filter."""
    return nnx.split_state(params, what, ...)


def new_state(params: nnx.State, tx: optax.GradientTransformation, seed: int, step: int = 0,
              what=nnx.Param) -> TrainState:
    """A TrainState around existing parameters: a fresh optimizer over their trainable part, counter at `step`."""
    train, _ = split_trainable(params, what)
    return TrainState(params=params, opt=tx.init(train), step=jnp.asarray(step, jnp.int32),
                      rng=jax.random.key_data(jax.random.key(seed)))


def _sum_micro_metrics(metrics: dict, depth: int) -> dict:
    """Micro-batch metrics were normalized by whole-batch counts, so sums are exact except nonlinear ones."""
    out = {k: v.sum(0) for k, v in metrics.items()}
    out |= {k: v[0] for k, v in metrics.items() if k.split("/")[0] == "lambda"}  # one value per step, not a sum
    return add_expected_lengths(out, depth)


@struct.dataclass
class Backward:
    """One batch's backward pass, summed over its micro-batches."""

    grads: nnx.State  # of the trainable parameters
    metrics: dict  # loss/..., accept_prob/..., lambda/...: what the step reports
    loads: dict  # MoE layer name -> float32[E]: the batch's tokens routed to each expert (empty without MoE)
    dropped: dict  # MoE layer name -> int32[]: of those token-slots, the ones the expert dispatch dropped


def backward(train: nnx.State, frozen: nnx.State, tokens_BT, seg_BT, step, *, graphdef, loss_cfg: LossConfig,
             micro_batches: int, batch_sharding=None) -> Backward:
    """Gradient, metrics and expert loads of one batch, summed over its micro-batches."""
    model = nnx.merge(graphdef, train, frozen)
    depth = model.cfg.mtp_depth
    counts = token_counts(tokens_BT, seg_BT, depth, loss_cfg)
    B, A = tokens_BT.shape[0], micro_batches
    if pipeline.stage_count(model) > 1:  # the micro-batches flow through the stages together (parallel/pipeline.py)
        (_, (mets, loads)), grads = jax.value_and_grad(pipeline.loss, has_aux=True)(
            train, frozen, tokens_BT, seg_BT, step, graphdef=graphdef, loss_cfg=loss_cfg, micro_batches=A,
            counts=counts)
        return Backward(grads, _sum_micro_metrics(mets, depth), {k: v[0].sum(0) for k, v in loads.items()},
                        {k: v[1].sum(0) for k, v in loads.items()})

    def loss_fn(train, tok_BT, seg_BT):
        model = nnx.merge(graphdef, train, frozen)
        out = forward(model, tok_BT, seg_BT, loss_cfg)
        loss, met = mtp_loss(model, out, tok_BT, seg_BT, step=step, cfg=loss_cfg, counts=counts, rows=B)
        return loss, (met, {k: (aux["load"], aux["dropped"]) for k, aux in out.routing.items()})

    def body(acc, xs):
        if batch_sharding is not None:
            xs = tuple(jax.lax.with_sharding_constraint(x, batch_sharding) for x in xs)
        (_, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(train, *xs)
        return jax.tree.map(jnp.add, acc, g), aux

    grads, (mets, loads) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, train),
                                        (micro_batches_of(tokens_BT, A), micro_batches_of(seg_BT, A)))
    return Backward(grads, _sum_micro_metrics(mets, depth), {k: v[0].sum(0) for k, v in loads.items()},
                    {k: v[1].sum(0) for k, v in loads.items()})


def loss_and_grads(train: nnx.State, frozen: nnx.State, tokens_BT, seg_BT, step, **kw) -> tuple[nnx.State, dict]:
    """(gradient of the trainable parameters, metrics) of one batch: `backward` without the expert loads."""
    out = backward(train, frozen, tokens_BT, seg_BT, step, **kw)
    return out.grads, out.metrics


def balance_experts(model: MTPTransformer, loads: dict, speed, frozen_trunk: bool, dropped: dict) -> dict:
    """Move the MoE layers' routing biases in place from their loads (a frozen trunk's stay); their metrics (loads,
    biases, the fraction of token-slots dropped).

    Inside the jitted step the batch is the global one (every process's rows, every micro-batch summed), so these
    loads are already global: no collective is written here, the compiler inserts it.
    """
    metrics, layers = {}, moe_layers(model)
    for name, load in loads.items():
        bias = layers[name].bias
        if not (frozen_trunk and name.startswith("blocks")):
            bias[...] = next_bias(bias[...], load, speed)
        metrics |= load_metrics(name, load, bias[...], dropped[name])
    if metrics:
        metrics["moe/load_max_over_mean"] = jnp.max(jnp.stack([v for k, v in metrics.items()
                                                               if k.endswith("load_max_over_mean")]))
        metrics["moe/dropped_fraction"] = (sum(d.sum() for d in dropped.values())
                                           / jnp.maximum(sum(v.sum() for v in loads.values()), 1))
    return metrics


def train_step(state: TrainState, tokens_BT, seg_BT, *, graphdef, tx: optax.GradientTransformation,
               lr: optax.Schedule, loss_cfg: LossConfig, micro_batches: int, batch_sharding=None, what=nnx.Param,
               bias_update_speed: float = 0.0, frozen_trunk: bool = False):
    """(next state, metrics) of one batch; a non-finite loss or gradient skips the update (the expert biases' too),
    not the counter."""
    # Frozen parameters are closed over, not differentiated: a frozen trunk's forward builds no backward.
    train, frozen = split_trainable(state.params, what)
    back = backward(train, frozen, tokens_BT, seg_BT, state.step, graphdef=graphdef, loss_cfg=loss_cfg,
                    micro_batches=micro_batches, batch_sharding=batch_sharding)
    grads, metrics = back.grads, back.metrics
    lr_now = jnp.asarray(lr(state.step), jnp.float32)
    gnorm = global_norm(grads)
    ok = jnp.isfinite(metrics["loss/total"]) & jnp.isfinite(gnorm)

    def update(train, opt):
        updates, opt = tx.update(grads, with_lr(opt, lr_now), train)
        return optax.apply_updates(train, updates), opt

    # The skip happens inside the program, so XLA updates parameters and moments in place either way
    # (a select between new and old state would need both alive); the host decides to stop or go on.
    train, opt = jax.lax.cond(ok, update, lambda train, opt: (train, opt), train, state.opt)
    params = nnx.merge_state(train, frozen)
    if back.loads:
        model = nnx.merge(graphdef, params)
        metrics |= balance_experts(model, back.loads, jnp.where(ok, bias_update_speed, 0.0), frozen_trunk,
                                   back.dropped)
        params = nnx.state(model)
    new = state.replace(params=params, opt=opt, step=state.step + 1)
    return new, {**metrics, "lr": lr_now, "grad_norm": gnorm, "skipped": (~ok).astype(jnp.int32)}


def eval_step(state: TrainState, tokens_BT, seg_BT, *, graphdef, loss_cfg: LossConfig, micro_batches: int = 1,
              batch_sharding=None) -> dict:
    """Validation metrics of one batch at the state's step, without gradients, in the train step's micro-batches
    (mtpjax.eval.validation)."""
    return batch_metrics(nnx.merge(graphdef, state.params), tokens_BT, seg_BT, step=state.step, loss_cfg=loss_cfg,
                         micro_batches=micro_batches, batch_sharding=batch_sharding)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled-once functions of a run and the layouts they use."""

    graphdef: Any  # the model's nnx graph; nnx.merge(graphdef, state.params) is the model
    tx: optax.GradientTransformation
    shardings: TrainState  # NamedShardings of every TrainState leaf
    target: TrainState  # ShapeDtypeStructs with those shardings: what a checkpoint restores onto
    batch_sharding: Any
    init: Callable  # () -> TrainState, created directly in its sharded layout
    train_step: Callable  # (state, tokens_BT, seg_BT) -> (state, metrics)
    eval_step: Callable  # (state, tokens_BT, seg_BT) -> metrics


def make_programs(cfg: Config, mesh: Mesh) -> Programs:
    """Trace the state abstractly (nothing allocated), then jit init, train and eval steps with their shardings."""
    # Built for the mesh: the kernels its platform has, expert parallelism on an expert axis (nn/placement.py).
    where = run_placement(cfg.mesh, mesh)
    abstract = nnx.eval_shape(lambda: build_model(cfg, seed=cfg.train.seed, placement=where))
    graphdef, abs_params = nnx.split(abstract)
    what = trainable(cfg.train)
    tx = make_tx(cfg.optim, decay_mask(split_trainable(abs_params, what)[0]))

    def init() -> TrainState:
        return new_state(nnx.state(build_model(cfg, seed=cfg.train.seed)), tx, cfg.train.seed, what=what)

    shardings = state_shardings(jax.eval_shape(init), mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(init),
                          shardings)
    bsh, rep = batch_sharding(mesh), replicated(mesh)
    step = functools.partial(train_step, graphdef=graphdef, tx=tx, lr=lr_schedule(cfg.optim, cfg.train.steps),
                             loss_cfg=cfg.loss, micro_batches=cfg.train.micro_batches, batch_sharding=bsh, what=what,
                             bias_update_speed=cfg.train.bias_update_speed, frozen_trunk=cfg.train.freeze == "trunk")
    evaluate = functools.partial(eval_step, graphdef=graphdef, loss_cfg=cfg.loss,
                                 micro_batches=cfg.train.micro_batches, batch_sharding=bsh)
    return Programs(
        graphdef=graphdef, tx=tx, shardings=shardings, target=target, batch_sharding=bsh,
        init=jax.jit(init, out_shardings=shardings),
        train_step=jax.jit(step, in_shardings=(shardings, bsh, bsh), out_shardings=(shardings, rep), donate_argnums=0),
        eval_step=jax.jit(evaluate, in_shardings=(shardings, bsh, bsh), out_shardings=rep),
    )
