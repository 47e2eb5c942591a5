"""Model: no future leakage per depth and kind, shared embedding/head, scan == unrolled, remat == none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtpjax.config import LossConfig
from mtpjax.nn.loss import mtp_loss
from mtpjax.nn.model import build_model, param_counts

T = 12


@nnx.jit
def _logits(model, tokens, seg):
    return model.logits(model(tokens, seg).hidden)


def all_logits(model, tokens, seg=None):
    """float32[D+1, B, T, V] logits of every depth."""
    return np.asarray(_logits(model, jnp.asarray(tokens), None if seg is None else jnp.asarray(seg)))


def perturbed_batch(V, seed=0):
    """Row 0: base sequence; row 1+j: the base with token j replaced by a different token."""
    base = np.random.default_rng(seed).integers(0, V, T)
    rows = [base.copy()]
    for j in range(T):
        r = base.copy()
        r[j] = (r[j] + 1 + j) % V
        rows.append(r)
    return np.stack(rows).astype(np.int32)


@nnx.jit
def _depth1_three_ways(model, toks):
    h0, _ = model.trunk(toks)
    nxt = jnp.concatenate([toks[:, 1:], 0 * toks[:, :1]], 1)
    fed = [model.mtp[0].norm(model.mtp_forward(1, h, nxt)[0]) for h in (model.trunk_state(h0), h0)]
    return model(toks).hidden[1], *fed


def test_mtp_hidden_normed_feeds_module_1_the_final_normed_state(model_cfg):
    """model.mtp_hidden=normed: the training forward's depth 1 is module 1 on the trunk's final-normed state
    (trunk_state, what the MTP proposer stores); the companion: fed the raw state, module 1 computes otherwise."""
    model = build_model(model_cfg(mtp_depth=1, n_layers=1, init_std=0.2, mtp_hidden="normed"), seed=3)
    # a final norm of scale 1 is undone by the module's hnorm: only a trained (here random) scale tells them apart
    model.final_norm.scale[...] = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, model.cfg.d_model))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, T)), jnp.int32)
    fwd, normed, raw = _depth1_three_ways(model, toks)
    np.testing.assert_allclose(fwd, normed, atol=1e-6)
    assert np.abs(fwd - raw).max() > 1e-3


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
def test_no_leakage_any_depth(model_cfg, kind):
    D = 3
    model = build_model(model_cfg(mtp_depth=D, mtp_kind=kind, init_std=0.2), seed=1)
    toks = perturbed_batch(model.cfg.vocab_size)
    lg = all_logits(model, toks)
    assert lg.shape == (D + 1, T + 1, T, model.cfg.vocab_size)
    scale = np.abs(lg).max()
    checked_changed = 0
    for k in range(D + 1):
        for i in range(T):
            for j in range(i + 1, T):
                diff = np.abs(lg[k, 1 + j, i] - lg[k, 0, i]).max()
                if j > i + k:
                    assert diff <= 1e-6 * scale, (k, i, j, diff)  # x[j] is in the future of depth k at i
                elif j == i + k and k >= 1:
                    if kind == "sequential":  # conditions on x[i+k]: must react to it
                        assert diff > 1e-3 * scale, (k, i, j, diff)
                        checked_changed += 1
                    else:
                        assert diff <= 1e-6 * scale, (k, i, j, diff)
            # and every depth depends on the current token
            assert np.abs(lg[k, 1 + i, i] - lg[k, 0, i]).max() > 1e-3 * scale
    assert checked_changed == (sum(T - k for k in range(1, D + 1)) if kind == "sequential" else 0)


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
def test_packed_documents_do_not_see_each_other(model_cfg, kind):
    model = build_model(model_cfg(mtp_kind=kind, init_std=0.2), seed=2)
    V = model.cfg.vocab_size
    a = np.random.default_rng(0).integers(0, V, T).astype(np.int32)
    b = a.copy()
    b[:5] = (b[:5] + 7) % V  # rewrite document 1 only
    seg = np.array([1] * 5 + [2] * 7, np.int32)
    la = all_logits(model, np.stack([a, b]), np.stack([seg, seg]))[:, 0]
    lb = all_logits(model, np.stack([b, a]), np.stack([seg, seg]))[:, 0]
    np.testing.assert_allclose(la[:, 5:], lb[:, 5:], rtol=0, atol=1e-6 * np.abs(la).max())
    assert np.abs(la[0, :5] - lb[0, :5]).max() > 1e-3


def expected_mtp_params(m):
    d, h, kv, hd, f = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.resolved_d_ff
    block = 2 * d + d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    per = 2 * d + 2 * d * d + block + d if m.mtp_kind == "sequential" else block + d
    return per


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
@pytest.mark.parametrize("tied", [True, False])
def test_mtp_adds_exactly_its_modules(model_cfg, kind, tied):
    D = 3
    cfg = model_cfg(mtp_depth=D, mtp_kind=kind, tie_embeddings=tied, d_ff=0, head_dim=16, vocab_size=96)
    model = nnx.eval_shape(lambda: build_model(cfg))
    base = nnx.eval_shape(lambda: build_model(model_cfg(mtp_depth=0, mtp_kind=kind, tie_embeddings=tied, d_ff=0,
                                                        head_dim=16, vocab_size=96)))

    def total(m):
        return sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))

    per = expected_mtp_params(cfg)
    assert total(model) - total(base) == D * per
    counts = param_counts(model)
    assert counts["mtp"] == [per] * D and counts["total"] == total(model)
    V, d = cfg.vocab_size, cfg.d_model
    assert counts["shared_embed_head"] == V * d * (1 if tied else 2)
    # No vocabulary-sized tensor anywhere inside the MTP modules: no second embedding or head.
    for path, var in nnx.to_flat_state(nnx.state(model.mtp, nnx.Param)):
        assert "vocab" not in var.get_metadata()["logical_axes"], path
        assert V not in var.shape, path
    vocab_params = [p for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                    if "vocab" in v.get_metadata()["logical_axes"]]
    assert sorted(vocab_params) == sorted([("embed",)] + ([] if tied else [("head",)]))


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
@pytest.mark.parametrize("tied", [True, False])
def test_mtp_loss_alone_trains_shared_embedding_and_head(model_cfg, kind, tied):
    cfg = model_cfg(mtp_depth=2, mtp_kind=kind, tie_embeddings=tied, vocab_size=64)
    model = build_model(cfg, seed=3)
    # Token 63 sits only at position T-2: its only path into loss/mtp_1 (whose last valid position is
    # T-3) is the sequential module's embedding of x[i+1]; the trunk at T-2 feeds no valid depth-1 target.
    toks = np.random.default_rng(0).integers(0, 60, (2, T)).astype(np.int32)
    toks[:, T - 2] = 63
    toks = jnp.asarray(toks)

    def f(m):
        return mtp_loss(m, m(toks), toks, step=0, cfg=LossConfig())[1]["loss/mtp_1"]

    grads = nnx.jit(nnx.grad(f))(model)
    g_embed = np.asarray(grads["embed"][...])
    assert np.abs(g_embed).sum() > 0
    if not tied:
        assert np.abs(np.asarray(grads["head"][...])).sum() > 0
        row = np.abs(g_embed[63]).sum()
        assert (row > 0) if kind == "sequential" else (row == 0), row
    # main-only parameters: the trunk's final norm feeds only depth 0, so it gets no gradient
    assert np.abs(np.asarray(grads["final_norm"]["scale"][...])).sum() == 0
    # an SGD step on that loss moves the shared tensors
    before = {n: np.asarray(getattr(model, n)[...]).copy() for n in (["embed"] if tied else ["embed", "head"])}
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
    for n, b in before.items():
        assert not np.allclose(np.asarray(getattr(model, n)[...]), b), n


def scanned_copy(list_model, cfg):
    """A scan_layers=True model holding exactly list_model's parameters (blocks stacked)."""
    scan_model = build_model(cfg.__class__(**{**cfg.__dict__, "scan_layers": True}), seed=99)
    pure = nnx.to_pure_dict(nnx.state(list_model, nnx.Param))
    blocks = pure.pop("blocks")
    pure["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(cfg.n_layers)])
    st = nnx.state(scan_model, nnx.Param)
    nnx.replace_by_pure_dict(st, pure)
    nnx.update(scan_model, st)
    return scan_model


@nnx.jit
def _loss_and_grads(model, toks, seg):
    def f(m):
        return mtp_loss(m, m(toks, seg), toks, seg, step=0)[0]
    return nnx.value_and_grad(f)(model)


def loss_and_grads(model, toks, seg):
    loss, g = _loss_and_grads(model, toks, seg)
    return loss, nnx.to_pure_dict(g)


def batch(V, B=2):
    toks = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, T)), jnp.int32)
    seg = jnp.asarray(np.array([[1] * 7 + [2] * 5, [1] * 10 + [0] * 2][:B]), jnp.int32)
    return toks, seg


