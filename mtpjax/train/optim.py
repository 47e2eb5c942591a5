"""AdamW with a decay mask and global-norm clipping; the learning rate is a schedule of the train step counter.

The schedule is not inside the optax chain: the chain is wrapped by `optax.inject_hyperparams` and the
train step writes `lr_schedule(step)` into it before each update (`with_lr`), so the learning rate and
λ(step) read the same counter (TrainState.step), also after a skipped update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtpjax.config import OptimConfig, TrainConfig

MTP_ONLY = nnx.All(nnx.Param, nnx.PathContains("mtp"))


def trainable(tcfg: TrainConfig):
    """What the optimizer updates (an nnx filter): every parameter, or with train.freeze=trunk the MTP modules'.

    The train step, the optimizer state and the checkpoints follow it; the rest is closed over, never differentiated.
    """
    return MTP_ONLY if tcfg.freeze == "trunk" else nnx.Param


def lr_schedule(ocfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of step s (the (s+1)-th update): linear warmup reaching optim.lr at the last warmup step, then
    cosine / linear decay reaching lr*min_lr_ratio at the last step, total_steps - 1 (or constant), as Megatron's;
    a run shorter than its warmup ends part way up the ramp."""
    peak, floor = ocfg.lr, ocfg.lr * ocfg.min_lr_ratio
    # Not clamped to total_steps: the rate of a warmup step must not depend on the run's length (the ablation's
    # equal-tokens runs and its longer D=0 run share their first steps, bench/ablation/grid.py)
    warm = ocfg.warmup_steps
    decay_steps = max(1, total_steps - warm)
    if ocfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=ocfg.min_lr_ratio)
    elif ocfg.schedule == "linear":
        decay = optax.linear_schedule(peak, floor, decay_steps)
    else:
        decay = optax.constant_schedule(peak)

    def after(s):  # the decay's first step already decays: the peak is the warmup's last step alone
        return decay(s + 1)
    if warm == 0:
        return after
    # Warmup starts at peak/warm (not 0) so the first update already moves the parameters.
    return optax.join_schedules([optax.linear_schedule(peak / warm, peak, warm - 1), after], [warm])


def decay_mask(params: nnx.State):
    """True for parameters that get weight decay: matrices (>= 2 logical axes), not norm scales."""

    def wants_decay(v: nnx.Variable) -> bool:
        axes = v.get_metadata().get("logical_axes")
        return len(axes) >= 2 if axes is not None else np.ndim(v.get_value()) >= 2

    return jax.tree.map(wants_decay, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_tx(ocfg: OptimConfig, mask) -> optax.GradientTransformation:
    """Clip (global norm) -> AdamW(masked decay), its learning rate injected by the step (see with_lr)."""

    def chain(learning_rate):
        adamw = optax.adamw(learning_rate, b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps,
                            weight_decay=ocfg.weight_decay, mask=mask)
        return optax.chain(optax.clip_by_global_norm(ocfg.grad_clip), adamw) if ocfg.grad_clip > 0 else adamw

    return optax.inject_hyperparams(chain)(learning_rate=ocfg.lr)


def with_lr(opt_state, lr):
    """The optimizer state of make_tx with its learning rate set to `lr` for the next update."""
    hp = opt_state.hyperparams
    return opt_state._replace(hyperparams={**hp, "learning_rate": jnp.asarray(lr, hp["learning_rate"].dtype)})


def global_norm(tree) -> jax.Array:
    """float32 L2 norm over all leaves."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
