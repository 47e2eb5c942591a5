"""The train step: one counter for λ and lr across a skipped step, the guard's memory, micro-batching, metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import synthetic_batches, tiny_cfg

from mtpjax.config import load_config, replace
from mtpjax.train.optim import lr_schedule, with_lr
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import TrainState, loss_and_grads, make_programs, split_trainable


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(cfg, programs) of the tiny config, compiled once for this file; λ, λ per depth (a forward curriculum) and lr
    change at every early step."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("step"), "optim.warmup_steps=4", "loss.mtp_lambda=linear:0.3->0.1@8",
                   "loss.mtp_lambda_depths=forward:1~2")
    return cfg, make_programs(cfg, make_mesh(cfg.mesh))


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


def test_skipped_step_advances_the_one_counter_of_lambda_and_lr(tiny):
    """Skip the update at counter 1: at counters 2, 3 λ and lr equal those of a run that never skipped."""
    cfg, progs = tiny
    batches = synthetic_batches(4, 8, 32)
    ref, state = [], progs.init()
    for tok, seg in batches:
        state, met = progs.train_step(state, tok, seg)
        ref.append(jax.device_get(met))
    got, opt_counts, state = [], [], progs.init()
    for i, (tok, seg) in enumerate(batches):
        kept = _leaves((state.params, state.opt))
        scale = state.params["final_norm"]["scale"]
        good = scale[...]
        if i == 1:  # an infinite parameter makes this step's loss non-finite
            scale[...] = jnp.full_like(good, jnp.inf)
        opt_counts.append(int(state.opt.count))
        state, met = progs.train_step(state, tok, seg)
        got.append(jax.device_get(met))
        if i == 1:  # the skipped step left parameters and moments untouched and advanced the counter
            state.params["final_norm"]["scale"][...] = good
            assert int(state.step) == 2
            for a, b in zip(_leaves((state.params, state.opt)), kept, strict=True):
                np.testing.assert_array_equal(a, b)
    assert [int(m["skipped"]) for m in got] == [0, 1, 0, 0] and int(state.step) == 4
    names = ("lr", "lambda", "lambda/mtp_1", "lambda/mtp_2")
    for c in (2, 3):
        assert all(got[c][n] == ref[c][n] for n in names), c
    # λ, λ per depth and lr really move with the counter here, so equal values mean equal counters
    assert [len({float(m[n]) for m in ref}) for n in names] == [4, 4, 3, 2]
    # Companion: the optimizer's own count (optax's; the old step read its twin, nnx.Optimizer.step) does
    # not advance on a skipped update, so a schedule read from it is one step behind from then on.
    lr = lr_schedule(cfg.optim, cfg.train.steps)
    assert opt_counts == [0, 1, 1, 2] and float(lr(opt_counts[2])) != float(got[2]["lr"])


def _guarded_by_select(state: TrainState, tok, seg, *, graphdef, tx, lr, loss_cfg):
    """The guard as it was: compute the new state, then jnp.where(ok, new, old) on every leaf."""
    train, frozen = split_trainable(state.params)
    grads, met = loss_and_grads(train, frozen, tok, seg, state.step, graphdef=graphdef, loss_cfg=loss_cfg,
                                micro_batches=1)
    ok = jnp.isfinite(met["loss/total"])
    updates, opt = tx.update(grads, with_lr(state.opt, lr(state.step)), train)
    new = state.replace(params=nnx.merge_state(optax.apply_updates(train, updates), frozen), opt=opt,
                        step=state.step + 1)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state), met


def _unguarded(state: TrainState, tok, seg, *, graphdef, tx, lr, loss_cfg):
    """No guard at all: the memory floor of a step."""
    train, frozen = split_trainable(state.params)
    grads, met = loss_and_grads(train, frozen, tok, seg, state.step, graphdef=graphdef, loss_cfg=loss_cfg,
                                micro_batches=1)
    updates, opt = tx.update(grads, with_lr(state.opt, lr(state.step)), train)
    return state.replace(params=nnx.merge_state(optax.apply_updates(train, updates), frozen), opt=opt,
                         step=state.step + 1), met


def test_non_finite_guard_costs_no_memory():
    """The guarded step's scratch memory equals an unguarded step's; selecting between old and new state did not."""
    cfg = load_config(None, ["model.vocab_size=256", "model.d_model=64", "model.n_layers=1", "model.n_heads=4",
                             "model.n_kv_heads=2", "model.d_ff=128", "model.mtp_depth=0", "data.seq_len=16",
                             "train.batch_size=2", "data.source=text", "data.paths=x"])
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    tok = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    bind = dict(graphdef=progs.graphdef, tx=progs.tx, lr=lr_schedule(cfg.optim, cfg.train.steps), loss_cfg=cfg.loss)

    def scratch(step_fn) -> int:
        m = step_fn.lower(progs.target, tok, tok).compile().memory_analysis()
        assert m.alias_size_in_bytes >= state_bytes - 8  # the donated state is updated in place (up to a scalar)
        return m.temp_size_in_bytes

    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(progs.target))
    floor = scratch(jax.jit(functools.partial(_unguarded, **bind), donate_argnums=0))
    slack = state_bytes // 100
    assert scratch(progs.train_step) <= floor + slack
    # Companion: the old select guard keeps part of the state twice (measured here: +19% of the state).
    assert scratch(jax.jit(functools.partial(_guarded_by_select, **bind), donate_argnums=0)) > floor + slack


def test_micro_batched_gradients_equal_full_batch(tiny):
    """Micro-batches normalized by the whole batch's counts sum to the full-batch loss and gradients."""
    tok, seg = synthetic_batches(1, 8, 32)[0]
    assert len({int((s > 0).sum()) for s in seg}) > 1  # rows hold different numbers of targets
    cfg, progs = tiny
    train, frozen = split_trainable(progs.init().params)

    def grads(m, tok, seg):
        f = functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss, micro_batches=m)
        return jax.jit(f)(train, frozen, tok, seg, jnp.int32(3))

    g_full, m_full = grads(1, tok, seg)
    g_micro, m_micro = grads(4, tok, seg)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_micro)):
        # float32 floor scaled to the tensor: elements that are sums of cancelling terms carry
        # absolute rounding error relative to the tensor's scale, not to their own small value
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * float(np.abs(a).max()))
    for k in m_full:
        np.testing.assert_allclose(float(m_micro[k]), float(m_full[k]), rtol=2e-6, err_msg=k)
    assert float(jnp.abs(jax.tree.leaves(g_full)[0]).sum()) > 0
    # Companion: averaging micro-batches each normalized by its own counts is visibly different.
    parts = [grads(1, tok[m::4], seg[m::4])[0] for m in range(4)]
    g_naive = jax.tree.map(lambda *g: sum(g) / 4, *parts)
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(a)).max())
                for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_naive)))
    assert worst > 1e-3