def test_scan_layers_matches_list(model_cfg):
    cfg = model_cfg(n_layers=3, mtp_depth=1)  # scan only touches the trunk, so one MTP kind suffices
    lm = build_model(cfg, seed=4)
    sm = scanned_copy(lm, cfg)
    toks, seg = batch(cfg.vocab_size)
    np.testing.assert_allclose(all_logits(sm, toks, seg), all_logits(lm, toks, seg), rtol=1e-5, atol=1e-6)
    (l1, g1), (l2, g2) = loss_and_grads(lm, toks, seg), loss_and_grads(sm, toks, seg)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    g1["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[g1["blocks"][i] for i in range(3)])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g2, g1)


@pytest.mark.parametrize("remat, scan", [("full", False), ("dots", False), ("full", True)])
def test_remat_changes_nothing(model_cfg, remat, scan):
    toks, seg = batch(32)
    ref = build_model(model_cfg(scan_layers=scan, mtp_depth=1), seed=6)
    rem = build_model(model_cfg(scan_layers=scan, mtp_depth=1, remat=remat), seed=6)
    np.testing.assert_array_equal(all_logits(rem, toks, seg), all_logits(ref, toks, seg))
    (l1, g1), (l2, g2) = loss_and_grads(ref, toks, seg), loss_and_grads(rem, toks, seg)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g2, g1)


