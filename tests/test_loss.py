"""MTP loss vs a per-position loop reference, chunking, empty depths, lambda schedules, overfitting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mtpjax.config import LossConfig
from mtpjax.loss import lambda_schedule, mtp_loss, token_counts
from mtpjax.model import build_model

T = 12


def reference(logits, tokens, seg, lam):
    """Loss and metrics of DESIGN §2 with explicit loops over depths, rows and positions (float64)."""
    logits = np.asarray(logits, np.float64)
    K, B, _, _ = logits.shape
    D = K - 1
    am = logits.argmax(-1)
    loss_k, acc_k, agree_k = [], [], []
    for k in range(K):
        ce_sum = acc_sum = agree_sum = n = 0.0
        for b in range(B):
            for i in range(T):
                j = i + k + 1
                if j >= T or seg[b, j] == 0 or seg[b, i] != seg[b, j]:
                    continue
                row = logits[k, b, i]
                lse = row.max() + np.log(np.exp(row - row.max()).sum())
                ce_sum += lse - row[tokens[b, j]]
                acc_sum += am[k, b, i] == tokens[b, j]
                agree_sum += am[k, b, i] == am[0, b, i + k]
                n += 1
        loss_k.append(ce_sum / max(1.0, n))
        acc_k.append(acc_sum / max(1.0, n))
        agree_k.append(agree_sum / max(1.0, n))
    ref = {"loss/main": loss_k[0], "accuracy/main": acc_k[0], "lambda": lam,
           "loss/total": loss_k[0] + (lam / D * sum(loss_k[1:]) if D else 0.0)}
    run, eal = 1.0, 1.0
    for k in range(1, K):
        ref[f"loss/mtp_{k}"], ref[f"accuracy/mtp_{k}"], ref[f"agreement/mtp_{k}"] = loss_k[k], acc_k[k], agree_k[k]
        run *= agree_k[k]
        eal += run
    if D:
        ref["expected_accept_length"] = eal
    return ref


def packed_batch(V, seed=0):
    """Three rows: several documents + padding, one document, documents with unordered ids."""
    toks = np.random.default_rng(seed).integers(0, V, (3, T)).astype(np.int32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
                    [1] * T,
                    [7, 7, 7, 7, 7, 2, 2, 2, 2, 2, 2, 0]], np.int32)
    return toks, seg


def check_against_reference(model, toks, seg, cfg, step, lam):
    out = model(jnp.asarray(toks), jnp.asarray(seg))
    loss, metrics = mtp_loss(model, out, jnp.asarray(toks), jnp.asarray(seg), step=step, cfg=cfg)
    ref = reference(model.logits(out.hidden), toks, seg, lam)
    assert set(metrics) == set(ref)
    for name, want in ref.items():
        np.testing.assert_allclose(float(metrics[name]), want, rtol=2e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(float(loss), ref["loss/total"], rtol=2e-6)
    return metrics


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
@pytest.mark.parametrize("chunk", [0, 4])
def test_loss_matches_loop_reference(model_cfg, kind, chunk):
    model = build_model(model_cfg(mtp_depth=3, mtp_kind=kind, init_std=0.3), seed=0)
    toks, seg = packed_batch(model.cfg.vocab_size)
    m = check_against_reference(model, toks, seg, LossConfig("piecewise:0.3@10,0.1", chunk), step=10, lam=0.1)
    assert 0 < float(m["agreement/mtp_1"]) < 1  # the agreement check is not vacuous here


def test_plain_lm_loss(model_cfg):
    model = build_model(model_cfg(mtp_depth=0, init_std=0.3))
    toks, seg = packed_batch(32, seed=1)
    m = check_against_reference(model, toks, seg, LossConfig(), step=0, lam=0.3)
    assert "expected_accept_length" not in m


def test_no_segments_means_one_document(model_cfg):
    model = build_model(model_cfg(init_std=0.3))
    toks, _ = packed_batch(32, seed=2)
    out = model(jnp.asarray(toks))
    loss, _ = mtp_loss(model, out, jnp.asarray(toks), None, step=0)
    ref = reference(model.logits(out.hidden), toks, np.ones_like(toks), 0.3)
    np.testing.assert_allclose(float(loss), ref["loss/total"], rtol=2e-6)


def test_chunked_equals_unchunked_with_gradients(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=1)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=3))

    def run(chunk):
        def f(m):
            return mtp_loss(m, m(toks, seg), toks, seg, step=0, cfg=LossConfig(chunk_size=chunk))
        (loss, metrics), g = nnx.value_and_grad(f, has_aux=True)(model)
        return loss, metrics, nnx.to_pure_dict(g)

    (l0, m0, g0), (l1, m1, g1) = run(0), run(3)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, err_msg=k)
    # float32 summation order differs between chunkings: absolute slack relative to each tensor's scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()), g1, g0)


def test_empty_depth_gives_no_nan(model_cfg):
    model = build_model(model_cfg(mtp_depth=2))
    toks = jnp.asarray([[3, 4, 5, 6], [1, 2, 3, 4]], jnp.int32)
    seg = jnp.asarray([[1, 1, 2, 2], [1, 1, 0, 0]], jnp.int32)  # no pair i, i+3 in one document

    def f(m):
        return mtp_loss(m, m(toks, seg), toks, seg, step=0)

    (loss, metrics), g = nnx.value_and_grad(f, has_aux=True)(model)
    np.testing.assert_array_equal(token_counts(toks, seg, 2), [3, 0, 0])
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert float(metrics["loss/mtp_2"]) == 0 and float(metrics["agreement/mtp_2"]) == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    # all padding: every depth is empty
    loss, metrics = mtp_loss(model, model(toks), toks, jnp.zeros_like(seg), step=0)
    assert float(loss) == 0 and all(np.isfinite(float(v)) for v in metrics.values())


def test_counts_let_micro_batches_sum_to_full_batch(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3))
    toks, seg = map(jnp.asarray, packed_batch(32, seed=4))
    full, _ = mtp_loss(model, model(toks, seg), toks, seg, step=0)
    counts = token_counts(toks, seg, 2)
    parts = [mtp_loss(model, model(toks[s], seg[s]), toks[s], seg[s], step=0, counts=counts)[0]
             for s in (slice(0, 1), slice(1, 3))]
    np.testing.assert_allclose(float(sum(parts)), float(full), rtol=1e-6)


@pytest.mark.parametrize("spec, points", [
    ("constant:0.3", {0: 0.3, 10**6: 0.3}),
    ("0.25", {0: 0.25, 7: 0.25}),
    ("piecewise:0.3@1000,0.1", {0: 0.3, 999: 0.3, 1000: 0.1, 10**6: 0.1}),
    ("piecewise:1@10,0.5@20,0", {0: 1.0, 9: 1.0, 10: 0.5, 19: 0.5, 20: 0.0, 100: 0.0}),
    ("linear:0.3->0.1@1000", {0: 0.3, 500: 0.2, 1000: 0.1, 5000: 0.1}),
    ("cosine:0.3->0.1@1000", {0: 0.3, 500: 0.2, 1000: 0.1, 5000: 0.1}),
    ("cosine:0->0.1@100", {0: 0.0, 50: 0.05, 100: 0.1, 200: 0.1}),
])
def test_lambda_schedule_values(spec, points):
    sched = lambda_schedule(spec)
    jitted = jax.jit(sched)
    for step, want in points.items():
        np.testing.assert_allclose(float(sched(step)), want, rtol=1e-6, atol=1e-7, err_msg=f"{spec} @ {step}")
        np.testing.assert_allclose(float(jitted(jnp.int32(step))), want, rtol=1e-6, atol=1e-7)


def test_overfit_one_batch_every_depth(model_cfg):
    cfg = model_cfg(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=0, mtp_depth=2)
    model = build_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    toks = np.stack([rng.permutation(64)[:32] for _ in range(4)]).astype(np.int32)  # distinct tokens per row
    toks[:, 0] = [1, 2, 3, 4]
    toks, seg = jnp.asarray(toks), jnp.ones((4, 32), jnp.int32)
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    lcfg = LossConfig("constant:1.0")

    @nnx.jit
    def step(model, opt):
        def f(m):
            return mtp_loss(m, m(toks, seg), toks, seg, step=0, cfg=lcfg)
        (_, metrics), g = nnx.value_and_grad(f, has_aux=True)(model)
        opt.update(model, g)
        return metrics

    first = step(model, opt)
    for _ in range(200):
        metrics = step(model, opt)
    metrics = {k: float(v) for k, v in metrics.items()}
    assert float(first["loss/main"]) > 3.0
    for name in ("loss/main", "loss/mtp_1", "loss/mtp_2"):
        assert metrics[name] < 0.05, (name, metrics)
    for k in (1, 2):
        assert metrics[f"agreement/mtp_{k}"] > 0.99 and metrics[f"accuracy/mtp_{k}"] > 0.99, metrics
    assert metrics["expected_accept_length"] > 2.95
