"""Checkpoints: manager policy (every / keep / last step), load_model, and its errors."""

import jax
import numpy as np
import pytest
from train_helpers import tiny_cfg

from mtpjax.checkpoint import CheckpointError, Checkpointer, load_model
from mtpjax.model import MTPTransformer
from mtpjax.sharding import make_mesh
from mtpjax.train_step import abstract_state, init_state


def test_round_trip_of_state_data_state_and_meta(tmp_path):
    cfg = tiny_cfg(tmp_path, "checkpoint.async_save=false")
    mesh = make_mesh(cfg.mesh)
    _, target, sh = abstract_state(cfg, mesh)
    state = init_state(cfg, mesh, sh)
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint)
    assert ck.save(4, state, {"pos": 7}, {"step": 4, "config": cfg.to_dict()})
    assert not ck.save(5, state, {"pos": 8}, {"step": 5})  # not due (every 4)
    ck.close()
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint)
    assert ck.latest_step() == 4
    restored, data_state, meta = ck.restore(4, target)
    assert data_state == {"pos": 7} and meta["step"] == 4
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keep_every_and_load_model(tmp_path):
    from mtpjax.train_loop import train

    cfg = tiny_cfg(tmp_path, "train.steps=10", "checkpoint.every=3", "checkpoint.keep=2", "train.eval_every=100")
    train(cfg)
    assert sorted(Checkpointer(tmp_path / "run", cfg.checkpoint).mngr.all_steps()) == [9, 10]  # last always
    got_cfg, model, tok = load_model(tmp_path / "run")
    assert isinstance(model, MTPTransformer) and got_cfg.model == cfg.model and tok.vocab_size == 256
    _, model9, _ = load_model(tmp_path / "run", step=9)
    assert not np.array_equal(np.asarray(model.embed[...]), np.asarray(model9.embed[...]))
    with pytest.raises(CheckpointError, match="no checkpoint at step 3"):
        load_model(tmp_path / "run", step=3)


def test_load_model_errors_are_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        load_model(tmp_path / "missing")
    assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_model(tmp_path / "empty")