def test_companion_a_remat_that_drops_the_segment_ids_is_told_apart(model_cfg, monkeypatch):
    """The equality above can fail: rematerialized blocks that lose their segment ids change logits and grads."""
    import mtpjax.nn.model as model_module

    real = model_module._run_block
    monkeypatch.setattr(model_module, "_run_block", lambda gdef, st, x, pos, seg, kv, remat, layer=None: real(
        gdef, st, x, pos, seg if remat == "none" else None, kv, remat, layer))
    toks, seg = batch(32)
    ref = build_model(model_cfg(n_layers=3, mtp_depth=1), seed=6)  # 3 layers: not the programs traced above
    rem = build_model(model_cfg(n_layers=3, mtp_depth=1, remat="full"), seed=6)
    assert not np.array_equal(all_logits(rem, toks, seg), all_logits(ref, toks, seg))
    (_, g1), (_, g2) = loss_and_grads(ref, toks, seg), loss_and_grads(rem, toks, seg)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-7), g2, g1)))


def _grad_program(model, toks, seg) -> str:
    """The program jit compiles for the model's loss and gradients, as lowered (StableHLO) text."""
    gdef, state = nnx.split(model)

    def loss_and_grad(state, toks, seg):
        def loss(state):
            m = nnx.merge(gdef, state)
            return mtp_loss(m, m(toks, seg), toks, seg, step=0)[0]
        return jax.value_and_grad(loss)(state)

    return jax.jit(loss_and_grad).lower(state, toks, seg).as_text()


@pytest.mark.parametrize("remat, scan", [("full", False), ("dots", False), ("full", True), ("dots", True)])
def test_remat_rematerializes_in_the_compiled_program(model_cfg, remat, scan):
    """Values cannot show remat: the program can. Each rematerialized block's recompute is fenced off by
    optimization barriers; "full" recomputes the forward matmuls in the backward pass, "dots" saves them."""
    toks, seg = batch(32)
    text = {r: _grad_program(build_model(model_cfg(scan_layers=scan, mtp_depth=1, remat=r), seed=6), toks, seg)
            for r in ("none", remat)}
    count = lambda r, op: text[r].count(op)
    assert count(remat, "optimization_barrier") > count("none", "optimization_barrier")
    if remat == "full":
        assert count(remat, "dot_general") > count("none", "dot_general")
    else:
        assert count(remat, "dot_general") == count("none", "dot_general")


def test_plain_lm_and_output_shapes(model_cfg):
    for D in (0, 2):
        model = build_model(model_cfg(mtp_depth=D))
        out = model(jnp.zeros((3, T), jnp.int32))
        assert out.hidden.shape == (D + 1, 3, T, 32) and out.hidden.dtype == jnp.float32
        assert model.logits(out.hidden).shape == (D + 1, 3, T, 32)
