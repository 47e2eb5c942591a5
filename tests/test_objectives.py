"""Issue 24's objectives: the tv target, unrolled module applications, λ per depth (curricula), their bad values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_loss import packed_batch
from train_helpers import cli_args, one_line_error, tiny_cfg

from mtpjax.cli.train import main
from mtpjax.config import ConfigError, LossConfig, load_config
from mtpjax.nn.loss import forward, mtp_loss, token_counts, tv_distance
from mtpjax.nn.model import build_model, shift_left
from mtpjax.errors import SpellingError
from mtpjax.objective import DepthLambdas, LambdaSchedule, TargetMix
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.loop import train
from mtpjax.train.report import Logger
from mtpjax.train.step import make_programs


# ----------------------------------------------------------------------------- tv


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tv_reference(student, teacher):
    """1 − Σ min(p, q) and its gradient in the student logits, by hand in float64 (no ties between p and q)."""
    q, p = _np_softmax(student), _np_softmax(teacher)
    below = q < p  # where min picks q: only there does the value depend on the student
    value = 1 - np.minimum(p, q).sum(-1)
    # d q_x / d z_j = q_x (δ_xj − q_j): d Σ_{x below} q_x / d z_j = q_j [j below] − q_j Σ_{x below} q_x
    grad = -(q * below - q * (q * below).sum(-1, keepdims=True))
    return value, grad


def _check_tv(tv_fn):
    """tv_fn's value and gradients against the float64 hand computation; none into the teacher's logits."""
    rng = np.random.default_rng(18)
    student, teacher = rng.normal(0, 2, (2, 3, 7)), rng.normal(0, 2, (2, 3, 7))
    q, p = _np_softmax(student), _np_softmax(teacher)
    assert np.abs(q - p).min() > 1e-3  # no ties: min has one gradient
    want_value, want_grad = _tv_reference(student, teacher)
    s32, t32 = jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32)
    np.testing.assert_allclose(tv_fn(s32, t32), want_value, rtol=1e-5, atol=1e-6)
    g_student, g_teacher = jax.grad(lambda s, t: tv_fn(s, t).sum(), argnums=(0, 1))(s32, t32)
    np.testing.assert_allclose(g_student, want_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(g_teacher, 0)


def test_tv_value_and_gradient_match_a_float64_hand_computation():
    _check_tv(tv_distance)


def test_tv_check_fails_with_a_wrong_sign():
    """Companion: Σ min(p, q) − 1 (minimizing acceptance) is caught by the same check."""
    with pytest.raises(AssertionError):
        _check_tv(lambda s, t: -tv_distance(s, t))


def test_tv_check_fails_without_the_stop_gradient(monkeypatch):
    """Companion: without the stop-gradient the gradient reaches the main head's logits, and the check says so."""
    monkeypatch.setattr(jax.lax, "stop_gradient", lambda x: x)
    with pytest.raises(AssertionError):
        _check_tv(tv_distance)


def test_a_descent_step_on_tv_raises_the_acceptance():
    """Minimizing tv is maximizing Σ min(p, q): one gradient step on the draft logits raises it, a flipped one not."""
    rng = np.random.default_rng(1)
    s, t = (jnp.asarray(rng.normal(0, 2, (4, 9)), jnp.float32) for _ in range(2))
    accept = lambda s: float((1 - tv_distance(s, t)).mean())
    g = jax.grad(lambda s: tv_distance(s, t).sum())(s)
    assert accept(s - 0.5 * g) > accept(s) > accept(s + 0.5 * g)


@pytest.mark.parametrize("spec, weights, saved", [
    ("tv", (0, 0, 1), "tv"), ("mix:data=0.5,tv=0.5", (0.5, 0, 0.5), "mix:data=0.5,tv=0.5"),
    ("mix:self=0.25, tv=0.75", (0, 0.25, 0.75), "mix:self=0.25,tv=0.75"),
    ("mix:data=0.2,self=0.3,tv=0.5", (0.2, 0.3, 0.5), "mix:data=0.2,self=0.3,tv=0.5"),
    ("mix:self=0.5,data=0.5", (0.5, 0.5, 0), "mix:0.5"), ("mix:tv=1", (0, 0, 1), "tv")])
