"""MTP loss vs a per-position loop reference, chunking, empty depths, lambda schedules, overfitting."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jex_core

from mtpjax.config import LossConfig
from mtpjax.nn import loss
from mtpjax.nn.loss import cross_entropy, first_argmax, mtp_loss, token_counts
from mtpjax.nn import model as model_mod
from mtpjax.nn.model import build_model
from mtpjax.nn.placement import Placement
from mtpjax.objective import LambdaSchedule

T = 12


def _softmax(row, t=1.0):
    e = np.exp((row - row.max()) / t)
    return e / e.sum()


def reference(logits, tokens, seg, lam, w_self=0.0, temp=1.0, accept=False, w_tv=0.0):
    """Loss and metrics of docs/design.md §2 with loops over depths, rows and positions (float64); depth k's loss
    is (1-w_self-w_tv) data CE + w_self soft CE against the main head at i+k (temperature temp, times temp²)
    + w_tv (1 − Σ min(p, q)) against it at temperature 1."""
    logits = np.asarray(logits, np.float64)
    K, B, _, _ = logits.shape
    D = K - 1
    am = logits.argmax(-1)
    loss_k, acc_k, agree_k, accept_k = [], [], [], []
    for k in range(K):
        ce_sum = acc_sum = agree_sum = soft_sum = accept_sum = n = 0.0
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
                p, q = _softmax(logits[0, b, i + k], temp), _softmax(row, temp)
                soft_sum += -(p * np.log(q)).sum() * temp**2
                accept_sum += np.minimum(_softmax(logits[0, b, i + k]), _softmax(row)).sum()
                n += 1
        w, wt = (w_self, w_tv) if k else (0.0, 0.0)
        loss_k.append(((1 - w - wt) * ce_sum + w * soft_sum + wt * (n - accept_sum)) / max(1.0, n))
        acc_k.append(acc_sum / max(1.0, n))
        agree_k.append(agree_sum / max(1.0, n))
        accept_k.append(accept_sum / max(1.0, n))
    ref = {"loss/main": loss_k[0], "accuracy/main": acc_k[0], "lambda": lam,
           "loss/total": loss_k[0] + (lam / D * sum(loss_k[1:]) if D else 0.0)}
    run, eal, run_s, eal_s = 1.0, 1.0, 1.0, 1.0
    for k in range(1, K):
        ref[f"loss/mtp_{k}"], ref[f"accuracy/mtp_{k}"], ref[f"agreement/mtp_{k}"] = loss_k[k], acc_k[k], agree_k[k]
        ref[f"lambda/mtp_{k}"] = lam
        run *= agree_k[k]
        eal += run
        run_s *= accept_k[k]
        eal_s += run_s
        if accept:
            ref[f"accept_prob/mtp_{k}"] = accept_k[k]
    if D:
        ref["expected_accept_length"] = eal
        if accept:
            ref["expected_accept_length_sampled"] = eal_s
    return ref


def packed_batch(V, seed=0):
    """Three rows: several documents + padding, one document, documents with unordered ids."""
    toks = np.random.default_rng(seed).integers(0, V, (3, T)).astype(np.int32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0, 0],
                    [1] * T,
                    [7, 7, 7, 7, 7, 2, 2, 2, 2, 2, 2, 0]], np.int32)
    return toks, seg


def check_against_reference(model, toks, seg, cfg, step, lam, accept=False):
    out = model(jnp.asarray(toks), jnp.asarray(seg))
    loss, metrics = mtp_loss(model, out, jnp.asarray(toks), jnp.asarray(seg), step=step, cfg=cfg,
                             with_accept_prob=accept)
    w_self, w_tv = cfg.mtp_target.weight("self"), cfg.mtp_target.weight("tv")
    ref = reference(model.logits(out.hidden), toks, seg, lam, w_self, cfg.distill_temperature,
                    accept=accept or w_self > 0 or w_tv > 0, w_tv=w_tv)
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


@pytest.mark.parametrize("kind, chunk, target, temp", [
    ("sequential", 0, "self", 1.0), ("sequential", 4, "self", 2.0), ("parallel", 4, "mix:0.25", 0.5),
    ("sequential", 3, "data", 1.0), ("sequential", 4, "tv", 2.0), ("parallel", 0, "mix:data=0.2,self=0.3,tv=0.5", 0.5)])
def test_self_targets_and_accept_prob_match_loop_reference(model_cfg, kind, chunk, target, temp):
    """Depth k at i against the main head's softmax at i+k, chunked; accept_prob = Σ min(p, q) at temperature 1."""
    model = build_model(model_cfg(mtp_depth=3, mtp_kind=kind, init_std=0.3), seed=2)
    toks, seg = packed_batch(model.cfg.vocab_size, seed=5)
    cfg = LossConfig("constant:0.3", chunk, mtp_target=target, distill_temperature=temp)
    m = check_against_reference(model, toks, seg, cfg, step=0, lam=0.3, accept=True)
    assert 0 < float(m["accept_prob/mtp_1"]) < 1 and float(m["expected_accept_length_sampled"]) > 1


