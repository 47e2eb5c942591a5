"""Sharding: logical rules, mesh errors, and (8 simulated devices, in a subprocess) sharded == single device."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P
from train_helpers import step_losses, synthetic_batches, tiny_cfg, write_corpus

from mtpjax.train.checkpoint import Checkpointer, load_model
from mtpjax.config import MeshConfig, load_config
from mtpjax.parallel.sharding import AXES, MeshError, batch_sharding, logical_to_spec, make_mesh
from mtpjax.train.loop import train
from mtpjax.train.setup import TrainError, check_parallelism
from mtpjax.train.step import make_programs

FAKE = SimpleNamespace(shape={"data": 2, "fsdp": 4, "tensor": 2})


def test_spec_from_logical_axes_with_divisibility_fallback():
    assert logical_to_spec(("vocab", "embed"), (256, 64), FAKE) == P("tensor", "fsdp")
    assert logical_to_spec(("vocab", "embed"), (255, 64), FAKE) == P(None, "fsdp")  # 255 % 2: replicated
    assert logical_to_spec(("embed",), (6,), FAKE) == P(None)  # 6 % 4
    assert logical_to_spec((None, "embed"), (128, 64), FAKE) == P(None, "fsdp")


def test_scanned_stack_gets_a_leading_replicated_layers_axis():
    assert logical_to_spec(("embed", "mlp"), (3, 64, 128), FAKE) == P(None, "fsdp", "tensor")
    with pytest.raises(ValueError, match="do not match"):
        logical_to_spec(("embed",), (3, 4, 64), FAKE)


def test_mesh_mismatch_names_numbers_and_fix():
    with pytest.raises(MeshError) as e:
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=1))
    msg = str(e.value)
    assert "2*2*1 = 4" in msg and "1 device" in msg and "mesh.data" in msg and "\n" not in msg


def test_batch_sharding_over_data_fsdp_and_expert():
    mesh = make_mesh(MeshConfig())
    assert batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)


# ----------------------------------------------------------------------------- 8 simulated devices

STEPS = 6


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """Run tests/multidevice_worker.py once with 8 CPU devices; its JSON results."""
    tmp = tmp_path_factory.mktemp("eight")
    corpus = write_corpus(tmp)
    (tmp / "in.json").write_text(json.dumps({"tmp": str(tmp), "corpus": str(corpus), "steps": STEPS}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "multidevice_worker.py"),
                           str(tmp / "in.json"), str(tmp / "out.json")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, corpus, json.loads((tmp / "out.json").read_text())


@pytest.mark.slow
def test_sharded_meshes_match_single_device(eight):
    tmp, corpus, out = eight
    assert jax.device_count() == 1
    cfg = tiny_cfg(tmp, corpus=corpus, run="single")
    ref, _ = step_losses(cfg, synthetic_batches(1, cfg.train.batch_size, cfg.data.seq_len) * 3)
    for shape, losses in out["losses"].items():
        np.testing.assert_allclose(losses, ref, rtol=2e-6, err_msg=shape)
    assert ref[2] < ref[0]
    # companion: the (2,2,2) run whose second data shard read the first shard's rows is told apart
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(out["losses_wrong_split"], ref, rtol=2e-6)


@pytest.mark.slow
def test_parameters_and_moments_really_are_sharded(eight):
    sh = eight[2]["shardings"]
    # (2,2,2): embed [256,32] -> vocab over tensor(2), embed over fsdp(2).
    assert sh["(2, 2, 2)"]["embed"]["spec"] == str(P("tensor", "fsdp"))
    assert sh["(2, 2, 2)"]["embed"]["shard"] == [128, 16]
    # (1,4,2): wq [32, 4*8] -> embed over fsdp(4), heads over tensor(2); mlp down [64, 32].
    assert sh["(1, 4, 2)"]["wq"]["shard"] == [8, 16]
    assert sh["(1, 4, 2)"]["down"]["shard"] == [32, 8]
    # (8,1,1): pure data parallelism, parameters replicated.
    assert sh["(8, 1, 1)"]["embed"]["shard"] == [256, 32]
    for mesh in sh.values():
        for p in mesh.values():
            assert p["mu_spec"] == p["spec"]  # Adam moments shard like their parameters


@pytest.mark.slow
def test_resume_across_mesh_change(eight):
    """Saved on (2,2,2) at STEPS/2; resumed on (8,1,1) and on one device == one device straight."""
    tmp, corpus, out = eight
    straight = train(tiny_cfg(tmp, f"train.steps={STEPS}", corpus=corpus, run="straight"))
    ref = [loss for _, loss in straight["history"]]
    assert [s for s, _ in out["history"]] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in out["history"]], ref, rtol=1e-5)
    resumed = train(tiny_cfg(tmp, f"train.steps={STEPS}", corpus=corpus, run="mesh-run-copy"))
    assert [s for s, _ in resumed["history"]] == list(range(STEPS // 2 + 1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in resumed["history"]], ref[STEPS // 2:], rtol=1e-5)
    _, m_a, _ = load_model(tmp / "straight")
    _, m_b, _ = load_model(tmp / "mesh-run-copy")
    # Sharded float32 reductions differ in the last bits, and Adam's division by sqrt(v) lifts that
    # noise in near-zero gradients to ~1e-4 of one step (lr 1e-2): atol 1e-5 is far below any real error.
    for a, b in zip(jax.tree.leaves(m_a), jax.tree.leaves(m_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_checkpoint_restores_exactly_onto_other_meshes(eight):
    """A state saved on (2,2,2) restores bit-exactly onto (1,4,2) (in the worker) and onto one device."""
    tmp, corpus, out = eight
    assert out["restored_on_142"] is True
    cfg = tiny_cfg(tmp, corpus=corpus, run="unused")
    target = make_programs(cfg, make_mesh(cfg.mesh)).target
    restored, _, meta = Checkpointer(tmp / "ck222", cfg.checkpoint).restore(1, target)
    saved = np.load(tmp / "ck222.npz")
    leaves = jax.tree.leaves(restored)
    assert len(leaves) == len(saved.files) and meta["config"]["model"]["d_model"] == 32
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(np.asarray(leaf), saved[f"arr_{i}"])


@pytest.mark.slow
def test_batch_not_divisible_by_data_parallelism(eight):
    bad = eight[2]["bad_batch"]
    assert bad["rc"] == 2
    lines = bad["stderr"].strip().splitlines()
    assert len(lines) == 1 and "train.batch_size=12" in lines[0] and "mesh.data*mesh.fsdp=8" in lines[0]


@pytest.mark.parametrize("shape, named", [((2, 1, 3, 1), "mesh.data*mesh.fsdp*mesh.expert=6"),
                                          ((2, 3, 1, 1), "mesh.data*mesh.fsdp=6")])
def test_batch_split_message_names_the_expert_axis_when_it_splits(shape, named):
    """The expert axis splits the batch too: the message names it when it is used, and only then."""
    cfg = load_config(None, ["train.batch_size=8"])
    with pytest.raises(TrainError) as e:
        check_parallelism(cfg, AbstractMesh(shape, AXES))
    assert f"train.batch_size=8 is not divisible by data parallelism {named} " in str(e.value)


def test_a_mesh_the_torus_cannot_hold_whole_splits_physical_axes_and_says_so(monkeypatch, capfd):
    """jax.make_mesh refuses a logical axis that is no product of whole physical axes (4 on a v5p-1024's 8x8x8);
    the mesh is then laid out with physical axes split, in one line, not a traceback."""
    def refuse(*a, **k):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 4 of size 4")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = make_mesh(MeshConfig())
    assert dict(mesh.shape) == {a: 1 for a in mesh.axis_names} and mesh.devices.size == 1
    assert "mesh: the mesh 1x1x1x1 does not lay out on whole physical axes" in capfd.readouterr().err