def test_three_way_mix_parses_and_saves(spec, weights, saved):
    target = load_config(None, [f"loss.mtp_target={spec}"]).loss.mtp_target
    assert target.weights == weights and str(target) == saved and TargetMix.parse(saved) == target


# ----------------------------------------------------------------------------- unroll


def _hand_unrolled(model, toks, seg, module: int, n: int):
    """The module calls written out: trunk, depths 1..module, then module on its own raw output n times (normed)."""
    h0, _ = model.trunk(toks, seg_BT=seg)
    h = h0
    for k in range(1, module + 1):
        h, _ = model.mtp_forward(k, model.mtp_input(h, h0), shift_left(toks, k), seg_BT=seg)
    out = []
    for u in range(1, n + 1):
        h, _ = model.mtp_forward(module, h, shift_left(toks, module + u), seg_BT=seg)
        out.append(model.mtp[module - 1].norm(h))
    return jnp.stack(out)


def _np_ce(logits, toks, seg, k):
    """Mean CE and argmax-vs-target accuracy of logits [B,T,V] as depth k (target x[i+k+1], same document)."""
    logits, T = np.asarray(logits, np.float64), toks.shape[1]
    ce = acc = n = 0.0
    for b in range(toks.shape[0]):
        for i in range(T):
            j = i + k + 1
            if j >= T or seg[b, j] == 0 or seg[b, i] != seg[b, j]:
                continue
            row = logits[b, i]
            ce += row.max() + np.log(np.exp(row - row.max()).sum()) - row[toks[b, j]]
            acc += row.argmax() == toks[b, j]
            n += 1
    return ce / max(n, 1), acc / max(n, 1), n


@pytest.mark.parametrize("which, kind", [("first", "sequential"), ("last", "sequential"), ("last", "parallel")])
def test_unroll_matches_a_hand_unrolled_loop_of_the_module(model_cfg, which, kind):
    model = build_model(model_cfg(mtp_depth=2, mtp_kind=kind, init_std=0.3), seed=0)
    toks, seg = packed_batch(model.cfg.vocab_size, seed=3)
    cfg = LossConfig("constant:0.3", mtp_unroll=2, mtp_unroll_module=which)
    out = forward(model, jnp.asarray(toks), jnp.asarray(seg), cfg)
    module = 1 if which == "first" else 2
    want = _hand_unrolled(model, jnp.asarray(toks), jnp.asarray(seg), module, 2)
    np.testing.assert_allclose(out.unrolled, want, rtol=1e-6, atol=1e-6)
    loss, met = mtp_loss(model, out, jnp.asarray(toks), jnp.asarray(seg), step=0, cfg=cfg)
    total = met["loss/main"] + 0.3 / 4 * sum(met[f"loss/{n}"] for n in ("mtp_1", "mtp_2", "unroll_1", "unroll_2"))
    np.testing.assert_allclose(loss, total, rtol=1e-6)
    for u in (1, 2):  # application u is scored as depth module+u: its target and valid positions
        ce, acc, n = _np_ce(model.logits(want[u - 1]), toks, seg, module + u)
        assert n > 0
        np.testing.assert_allclose(float(met[f"loss/unroll_{u}"]), ce, rtol=2e-6)
        np.testing.assert_allclose(float(met[f"accuracy/unroll_{u}"]), acc, rtol=2e-6)
    # Companion: feeding the trunk's state (or the previous depth's) instead of the module's own output differs.
    h0, _ = model.trunk(jnp.asarray(toks), seg_BT=jnp.asarray(seg))
    from_trunk = model.mtp[module - 1].norm(
        model.mtp_forward(module, h0, shift_left(jnp.asarray(toks), module + 1), seg_BT=jnp.asarray(seg))[0])
    assert np.abs(np.asarray(from_trunk) - np.asarray(want[0])).max() > 1e-3


