"""The jitted programs of training: sharded state init, the train step (with micro-batching), eval, greedy samples."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mtpjax.config import Config
from mtpjax.loss import expected_accept_length, mtp_loss, token_counts
from mtpjax.model import build_model
from mtpjax.optim import global_norm, lr_schedule, make_optimizer
from mtpjax.sharding import batch_sharding, replicated, state_shardings


def _make_model_and_optimizer(cfg: Config):
    model = build_model(cfg, seed=cfg.train.seed)
    return model, make_optimizer(cfg, model)


def abstract_state(cfg: Config, mesh: Mesh):
    """(graphdef, abstract state with target shardings, shardings) of model+optimizer, without allocating."""
    graphdef, abs_state = nnx.split(nnx.eval_shape(lambda: _make_model_and_optimizer(cfg)))
    shardings = state_shardings(abs_state, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings)
    return graphdef, target, shardings


def init_state(cfg: Config, mesh: Mesh, shardings):
    """Model+optimizer state created directly in its sharded layout (jitted init with out_shardings)."""
    return jax.jit(lambda: nnx.split(_make_model_and_optimizer(cfg))[1], out_shardings=shardings)()


def _sum_micro_metrics(metrics: dict, depth: int) -> dict:
    """Micro-batch metrics were normalized by whole-batch counts, so sums are exact except nonlinear ones."""
    out = {k: v.sum(0) for k, v in metrics.items()}
    out["lambda"] = metrics["lambda"][0]
    if depth:
        out["expected_accept_length"] = expected_accept_length([out[f"agreement/mtp_{k}"] for k in range(1, depth + 1)])
    return out


@dataclasses.dataclass
class Programs:
    """Compiled-once functions over the (graphdef, state) split, plus the shardings they use."""

    graphdef: Any
    shardings: Any
    batch_sharding: Any
    train_step: Callable  # (state, tokens_BT, seg_BT, step) -> (state, metrics)
    grads: Callable  # (state, tokens_BT, seg_BT, step) -> (grads, metrics), for tests
    eval_step: Callable  # (state, tokens_BT, seg_BT, step) -> metrics
    sample: Callable  # (state, prompt_BP) -> tokens_BN (greedy continuation)


def make_programs(cfg: Config, mesh: Mesh, graphdef, shardings, sample_tokens: int = 64) -> Programs:
    """Build the jitted train/eval/sample functions with explicit in/out shardings and donated state."""
    D, M = cfg.model.mtp_depth, cfg.train.micro_batches
    lr_fn = lr_schedule(cfg.optim, cfg.train.steps)
    bsh, rep = batch_sharding(mesh), replicated(mesh)

    def loss_fn(params, rest, mgdef, tokens_BT, seg_BT, step, counts):
        model = nnx.merge(mgdef, params, rest)
        out = model(tokens_BT, seg_BT)
        return mtp_loss(model, out, tokens_BT, seg_BT, step=step, cfg=cfg.loss, counts=counts)

    def grads_and_metrics(state, tokens_BT, seg_BT, step):
        model, _ = nnx.merge(graphdef, state)
        mgdef, params, rest = nnx.split(model, nnx.Param, ...)
        counts = token_counts(tokens_BT, seg_BT, D)
        B, T = tokens_BT.shape
        # Micro-batch m holds rows m, m+M, ...: every device keeps its own rows, no resharding.
        split = lambda x: x.reshape(B // M, M, T).swapaxes(0, 1)

        def body(acc, xs):
            tok, seg = (jax.lax.with_sharding_constraint(x, bsh) for x in xs)
            (_, met), g = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, mgdef, tok, seg, step, counts)
            return jax.tree.map(jnp.add, acc, g), met

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, mets = jax.lax.scan(body, zeros, (split(tokens_BT), split(seg_BT)))
        return grads, _sum_micro_metrics(mets, D)

    def train_step(state, tokens_BT, seg_BT, step):
        old = jax.tree.map(lambda x: x, state)  # merge shares Variables with `state`; update mutates them
        grads, metrics = grads_and_metrics(state, tokens_BT, seg_BT, step)
        model, opt = nnx.merge(graphdef, state)
        gnorm = global_norm(grads)
        metrics["lr"] = jnp.asarray(lr_fn(opt.step[...]), jnp.float32)
        opt.update(model, grads)
        new_state = nnx.split((model, opt))[1]
        # A non-finite loss or gradient leaves the state untouched; the host decides to stop or go on.
        ok = jnp.isfinite(metrics["loss/total"]) & jnp.isfinite(gnorm)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, old)
        metrics["grad_norm"] = gnorm
        metrics["skipped"] = (~ok).astype(jnp.int32)
        return new_state, metrics

    def eval_step(state, tokens_BT, seg_BT, step):
        model, _ = nnx.merge(graphdef, state)
        return mtp_loss(model, model(tokens_BT, seg_BT), tokens_BT, seg_BT, step=step, cfg=cfg.loss)[1]

    def sample(state, prompt_BP):
        model, _ = nnx.merge(graphdef, state)
        B, P = prompt_BP.shape
        buf = jnp.concatenate([prompt_BP, jnp.zeros((B, sample_tokens), prompt_BP.dtype)], axis=1)

        def body(i, buf):
            # Causal attention: the zeros after position i-1 cannot change its hidden state.
            h, _ = model.trunk(buf)
            h_last = jax.lax.dynamic_index_in_dim(h, i - 1, axis=1, keepdims=False)
            nxt = jnp.argmax(model.logits(model.final_norm(h_last)), axis=-1).astype(buf.dtype)
            return buf.at[:, i].set(nxt)

        return jax.lax.fori_loop(P, P + sample_tokens, body, buf)[:, P:]

    in_sh = (shardings, bsh, bsh, rep)
    return Programs(
        graphdef=graphdef, shardings=shardings, batch_sharding=bsh,
        train_step=jax.jit(train_step, in_shardings=in_sh, out_shardings=(shardings, rep), donate_argnums=0),
        grads=jax.jit(grads_and_metrics, in_shardings=in_sh),
        eval_step=jax.jit(eval_step, in_shardings=in_sh, out_shardings=rep),
        sample=jax.jit(sample, in_shardings=(shardings, rep), out_shardings=rep),
    )