def test_mix_endpoints_are_data_and_self(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=3)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=6))
    out = model(toks, seg)
    loss = lambda t: float(mtp_loss(model, out, toks, seg, step=0, cfg=LossConfig(mtp_target=t))[0])
    assert loss("mix:0") == loss("data") and loss("mix:1") == loss("self") and loss("self") != loss("data")


@pytest.mark.parametrize("target", ["self", "tv"])
def test_self_target_sends_no_gradient_into_the_teacher(model_cfg, monkeypatch, target):
    """The trunk's final norm feeds only the main head: its gradient is L_0's alone, whatever the MTP target."""
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=4)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=7))

    def final_norm_grad(target):
        f = lambda m: mtp_loss(m, m(toks, seg), toks, seg, step=0, cfg=LossConfig(mtp_target=target))[0]
        return np.asarray(nnx.jit(nnx.grad(f))(model)["final_norm"]["scale"][...])

    data = final_norm_grad("data")
    np.testing.assert_array_equal(final_norm_grad(target), data)
    # Companion: without the stop-gradient the distillation term pulls the teacher toward the drafts.
    monkeypatch.setattr(jax.lax, "stop_gradient", lambda x: x)
    assert np.abs(final_norm_grad(target) - data).max() > 1e-6


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


def _loss_metrics_grads(model, toks, seg, chunk):
    def f(m):
        return mtp_loss(m, m(toks, seg), toks, seg, step=0, cfg=LossConfig(chunk_size=chunk))
    (loss, metrics), g = nnx.value_and_grad(f, has_aux=True)(model)
    return loss, metrics, nnx.to_pure_dict(g)


def _assert_same_loss(chunked, whole):
    (l1, m1, g1), (l0, m0, g0) = chunked, whole
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for k in m0:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, err_msg=k)
    # float32 summation order differs between chunkings: absolute slack relative to each tensor's scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()), g1, g0)


@pytest.mark.slow
def test_chunked_equals_unchunked_with_gradients(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=1)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=3))
    _assert_same_loss(_loss_metrics_grads(model, toks, seg, 3), _loss_metrics_grads(model, toks, seg, 0))


def test_companion_a_chunk_boundary_off_by_one_is_caught(model_cfg, monkeypatch):
    """The comparison above can fail: chunks after the first starting one hidden row early (row 3u-1 meets
    the target of row 3u) change the loss."""
    import mtpjax.nn.loss as loss_module

    real = loss_module.per_position

    def off_by_one(model, hidden_MBTD, tgt_MBT, chunk_size=0, *args, **kw):
        rows = np.arange(hidden_MBTD.shape[2])
        if chunk_size:
            rows[chunk_size::chunk_size] -= 1
        return real(model, hidden_MBTD[:, :, rows], tgt_MBT, chunk_size, *args, **kw)

    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=1)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=3))
    whole = _loss_metrics_grads(model, toks, seg, 0)
    monkeypatch.setattr(loss_module, "per_position", off_by_one)
    with pytest.raises(AssertionError):
        _assert_same_loss(_loss_metrics_grads(model, toks, seg, 3), whole)


def test_empty_depth_gives_no_nan(model_cfg):
    model = build_model(model_cfg(mtp_depth=2))
    toks = jnp.asarray([[3, 4, 5, 6], [1, 2, 3, 4]], jnp.int32)
    seg = jnp.asarray([[1, 1, 2, 2], [1, 1, 0, 0]], jnp.int32)  # no pair i, i+3 in one document

    def f(m):
        return mtp_loss(m, m(toks, seg), toks, seg, step=0)

    (loss, metrics), g = nnx.jit(nnx.value_and_grad(f, has_aux=True))(model)  # one program, not one per op
    np.testing.assert_array_equal(token_counts(toks, seg, 2), [3, 0, 0])
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert float(metrics["loss/mtp_2"]) == 0 and float(metrics["agreement/mtp_2"]) == 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    # all padding: every depth is empty
    loss, metrics = nnx.jit(lambda m: mtp_loss(m, m(toks), toks, jnp.zeros_like(seg), step=0))(model)
    assert float(loss) == 0 and all(np.isfinite(float(v)) for v in metrics.values())