def test_micro_batch_counts_cover_the_unrolled_applications(model_cfg):
    """Parts of a batch normalized by the whole batch's counts (unrolled applications included) sum to its loss."""
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3))
    toks, seg = map(jnp.asarray, packed_batch(32, seed=4))
    cfg = LossConfig(mtp_unroll=2, mtp_unroll_module="last", mtp_lambda_depths="forward:1")
    loss = nnx.jit(lambda m, t, s, c: mtp_loss(m, forward(m, t, s, cfg), t, s, step=3, cfg=cfg, counts=c)[0])
    full, counts = loss(model, toks, seg, None), token_counts(toks, seg, 2, cfg)
    assert counts.shape == (5,) and float(counts[-1]) < float(counts[-2])  # depth 4 has fewer targets than 3
    parts = lambda c: float(sum(loss(model, toks[s], seg[s], c) for s in (slice(0, 1), slice(1, 3))))
    np.testing.assert_allclose(parts(counts), float(full), rtol=1e-6)
    # Companion: counts of the depths alone (the unrolled ones' read past the end) do not sum to it.
    short = jnp.concatenate([token_counts(toks, seg, 2), jnp.ones(2)])
    assert abs(parts(short) - float(full)) > 1e-3 * float(full)


def test_unroll_output_must_match_the_config(model_cfg):
    """A forward without the unrolled applications the config scores is refused, not scored as fewer."""
    model = build_model(model_cfg(mtp_depth=1), seed=0)
    toks = jnp.asarray(packed_batch(32)[0])
    with pytest.raises(ValueError, match="nn.loss.forward"):
        mtp_loss(model, model(toks), toks, step=0, cfg=LossConfig(mtp_unroll=1))


def test_unrolled_tv_sends_no_gradient_into_the_main_head(model_cfg):
    """The unrolled applications with a tv target train the module only through the module: the trunk's final norm
    (the main head's alone) gets L_0's gradient whatever the MTP side does."""
    model = build_model(model_cfg(mtp_depth=1, init_std=0.3), seed=4)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=7))

    def final_norm_grad(cfg):
        f = lambda m: mtp_loss(m, forward(m, toks, seg, cfg), toks, seg, step=0, cfg=cfg)[0]
        return np.asarray(nnx.jit(nnx.grad(f))(model)["final_norm"]["scale"][...])  # one program, not one per op

    np.testing.assert_array_equal(final_norm_grad(LossConfig(mtp_target="tv", mtp_unroll=2)),
                                  final_norm_grad(LossConfig()))


# ----------------------------------------------------------------------------- λ per depth


def lambdas_at(lc: LossConfig, step: int, apps: int):
    """float32[apps]: λ of each scored application at `step` under the loss section `lc`."""
    return lc.mtp_lambda_depths.at(jnp.int32(step), lc.mtp_lambda, apps)


