"""Optimizer: schedules, decay mask, micro-batched == full-batch gradients, non-finite updates skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import synthetic_batches, tiny_cfg

from mtpjax.config import OptimConfig, replace
from mtpjax.model import build_model
from mtpjax.optim import decay_mask, lr_schedule, make_tx
from mtpjax.sharding import make_mesh
from mtpjax.train_step import abstract_state, init_state, make_programs


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_lr_warmup_then_decay_to_min_ratio(kind):
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule=kind)
    f = lr_schedule(o, total_steps=110)
    assert float(f(0)) == pytest.approx(0.1)  # first update already moves: lr/warmup
    assert float(f(9)) == pytest.approx(1.0)
    assert float(f(10)) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[kind]
    assert float(f(110)) == pytest.approx(end, abs=1e-6)
    if kind == "cosine":
        assert float(f(60)) == pytest.approx(0.55, abs=1e-6)  # halfway: mean of peak and floor


def test_decay_only_on_matrices_also_in_scanned_stacks(model_cfg):
    for scan in (False, True):
        m = build_model(model_cfg(scan_layers=scan))
        mask = decay_mask(m)
        assert mask["embed"] is True and mask["final_norm"]["scale"] is False
        blocks = mask["blocks"] if scan else mask["blocks"][0]
        assert blocks["attn"]["wq"]["kernel"] is True and blocks["attn_norm"]["scale"] is False


def _programs(tmp_path, *overrides):
    cfg = tiny_cfg(tmp_path, *overrides)
    mesh = make_mesh(cfg.mesh)
    graphdef, _, sh = abstract_state(cfg, mesh)
    return cfg, make_programs(cfg, mesh, graphdef, sh), init_state(cfg, mesh, sh)


def test_micro_batched_gradients_equal_full_batch(tmp_path):
    """Micro-batches normalized by the whole batch's counts sum to the full-batch loss and gradients."""
    tok, seg = synthetic_batches(1, 8, 32)[0]
    assert len({int((s > 0).sum()) for s in seg}) > 1  # rows hold different numbers of targets
    _, full, state = _programs(tmp_path)
    g_full, m_full = full.grads(state, tok, seg, np.int32(3))
    _, micro, _ = _programs(tmp_path, "train.micro_batches=4")
    g_micro, m_micro = micro.grads(state, tok, seg, np.int32(3))
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_micro)):
        # float32 floor scaled to the tensor: elements that are sums of cancelling terms carry
        # absolute rounding error relative to the tensor's scale, not to their own small value
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * float(np.abs(a).max()))
    for k in m_full:
        np.testing.assert_allclose(float(m_micro[k]), float(m_full[k]), rtol=2e-6, err_msg=k)
    assert float(jnp.abs(jax.tree.leaves(g_full)[0]).sum()) > 0
    # Companion: averaging micro-batches each normalized by its own counts is visibly different.
    parts = [full.grads(state, tok[m::4], seg[m::4], np.int32(3))[0] for m in range(4)]
    g_naive = jax.tree.map(lambda *g: sum(g) / 4, *parts)
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(a)).max())
                for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_naive)))
    assert worst > 1e-3


def test_train_step_updates_and_reports_metrics(tmp_path):
    cfg, progs, state = _programs(tmp_path)
    before = np.asarray(state[0]["embed"][...]).copy()
    tok, seg = synthetic_batches(1, 8, 32)[0]
    state, met = progs.train_step(state, tok, seg, np.int32(0))
    for k in ("loss/main", "loss/mtp_1", "loss/mtp_2", "accuracy/mtp_1", "agreement/mtp_2",
              "expected_accept_length", "lambda", "lr", "grad_norm"):
        assert np.isfinite(float(met[k])), k
    assert int(met["skipped"]) == 0 and float(met["lr"]) == pytest.approx(cfg.optim.lr / cfg.optim.warmup_steps)
    assert not np.array_equal(before, np.asarray(state[0]["embed"][...]))


def test_non_finite_step_leaves_state_unchanged(tmp_path):
    _, progs, state = _programs(tmp_path)
    state[0]["final_norm"]["scale"][...] = jnp.full_like(state[0]["final_norm"]["scale"][...], jnp.inf)
    snapshot = [np.asarray(x).copy() for x in jax.tree.leaves(state)]
    tok, seg = synthetic_batches(1, 8, 32)[0]
    new, met = progs.train_step(state, tok, seg, np.int32(0))
    assert int(met["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(new), snapshot):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("clip, expected_mu", [(1.0, 0.05), (0.0, 0.5)])
def test_global_norm_clipping_before_adam(clip, expected_mu):
    """Gradient of global norm 10 clipped to 1: Adam's first moment sees g/10."""
    tx = make_tx(OptimConfig(grad_clip=clip, b1=0.9), 100, mask=None)
    params = {"w": jnp.ones(4)}
    _, st = tx.update({"w": jnp.full(4, 5.0)}, tx.init(params), params)
    adam = st[1][0] if clip else st[0]
    np.testing.assert_allclose(np.asarray(adam.mu["w"]), expected_mu, rtol=1e-6)