def test_counts_let_micro_batches_sum_to_full_batch(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3))
    toks, seg = map(jnp.asarray, packed_batch(32, seed=4))
    loss = nnx.jit(lambda m, t, s, c: mtp_loss(m, m(t, s), t, s, step=0, counts=c)[0])  # one program per shape
    full = loss(model, toks, seg, None)
    counts = token_counts(toks, seg, 2)
    parts = [loss(model, toks[s], seg[s], counts) for s in (slice(0, 1), slice(1, 3))]
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
    sched = LambdaSchedule.parse(spec)  # λ(step)
    jitted = jax.jit(sched)
    for step, want in points.items():
        np.testing.assert_allclose(float(sched(step)), want, rtol=1e-6, atol=1e-7, err_msg=f"{spec} @ {step}")
        np.testing.assert_allclose(float(jitted(jnp.int32(step))), want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
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


def test_first_argmax_is_argmax_ties_included():
    x = jax.random.normal(jax.random.key(0), (3, 5, 64))
    x = x.at[0, :, 7].set(9.0).at[0, :, 40].set(9.0)  # ties: argmax takes the first
    x = x.at[1, 2].set(0.0)  # a row that is all ties
    for platform in ("cpu", "gpu"):
        assert (first_argmax(x, platform) == jnp.argmax(x, axis=-1)).all()
        assert (first_argmax(x, platform)[0] == 7).all() and first_argmax(x, platform)[1, 2] == 0


def _plain_cross_entropy(x, tgt):
    return jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, tgt[..., None], axis=-1)[..., 0]


def _ce_value_and_grad(ce):
    x = 3 * jax.random.normal(jax.random.key(0), (3, 5, 64))
    tgt = jax.random.randint(jax.random.key(1), (3, 5), 0, 64)
    w = jax.random.normal(jax.random.key(2), (3, 5))
    return jax.jit(jax.value_and_grad(lambda x: (w * ce(x, tgt)).sum()))(x)


def test_cross_entropy_and_its_written_out_gradient_are_autodiff_of_the_formula_bit_for_bit():
    """Bit for bit, not within a tolerance: a gradient one rounding off moved the README's tiny run to another
    trajectory (step 30's loss 0.9% apart, 1.5-2% from then on), past two of its tests' thresholds."""
    (v, g), (v_ref, g_ref) = _ce_value_and_grad(cross_entropy), _ce_value_and_grad(_plain_cross_entropy)
    assert v == v_ref and np.array_equal(g, g_ref)


def test_companion_the_softmax_minus_one_hot_in_one_expression_is_not_bit_for_bit():
    def one_expression(res, g):
        x, tgt, amax, sumexp = res
        hit = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == tgt[..., None]
        return g[..., None] * (jnp.exp(x - amax) / sumexp[..., None] - hit), None

    ce = jax.custom_vjp(lambda x, tgt: loss._cross_entropy_fwd(x, tgt)[0])
    ce.defvjp(loss._cross_entropy_fwd, one_expression)
    (_, g), (_, g_ref) = _ce_value_and_grad(ce), _ce_value_and_grad(_plain_cross_entropy)
    assert not np.array_equal(g, g_ref) and np.allclose(g, g_ref, rtol=0, atol=1e-6)


