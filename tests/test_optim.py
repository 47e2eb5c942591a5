"""Optimizer: schedules, decay mask, clipping before Adam, the injected learning rate."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtpjax.config import ConfigError, OptimConfig
from mtpjax.nn.model import build_model
from mtpjax.train.optim import decay_mask, lr_schedule, make_tx, with_lr


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [10, 0])
def test_lr_warmup_then_decay_to_min_ratio(kind, warmup):
    """Steps 0..109 run: the peak at the last warmup step alone, the floor (the final learning rate) at step 109."""
    o = OptimConfig(lr=1.0, warmup_steps=warmup, min_lr_ratio=0.1, schedule=kind)
    f = lr_schedule(o, total_steps=110)
    if warmup:
        assert float(f(0)) == pytest.approx(0.1)  # first update already moves: lr/warmup
        assert float(f(9)) == pytest.approx(1.0)
    lr = [float(f(s)) for s in range(warmup, 110)]
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[kind]
    assert lr[-1] == pytest.approx(end, abs=1e-6)
    if kind != "constant":
        assert lr[0] < 1.0 and all(a > b for a, b in zip(lr, lr[1:]))  # decaying from the first step after warmup
        halfway = {10: 59, 0: 54}[warmup]  # the decay's 50th of 100 steps, 55th of 110
        assert float(f(halfway)) == pytest.approx(0.55, abs=1e-6)  # mean of peak and floor


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_a_run_shorter_than_its_warmup_ramps_at_the_warmups_rate(kind):
    """warmup_steps=20, train.steps=10: lr/20 per step as in a longer run (not a ramp squeezed into 10 steps)."""
    o = OptimConfig(lr=1.0, warmup_steps=20, schedule=kind)
    short, long = lr_schedule(o, total_steps=10), lr_schedule(o, total_steps=400)
    assert [float(short(s)) for s in range(10)] == [float(long(s)) for s in range(10)]
    assert float(short(9)) == pytest.approx(0.5)


def test_decay_only_on_matrices_also_in_scanned_stacks(model_cfg):
    for scan in (False, True):
        m = nnx.eval_shape(functools.partial(build_model, model_cfg(scan_layers=scan)))  # metadata only
        mask = decay_mask(nnx.state(m, nnx.Param))
        assert mask["embed"] is True and mask["final_norm"]["scale"] is False
        blocks = mask["blocks"] if scan else mask["blocks"][0]
        assert blocks["attn"]["wq"]["kernel"] is True and blocks["attn_norm"]["scale"] is False


@pytest.mark.parametrize("clip, expected_mu", [(1.0, 0.05), (0.0, 0.5)])
def test_global_norm_clipping_before_adam(clip, expected_mu):
    """Gradient of global norm 10 clipped to 1: Adam's first moment sees g/10."""
    tx = make_tx(OptimConfig(grad_clip=clip, b1=0.9), mask=None)
    params = {"w": jnp.ones(4)}
    _, st = tx.update({"w": jnp.full(4, 5.0)}, tx.init(params), params)
    adam = st.inner_state[1][0] if clip else st.inner_state[0]
    np.testing.assert_allclose(np.asarray(adam.mu["w"]), expected_mu, rtol=1e-6)


def test_the_injected_learning_rate_is_the_one_applied():
    """with_lr sets the rate of the next update: the same gradient moves a parameter 3x as far at 3x the rate."""
    tx = make_tx(OptimConfig(grad_clip=0.0, weight_decay=0.0), mask=None)
    params, g = {"w": jnp.ones(4)}, {"w": jnp.full(4, 0.5)}
    moved = [tx.update(g, with_lr(tx.init(params), lr), params)[0]["w"] for lr in (1e-3, 3e-3)]
    np.testing.assert_allclose(np.asarray(moved[1]), 3 * np.asarray(moved[0]), rtol=1e-6)
    assert float(moved[0][0]) == pytest.approx(-1e-3, rel=1e-4)  # Adam's first step: -lr * sign(g)


def test_adam_eps_zero_is_refused_because_a_never_moved_parameter_would_become_nan():
    """optim.eps must be > 0: Adam's first update of a parameter whose gradient is 0 (an unseen token's untied
    embedding row) is 0/(0 + eps); the companion bypasses the bound and gets NaN."""
    with pytest.raises(ConfigError, match="optim.eps"):
        OptimConfig(eps=0.0)
    params, g = {"w": jnp.ones(4)}, {"w": jnp.zeros(4)}
    for eps, finite in ((OptimConfig().eps, True), (0.0, False)):
        tx = make_tx(OptimConfig(grad_clip=0.0).model_copy(update={"eps": eps}), mask=None)
        assert bool(jnp.isfinite(tx.update(g, tx.init(params), params)[0]["w"]).all()) is finite