@pytest.mark.parametrize("spec, apps, points", [
    ("", 2, {0: [0.3, 0.3], 999: [0.3, 0.3]}),
    ("forward:10", 3, {0: [0, 0, 0], 9: [0, 0, 0], 10: [0.3, 0, 0], 19: [0.3, 0, 0], 20: [0.3, 0.3, 0],
                       30: [0.3, 0.3, 0.3]}),
    ("forward:10~4", 2, {10: [0, 0], 12: [0.15, 0], 14: [0.3, 0], 21: [0.3, 0.075], 40: [0.3, 0.3]}),
    ("reverse:10", 2, {0: [0.3, 0.3], 9: [0.3, 0.3], 10: [0.3, 0], 19: [0.3, 0], 20: [0, 0]}),
    ("reverse:10~4", 2, {6: [0.3, 0.3], 8: [0.3, 0.15], 10: [0.3, 0], 17: [0.225, 0], 20: [0, 0]}),
    ("1;piecewise:0@5,0.5", 2, {0: [1, 0], 5: [1, 0.5]}),
])
def test_lambda_per_depth_at_chosen_steps(spec, apps, points):
    cfg = LossConfig("0.3", mtp_lambda_depths=spec)
    for step, want in points.items():
        np.testing.assert_allclose(lambdas_at(cfg, step, apps), want, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{spec} @ {step}")


def test_forward_curriculum_scales_the_base_schedule():
    cfg = LossConfig("piecewise:0.3@15,0.1", mtp_lambda_depths="forward:10")
    np.testing.assert_allclose(lambdas_at(cfg, 12, 1), [0.3], rtol=1e-6)
    np.testing.assert_allclose(lambdas_at(cfg, 15, 1), [0.1], rtol=1e-6)


def test_a_zero_lambda_depth_adds_nothing_to_the_loss_but_is_still_logged(model_cfg):
    model = build_model(model_cfg(mtp_depth=2, init_std=0.3), seed=1)
    toks, seg = map(jnp.asarray, packed_batch(32, seed=2))
    out = model(toks, seg)
    loss, met = mtp_loss(model, out, toks, seg, step=10, cfg=LossConfig("0.3", mtp_lambda_depths="forward:10"))
    assert float(met["lambda/mtp_1"]) == pytest.approx(0.3) and float(met["lambda/mtp_2"]) == 0
    np.testing.assert_allclose(loss, met["loss/main"] + 0.3 / 2 * met["loss/mtp_1"], rtol=1e-6)
    assert float(met["loss/mtp_2"]) > 0  # computed (and logged) though it weighs nothing


@pytest.mark.parametrize("spec, saved, kind", [
    ("forward:1000", "forward:1000", "forward"), ("reverse: 5 ~ 2", "reverse:5~2", "reverse"), ("", "", "same"),
    ("0.3; linear:0->1@10", "constant:0.3;linear:0.0->1.0@10", "each")])
def test_depth_lambdas_parse_and_save(spec, saved, kind):
    lam = DepthLambdas.parse(spec)
    assert lam.kind == kind and str(lam) == saved and DepthLambdas.parse(saved) == lam


@pytest.mark.parametrize("kind, text, shown", [
    (LambdaSchedule, "linear:0.3->0.1", "linear:0.3->0.1"), (TargetMix, "kl", "kl"),
    (DepthLambdas, "forward:0", "forward:0"), (DepthLambdas, "forward:ten", "forward:ten"),
    (DepthLambdas, "0.3;sideways", "sideways")])
def test_a_spelling_refused_alone_says_what_is_allowed_and_the_config_adds_its_key(kind, text, shown):
    """Outside a config a bad spelling is a SpellingError (the part that is wrong, what is allowed); the config's
    message is the same with the key in front."""
    with pytest.raises(SpellingError) as e:
        kind.parse(text)
    assert e.value.value == shown and str(e.value).startswith("expected")
    key = {LambdaSchedule: "mtp_lambda", TargetMix: "mtp_target", DepthLambdas: "mtp_lambda_depths"}[kind]
    with pytest.raises(ConfigError) as c:
        LossConfig(**{key: text})
    assert str(c.value) == f"config key 'loss.{key}' = {shown!r} is invalid: {e.value}"


@pytest.mark.parametrize("over, needle", [
    (["loss.mtp_unroll=-1"], "config key 'loss.mtp_unroll' = -1 is invalid: must be >= 0"),
    (["loss.mtp_unroll=1", "model.mtp_depth=0"], "config key 'loss.mtp_unroll' = 1 is invalid: needs an MTP module"),
    (["loss.mtp_unroll=30"], "config key 'loss.mtp_unroll' = 30 is invalid: its deepest application"),
    (["loss.mtp_unroll_module=middle"], "config key 'loss.mtp_unroll_module' = 'middle' is invalid"),
    (["loss.mtp_target=kl"], "config key 'loss.mtp_target' = 'kl' is invalid"),
    (["loss.mtp_target=mix:data=0.5,tv=0.6"], "config key 'loss.mtp_target'"),
    (["loss.mtp_target=mix:tv=0.5,tv=0.5"], "config key 'loss.mtp_target'"),
    (["loss.mtp_lambda_depths=forward:4"], "switches at step 8, not before train.steps=8"),
    (["loss.mtp_lambda_depths=reverse:3", "loss.mtp_unroll=1"], "switches at step 9, not before train.steps=8"),
    (["loss.mtp_lambda_depths=0.3;piecewise:0@8,1"], "switches at step 8, not before train.steps=8"),
    (["loss.mtp_lambda_depths=0.3"], "has 1 schedules; give one per scored application: 2"),
    (["loss.mtp_lambda_depths=forward:0"], "the step <n> must be > 0"),
    (["loss.mtp_lambda_depths=sideways:3"], "config key 'loss.mtp_lambda_depths'"),
])
def test_bad_objective_values_are_one_line_exit_2(tmp_path, capsys, over, needle):
    cfg = tiny_cfg(tmp_path)  # train.steps=8, model.mtp_depth=2, data.seq_len=32
    with pytest.raises(ConfigError):
        load_config(None, ["train.steps=8", "model.mtp_depth=2", "data.seq_len=32", *over])
    err = one_line_error(capsys, main, cli_args(cfg, *over))
    assert needle in err, err
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow  # default tier under 10 minutes; CI runs it
def test_lambda_per_depth_continues_across_a_resume(tmp_path, monkeypatch):
    """Stopped at 4 and resumed, the run logs the same λ per depth at every step as a straight run: one counter."""
    seen = {}
    real = Logger.record

    def record(self, step, met, *when):
        seen.setdefault(self.cfg.train.run_dir, []).append((step, met["lambda/mtp_1"], met["lambda/mtp_2"]))
        real(self, step, met, *when)

    monkeypatch.setattr(Logger, "record", record)
    over = ["loss.mtp_lambda_depths=forward:2~3", "train.eval_every=8", "train.num_samples=0"]
    cfg_a, cfg_b = tiny_cfg(tmp_path, *over, run="a"), tiny_cfg(tmp_path, *over, run="b")
    train(cfg_a)
    assert train(cfg_b, max_steps=4)["step"] == 4
    train(cfg_b)
    straight, resumed = seen[cfg_a.train.run_dir], seen[cfg_b.train.run_dir]
    assert [s for s, *_ in resumed] == list(range(1, 9)) and resumed == straight
    for step, *lams in straight:  # the step that logged `step` ran at counter step - 1
        np.testing.assert_allclose(lams, lambdas_at(cfg_a.loss, step - 1, 2), rtol=1e-6)
    assert len({lam for _, lam, _ in straight}) == 4  # 0, then ramping in, then λ: the check is not vacuous


@pytest.mark.slow  # default tier under 10 minutes; CI runs it
def test_a_depth_whose_lambda_is_0_is_still_computed(tmp_path):
    """The compiled train step costs the same with a forward curriculum (depth 2 at λ 0 for most steps) as with
    constant λ: the equal-FLOPs accounting charges every depth at every step. Companion: one depth fewer is cheaper."""
    def step_flops(*over):
        cfg = tiny_cfg(tmp_path, *over)
        progs = make_programs(cfg, make_mesh(cfg.mesh))
        tok = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.data.seq_len), jnp.int32)
        return progs.train_step.lower(progs.target, tok, tok).compile().cost_analysis()["flops"]

    constant, curriculum = step_flops(), step_flops("loss.mtp_lambda_depths=forward:3")
    assert abs(curriculum - constant) < 1e-3 * constant
    assert step_flops("model.mtp_depth=1") < 0.95 * constant


