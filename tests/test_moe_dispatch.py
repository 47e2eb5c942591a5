"""The expert-parallel dispatch sized for the tokens (issue 47): buffers of model.moe_buffer_factor × the balanced
share, the slots past them dropped lightest first and counted, the count reported by the train step. One subprocess
on 2 CPU devices (moe_dispatch_worker.py) computes everything; each test reads its part."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.nn.moe import capacity, inverse, move


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dispatch") / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "moe_dispatch_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_capacity_is_the_factor_times_the_balanced_share_at_most_the_worst_case():
    assert capacity(32, 3, 4, 2, 1.0) == 48 and capacity(32, 3, 4, 2, 1.25) == 60  # 32·3/2 = 48 per pair
    assert capacity(32, 3, 4, 2, 0.0) == capacity(32, 3, 4, 2, 5.0) == 96  # 32 rows on min(3, 4) experts
    assert capacity(5, 1, 4, 8, 0.01) == 1


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_a_buffer_that_drops_nothing_equals_the_dropless_layer(worker):
    """The layer on a 2-device expert mesh with buffers smaller than the worst case but large enough for this routing:
    the dropless layer's loss and gradients (parameters and input), and one device's."""
    r = worker["layer"]
    assert r["capacity"] < r["worst"]  # a smaller program, not the worst case again
    sized, dropless = r["sized"], r["dropless"]
    assert sized["dropped"] == dropless["dropped"] == 0
    assert sized["loss"] == pytest.approx(dropless["loss"], rel=1e-6)
    assert sized["grad_err_vs_dropless"] < 1e-6 and sized["grad_err_vs_one_device"] < 1e-5
    assert dropless["loss"] == pytest.approx(r["ref_loss"], rel=1e-5) and dropless["grad_err_vs_one_device"] < 1e-5


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_a_wrong_dispatch_fails_the_equality(worker):
    """The companion: slots sent one shard too far meet the wrong experts."""
    assert worker["layer"]["wrong-dispatch"]["grad_err_vs_dropless"] > 0.1


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
@pytest.mark.parametrize("factor, cap, slots, real", [("1.0", 6, 6, 4), ("0.5", 3, 15, 13)])
def test_overflow_of_a_hand_built_routing_is_dropped_lightest_first_and_counted(worker, factor, cap, slots, real):
    """Shard 0's 6 tokens send all 12 slots to shard 0 (buffer: cap rows), shard 1's send 6 and 6; token 5 (padding)
    weighs least. Known overflow: 12 − 6 = 6 slots at factor 1, (12 − 3) + 3 + 3 = 15 at factor 0.5; the count
    leaves token 5's two out. The output is the dropless one with exactly those slots' weights zeroed."""
    r = worker["overflow"][factor]
    assert (r["cap"], r["slots_dropped"], r["want_dropped"]) == (cap, slots, real)
    assert r["dropped"] == real
    assert r["err"] < 1e-6


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_overflow_companions_fail(worker):
    """A dispatch that ignores the factor drops and counts nothing; one that fills its buffers lightest first drops
    other slots: both fail the checks above."""
    for factor in ("1.0", "0.5"):
        r = worker["overflow"][factor]
        assert r["ignored"]["dropped"] != r["want_dropped"] and r["ignored"]["err"] > 0.1
        assert r["heaviest_dropped"]["err"] > 0.1


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_the_train_step_reports_the_dropped_fraction_per_block(worker):
    """Every token's 2 slots forced onto shard 0's experts: each shard sends 2N slots into a buffer of N (factor 1),
    so the step reports exactly half dropped for each MoE block and overall; the dropless program (factor 0) none."""
    sized, dropless = worker["step"]["1.0"], worker["step"]["0.0"]
    names = {"moe/blocks.1/dropped_fraction", "moe/mtp.0/dropped_fraction", "moe/dropped_fraction"}
    assert set(sized) == set(dropless) == names
    assert all(v == 0.5 for v in sized.values()) and all(v == 0.0 for v in dropless.values())


def test_decoding_runs_the_moe_dropless():
    """for_decoding's copy (what the decode loop runs) has every MoE layer dropless; the model keeps its factor."""
    from flax import nnx

    from mtpjax.config import load_config
    from mtpjax.nn.model import build_model, for_decoding, moe_layers

    cfg = load_config(None, ["model.mlp_kind=moe", "model.n_layers=2", "model.first_k_dense_replace=1",
                             "model.moe_buffer_factor=1.25"])
    model = nnx.eval_shape(lambda: build_model(cfg))
    view = for_decoding(model)
    assert [m.buffer_factor for m in moe_layers(view).values()] == [0.0, 0.0]  # trunk block 1 and the MTP module's
    assert [m.buffer_factor for m in moe_layers(model).values()] == [1.25, 1.25]


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_greedy_speculative_on_the_expert_mesh_equals_plain_although_training_drops(worker):
    """A model whose buffer factor (0.1) drops most token-slots in training decodes dropless: speculative greedy on
    the 2-device expert mesh equals plain greedy on one device; the companion, the loop on the model as built (its
    buffers sized by the factor), differs."""
    d = worker["decode"]
    assert d["mesh_speculative"] == d["one_plain"]
    assert d["mesh_as_built"] != d["one_plain"]