def _vocab_reductions_recomputed() -> list[str]:
    """The reductions over the vocabulary that the chunked loss's backward pass recomputes (inside its remat)."""
    V, W = 16, jax.random.normal(jax.random.key(0), (4, 16))
    model = types.SimpleNamespace(placement=Placement(platform="gpu"), logits=lambda h: h @ W)
    h_MBTD, tgt_MBT = jax.random.normal(jax.random.key(1), (2, 2, 8, 4)), jnp.zeros((2, 2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h: loss.per_position(model, h, tgt_MBT, 4)[0].sum()))(h_MBTD).jaxpr
    found = []

    def walk(jx, in_remat):
        for e in jx.eqns:
            if in_remat and e.primitive.name.startswith(("reduce_", "arg")) and e.invars[0].aval.shape[-1:] == (V,):
                found.append(e.primitive.name)
            for p in e.params.values():
                if isinstance(p, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    walk(p.jaxpr if isinstance(p, jex_core.ClosedJaxpr) else p,
                         in_remat or e.primitive.name.startswith(("remat", "checkpoint")))

    walk(jaxpr, False)
    return found


def test_the_chunked_loss_backward_reads_its_logits_once():
    """The backward pass recomputes a chunk's logits (never held whole) but keeps the softmax's row max and exp-sum
    from the forward: no reduction over the vocabulary is recomputed (small on h100:8: 66.7 -> 62.4 GB a step)."""
    assert _vocab_reductions_recomputed() == []


def test_companion_untagged_softmax_stats_are_recomputed(monkeypatch):
    monkeypatch.setattr(loss, "checkpoint_name", lambda x, name: x)
    assert sorted(_vocab_reductions_recomputed()) == ["reduce_max", "reduce_sum"]


def _logits_sized_outside_loops(platform: str) -> list[str]:
    """What the chunked loss's gradient computes whole outside its loops with the logits' shape (a loop invariant
    hoisted: held whole, read per chunk), and its scatter-adds (a logits-sized zero buffer written per chunk)."""
    V, W = 16, jax.random.normal(jax.random.key(0), (4, 16))
    model = types.SimpleNamespace(placement=Placement(platform=platform), logits=lambda h: h @ W)
    h_MBTD, tgt_MBT = jax.random.normal(jax.random.key(1), (2, 2, 8, 4)), jnp.zeros((2, 2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h: loss.per_position(model, h, tgt_MBT, 4)[0].sum()))(h_MBTD).jaxpr
    found = []

    def walk(jx, top):
        for e in jx.eqns:
            found.extend(["scatter-add"] if e.primitive.name == "scatter-add" else [])
            found.extend(f"{e.primitive.name} {v.aval}" for v in e.outvars if top and e.primitive.name != "scan"
                         and getattr(v.aval, "shape", ())[-1:] == (V,) and len(v.aval.shape) >= 3)
            for p in e.params.values():
                if isinstance(p, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    walk(p.jaxpr if isinstance(p, jex_core.ClosedJaxpr) else p, False)

    walk(jaxpr, True)
    return found


def test_the_chunked_loss_gradient_holds_nothing_logits_sized_outside_its_loop():
    assert _logits_sized_outside_loops("gpu") == []


def test_companion_differentiating_the_formula_scatter_adds_and_the_cpu_argmax_hoists_its_index(monkeypatch):
    assert any("int32" in f for f in _logits_sized_outside_loops("cpu"))  # first_argmax's index iota, on a CPU
    monkeypatch.setattr(loss, "cross_entropy", _plain_cross_entropy)
    assert "scatter-add" in _logits_sized_outside_loops("gpu")


def _dot_operand_dtypes(f, *args, width: int) -> set[str]:
    """The operand dtypes of every dot_general in f's jaxpr (nested ones too) with an operand `width` wide."""
    found = set()

    def walk(jx):
        for e in jx.eqns:
            if e.primitive.name == "dot_general" and any(width in v.aval.shape for v in e.invars):
                found.update(str(v.aval.dtype) for v in e.invars)
            for p in e.params.values():
                if isinstance(p, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    walk(p.jaxpr if isinstance(p, jex_core.ClosedJaxpr) else p)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def _head_grad_dot_dtypes(model_cfg) -> set[str]:
    """Operand dtypes of the head's products in a bf16 model's loss gradient (vocabulary 96, wider than the rest)."""
    model = build_model(model_cfg(vocab_size=96, dtype="bfloat16", mtp_depth=1), seed=0)
    toks, seg = (jnp.asarray(x) for x in packed_batch(96))
    gdef, st = nnx.split(model)

    def total(st):
        m = nnx.merge(gdef, st)
        return mtp_loss(m, m(toks, seg), toks, seg, step=0, cfg=LossConfig(chunk_size=4))[0]

    return _dot_operand_dtypes(jax.grad(total), st, width=96)


def test_a_bf16_models_head_gradients_multiply_bf16_operands(model_cfg):
    """The head's backward takes the float32 logits' cotangent in the compute dtype: every product with the
    vocabulary reads bf16 (on an H200 the float32 ones took 2.3x the forward's time: docs/accelerators.md)."""
    assert _head_grad_dot_dtypes(model_cfg) == {"bfloat16"}


def test_companion_autodiff_of_the_head_multiplies_in_float32(model_cfg, monkeypatch):
    monkeypatch.setattr(model_mod, "head_product", lambda h, w, vocab_first: jax.lax.dot_general(
        h, w, (((1,), (int(vocab_first),)), ((), ())), preferred_element_type=jnp.float32))
    assert "float32" in _head_grad_dot_dtypes(model_cfg)


@pytest.mark.parametrize("vocab_first", [False, True], ids=["head", "tied-embedding"])
def test_head_product_in_float32_is_autodiff_of_the_product_bit_for_bit(vocab_first):
    h, w, g = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(6, 8), (8, 16), (6, 16)]))
    w = w.T if vocab_first else w
    dims = (((1,), (int(vocab_first),)), ((), ()))
    plain = lambda h, w: jax.lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)
    out, vjp = jax.vjp(lambda h, w: model_mod.head_product(h, w, vocab_first), h, w)
    ref, vjp_ref = jax.vjp(plain, h, w)
    assert np.array_equal(out, ref)
    for a, b in zip(vjp(g), vjp_ref(g)):
        assert a.shape == b.shape and np.array_equal(a, b)
