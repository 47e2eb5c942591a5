"""Checkpoints: manager policy (every / keep / last step), load_model, and its errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from train_helpers import tiny_cfg

from mtpjax.train.checkpoint import CheckpointError, Checkpointer, ckpt_dir, load_model
from mtpjax.nn.model import MTPTransformer
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import make_programs


def test_round_trip_of_state_data_state_and_meta(tmp_path):
    cfg = tiny_cfg(tmp_path, "checkpoint.async_save=false")
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state = progs.init()
    state = state.replace(step=state.step + 4, rng=state.rng + 1)  # every field distinguishable from a fresh one
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint)
    assert ck.save(4, state, {"pos": 7}, {"step": 4, "config": cfg.to_dict()})
    assert not ck.save(5, state, {"pos": 8}, {"step": 5})  # not due (every 4)
    ck.close()
    ck = Checkpointer(tmp_path / "run", cfg.checkpoint)
    assert ck.latest_step() == 4
    restored, data_state, meta = ck.restore(4, progs.target)
    assert data_state == {"pos": 7} and meta["step"] == 4 and int(restored.step) == 4
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "4").iterdir() if p.is_dir()) == \
        ["data", "digests", "meta", "model", "train"]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4" / "train")  # an item lost: one line that says the way out
    with pytest.raises(CheckpointError, match=r"^checkpoint 4 in .* could not be restored \(.*\); use --fresh to "
                                              r"start over$"):
        ck.restore(4, progs.target)


def test_keep_every_and_load_model(tiny_run):
    cfg, run = tiny_run  # 7 steps, checkpoint.every=2, checkpoint.keep=3
    assert sorted(Checkpointer(run, cfg.checkpoint).mngr.all_steps()) == [4, 6, 7]  # the last step always
    got_cfg, model, tok = load_model(run)
    assert isinstance(model, MTPTransformer) and got_cfg.model == cfg.model and tok.vocab_size == 256
    _, model6, _ = load_model(run, step=6)
    assert not np.array_equal(np.asarray(model.embed[...]), np.asarray(model6.embed[...]))
    with pytest.raises(CheckpointError, match="no checkpoint at step 2"):
        load_model(run, step=2)


def test_a_saved_config_that_is_invalid_or_missing_is_skipped_by_name(tiny_run, tmp_path, capsys):
    """Checkpoints without digests (written before them): a meta whose config does not validate, or that has none,
    is passed over with a line naming it, and the newest readable checkpoint loads."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run[1], run)
    for step, edit in ((7, lambda m: m["config"]["model"].update(d_model=-1)), (6, lambda m: m.pop("config"))):
        shutil.rmtree(run / "checkpoints" / str(step) / "digests")
        meta = run / "checkpoints" / str(step) / "meta" / "metadata"
        m = json.loads(meta.read_text())
        edit(m)
        meta.write_text(json.dumps(m))
    capsys.readouterr()
    _, model, _ = load_model(run)
    err = capsys.readouterr().err
    assert "checkpoint 7 of" in err and "has an invalid config (config key 'model.d_model' = -1 is invalid: must " \
        "be > 0)" in err
    assert "checkpoint 6 of" in err and "is unreadable (KeyError: 'config')" in err
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(load_model(run, step=4)[1].embed[...]))


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


@pytest.mark.parametrize("text", [b"\xff\xfe\x00garbage", b"model: [1\n"], ids=["binary", "bad yaml"])
def test_a_run_config_that_does_not_read_is_one_line_with_its_fix(tmp_path, text):
    """A run dir's config.yaml of binary bytes (was a UnicodeDecodeError traceback) or broken YAML (its several-line
    message was cut to its first line, the fix with it): one line that ends with what to do."""
    from mtpjax.train.checkpoint import read_run_config

    (tmp_path / "config.yaml").write_bytes(text)
    with pytest.raises(CheckpointError) as e:
        read_run_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"'{tmp_path / 'config.yaml'}' is not a valid config (")
    assert msg.endswith("delete it to resume with the config of the latest checkpoint, or use --fresh to move the "
                        "old run aside")


def test_load_model_reads_a_model_only_directory(tiny_run, tmp_path):
    """Export/import write only the `model` and `meta` items (no optimizer, no data position): enough for load_model."""
    cfg, run = tiny_run
    _, model, _ = load_model(run)
    out = tmp_path / "exported"
    shutil.copytree(run / "tokenizer", out / "tokenizer")
    mngr = ocp.CheckpointManager(ckpt_dir(out))
    mngr.save(7, args=ocp.args.Composite(model=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))),
                                         meta=ocp.args.JsonSave({"step": 7, "config": cfg.to_dict()})))
    mngr.wait_until_finished()
    mngr.close()
    got_cfg, again, _ = load_model(out)
    assert got_cfg == cfg
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_digests_are_checked_across_layouts(tmp_path):
    """Saved whole and restored in halves over 2 devices (the saved region gathered), and the reverse; a changed
    element is caught (tests/digest_layouts_worker.py)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    p = subprocess.run([sys.executable, str(Path(__file__).parent / "digest_layouts_worker.py"), str(tmp_path / "ck")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == {"holder": None, "whole_to_halves": None, "changed": "array model.w",
                   "regions": ["0:4,0:8", "4:8,0:8"], "halves_to_whole": None}