@pytest.mark.slow  # the worker compiles a layer, a routing and two train steps on 2 devices
def test_the_dispatch_moves_rows_by_gathers_both_ways(worker):
    """The expert-parallel dispatch's loss and gradients compile with no scatter of float rows (XLA:GPU writes a
    bf16 scatter as u32 copies and a non-unique one's JVP with masks over the whole buffer); the companion: the same
    dispatch with plain gathers, whose gradients autodiff writes as scatter-adds."""
    assert worker["scatters"]["move"] == 0 and worker["scatters"]["plain_gather"] > 0, worker["scatters"]


def _cells():
    """6 tokens of width 3 sent to 10 cells, k = 2 slots each, one slot dropped and two cells empty: (x, each cell's
    token (6: empty), each token's 2 cells (10: dropped))."""
    x = np.random.default_rng(7).normal(size=(6, 3)).astype(np.float32)
    to = np.array([3, 0, 6, 5, 1, 4, 6, 2, 0, 5], np.int32)
    back = np.full((6, 2), 10, np.int32)
    for cell, tok in enumerate(to):
        if tok < 6:
            back[tok, list(back[tok]).index(10)] = cell
    back[1, 0] = 10  # a slot past its buffer: its cell reads nothing (cell 4 made empty below)
    to[4] = 6
    return x, to, back


@pytest.mark.parametrize("fill", [True, False])
def test_move_and_its_gradient_equal_a_gather(fill):
    """The dispatch's row mover: forward the gather x[to] (zeros for an empty cell), gradient what autodiff gives the
    plain gather (its scatter-add), but computed by gathering each row's readers."""
    if fill:
        x, to, back = _cells()
    else:
        x = np.random.default_rng(8).normal(size=(7, 3)).astype(np.float32)
        to = np.random.default_rng(9).permutation(7).astype(np.int32)
        back = np.asarray(inverse(jnp.asarray(to)))[:, None]
    dy = np.random.default_rng(10).normal(size=(len(to), 3)).astype(np.float32)
    plain = lambda x: x.at[to].get(mode="fill", fill_value=0)
    y, vjp = jax.vjp(lambda x: move(x, jnp.asarray(to), jnp.asarray(back), fill), jnp.asarray(x))
    y_ref, vjp_ref = jax.vjp(plain, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(dy))[0]), np.asarray(vjp_ref(jnp.asarray(dy))[0]),
                               rtol=1e-6, atol=1e-7)


def test_companion_a_move_that_forgets_a_reader_has_the_wrong_gradient():
    """The equality above can fail: a row's list of readers missing one loses that reader's gradient."""
    x, to, back = _cells()
    back[0, 0] = 10
    dy = jnp.ones((len(to), 3), jnp.float32)
    got = jax.vjp(lambda x: move(x, jnp.asarray(to), jnp.asarray(back)), jnp.asarray(x))[1](dy)[0]
    want = jax.vjp(lambda x: x.at[to].get(mode="fill", fill_value=0), jnp.asarray(x))[1](dy)[0]
    assert not np.allclose(np.asarray(got), np.asarray(want))
