"""AdamW with a decay mask, warmup + decay learning-rate schedule and global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtpjax.config import Config, OptimConfig


def lr_schedule(ocfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to optim.lr, then cosine / linear decay to lr*min_lr_ratio at total_steps (or constant)."""
    peak, floor = ocfg.lr, ocfg.lr * ocfg.min_lr_ratio
    warm = max(0, min(ocfg.warmup_steps, total_steps))
    decay_steps = max(1, total_steps - warm)
    if ocfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=ocfg.min_lr_ratio)
    elif ocfg.schedule == "linear":
        after = optax.linear_schedule(peak, floor, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warm == 0:
        return after
    # Warmup starts at peak/warm (not 0) so the first update already moves the parameters.
    return optax.join_schedules([optax.linear_schedule(peak / warm, peak, warm - 1), after], [warm])


def decay_mask(model: nnx.Module):
    """True for parameters that get weight decay: matrices (>= 2 logical axes), not norm scales."""
    params = nnx.state(model, nnx.Param)

    def wants_decay(v: nnx.Variable) -> bool:
        axes = v.get_metadata().get("logical_axes")
        return len(axes) >= 2 if axes is not None else np.ndim(v.get_value()) >= 2

    return jax.tree.map(wants_decay, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_tx(ocfg: OptimConfig, total_steps: int, mask) -> optax.GradientTransformation:
    """Clip (global norm) -> AdamW(schedule, masked decay)."""
    adamw = optax.adamw(lr_schedule(ocfg, total_steps), b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps,
                        weight_decay=ocfg.weight_decay, mask=mask)
    if ocfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(ocfg.grad_clip), adamw)
    return adamw


def make_optimizer(cfg: Config, model: nnx.Module) -> nnx.Optimizer:
    """nnx.Optimizer over the model's Params with the configured AdamW chain."""
    return nnx.Optimizer(model, make_tx(cfg.optim, cfg.train.steps, decay_mask(model)), wrt=nnx.Param)


def global_norm(tree) -> jax.Array:
    """float32 L2 norm over all leaves."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