@pytest.mark.slow  # default tier under 10 minutes; CI runs it
def test_lambda_per_depth_after_a_skipped_step(tmp_path, monkeypatch):
    """A skipped (non-finite) update still advances the one counter: the steps after it log the λ of their own
    counter, as a run without the skip does. Companion: the skip happened (step 4 not logged, 1 skipped)."""
    import mtpjax.train.step as step_mod

    seen = {}
    real_record, real_loss = Logger.record, step_mod.mtp_loss

    def record(self, step, met, *when):
        seen.setdefault(self.cfg.train.run_dir, []).append((step, met["lambda/mtp_1"], met["lambda/mtp_2"]))
        real_record(self, step, met, *when)

    def poisoned(*args, step, **kw):  # NaN loss and gradients at counter 3 (the update that would make step 4)
        loss, met = real_loss(*args, step=step, **kw)
        return loss * jnp.where(step == 3, jnp.nan, 1.0), met

    monkeypatch.setattr(Logger, "record", record)
    monkeypatch.setattr(step_mod, "mtp_loss", poisoned)
    cfg = tiny_cfg(tmp_path, "loss.mtp_lambda_depths=forward:2~3", "train.eval_every=8", "train.num_samples=0",
                   "train.nan_policy=skip")
    out = train(cfg)
    logged = seen[cfg.train.run_dir]
    assert out["skipped_steps"] == 1 and [s for s, *_ in logged] == [1, 2, 3, 5, 6, 7, 8]
    for step, *lams in logged:  # the step that logged `step` ran at counter step - 1, the skip included
        np.testing.assert_allclose(lams, lambdas_at(cfg.loss, step - 1, 2), rtol=1e-6)
    assert len({lam for _, _, lam in logged}) >= 3  # depth 2 at 0, ramping, then λ: the check is not vacuous