def test_train_step_updates_and_reports_metrics(tiny):
    cfg, progs = tiny
    state = progs.init()
    before = np.asarray(state.params["embed"][...]).copy()
    tok, seg = synthetic_batches(1, 8, 32)[0]
    state, met = progs.train_step(state, tok, seg)
    for k in ("loss/main", "loss/mtp_1", "loss/mtp_2", "accuracy/mtp_1", "agreement/mtp_2",
              "expected_accept_length", "lambda", "lr", "grad_norm"):
        assert np.isfinite(float(met[k])), k
    assert int(met["skipped"]) == 0 and float(met["lr"]) == pytest.approx(cfg.optim.lr / cfg.optim.warmup_steps)
    assert not np.array_equal(before, np.asarray(state.params["embed"][...])) and int(state.step) == 1


def test_non_finite_parameters_skip_the_update(tiny):
    progs, state = tiny[1], tiny[1].init()
    scale = state.params["final_norm"]["scale"]
    scale[...] = jnp.full_like(scale[...], jnp.inf)
    kept = _leaves((state.params, state.opt, state.rng))
    tok, seg = synthetic_batches(1, 8, 32)[0]
    new, met = progs.train_step(state, tok, seg)
    assert int(met["skipped"]) == 1 and int(new.step) == 1
    for a, b in zip(_leaves((new.params, new.opt, new.rng)), kept, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_optimizer_can_cover_a_parameter_subset(tiny):
    """train.freeze=trunk narrows optim.trainable to the MTP modules: only they move, only they have moments."""
    cfg = replace(tiny[0], ["train.init_from=unused", "train.freeze=trunk"])  # make_programs does not read init_from
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state = progs.init()
    before = {k: np.asarray(v).copy() for k, v in nnx.to_flat_state(state.params)}
    state, met = progs.train_step(state, *synthetic_batches(1, 8, 32)[0])
    after = dict(nnx.to_flat_state(state.params))
    moved = {k[0] for k, v in before.items() if not np.array_equal(v, np.asarray(after[k]))}
    assert moved == {"mtp"} and int(met["skipped"]) == 0
    moments = nnx.to_flat_state(state.opt.inner_state[1][0].mu)
    assert moments and all(k[0] == "mtp" for k, _ in moments)
