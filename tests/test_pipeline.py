"""Pipeline stages (mesh.stage, parallel/pipeline.py): GPipe == no stages in float32 on 4 simulated devices (in a
subprocess), the bubble, and the config errors of a split the trunk does not allow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import write_corpus

from mtpjax.config import ConfigError, load_config
from mtpjax.parallel.pipeline import bubble
from mtpjax.parallel.sharding import MeshError, make_mesh

GRAD_RTOL = 1e-5  # float32 rounding of sums taken in another order (measured: below 1e-6)


def test_bubble_is_idle_ticks_over_all_ticks():
    assert bubble(1, 8) == 0.0
    assert bubble(2, 4) == pytest.approx(1 / 5)
    assert bubble(4, 8) == pytest.approx(3 / 11)


@pytest.mark.parametrize("overrides, match", [
    (["mesh.stage=2", "model.n_layers=4"], "mesh.stage.*model.scan_layers=true"),
    (["mesh.stage=3", "model.n_layers=4", "model.scan_layers=true"], "mesh.stage.*must divide model.n_layers=4"),
])
def test_a_split_the_trunk_cannot_take_names_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_stage_mesh_mismatch_names_the_stage_axis():
    with pytest.raises(MeshError, match=r"mesh stage\*data\*fsdp\*tensor = 2\*1\*1\*1 = 2 but 1 device"):
        make_mesh(load_config(None, ["mesh.stage=2", "model.scan_layers=true"]).mesh)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """tests/pipeline_worker.py's results (4 CPU devices, one subprocess)."""
    tmp = tmp_path_factory.mktemp("stages")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "pipeline_worker.py"), str(write_corpus(tmp)),
                           str(tmp), str(tmp / "out.json")], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


CASES = ["dense_d1_s2", "dense_d2_s2", "dense_d2_s4", "dense_d1_s4", "moe_d2_s2", "moe_d1_s4", "moe_d2_s2_e2"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_stages_give_the_unstaged_loss_metrics_and_gradient(staged, case):
    """S stages × M micro-batches == one device: every loss, per-depth metric, expert load and gradient."""
    out = staged[case]
    single, staged_m = out["single"], out["staged"]
    assert single.keys() == staged_m.keys() and "loss/mtp_1" in single
    for k, v in single.items():
        np.testing.assert_allclose(staged_m[k], v, rtol=2e-6, atol=1e-7, err_msg=k)
    if case.startswith("moe"):
        assert "loss/moe_balance" in single and any(k.startswith("load/") for k in single)
    worst = max(out["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < GRAD_RTOL, worst


@pytest.mark.slow
def test_companion_a_tail_without_the_embeddings_gradient_is_caught(staged):
    """The MTP modules and the tied head read the embedding after the pipeline: dropping those uses' gradient leaves
    only the first stage's, which the equality above tells apart."""
    rel = staged["dropped_embedding_tail"]
    assert rel["embed"] > 100 * GRAD_RTOL
    assert max(v for k, v in rel.items() if k != "embed") < GRAD_RTOL  # nothing else moved


@pytest.mark.slow
def test_twenty_staged_steps_end_at_the_unstaged_parameters(staged):
    res = staged["training"]
    np.testing.assert_allclose(res["losses"][1], res["losses"][0], rtol=1e-5)
    assert res["losses"][0][-1] < res["losses"][0][0]
    worst = max(res["param_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst


# ----------------------------------------------------------------------------- runs: kill -9, restore across layouts

RUN = ["model.n_layers=4", "model.scan_layers=true", "train.micro_batches=4", "train.steps=8", "train.eval_every=4",
       "train.eval_batches=1", "checkpoint.every=2", "checkpoint.keep=4", "train.num_samples=0"]
STAGED = ["mesh.stage=2", "mesh.data=2"]


def _complete(run: Path) -> list[int]:
    ck = run / "checkpoints"
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) if ck.is_dir() else []


@pytest.mark.slow
def test_a_staged_run_killed_resumes_identically_and_restores_without_stages(tmp_path, monkeypatch, capsys):
    """A stage=2 run (4 devices, train.py subprocesses) killed with -9 after its first checkpoint ends at the
    uninterrupted run's parameters bit for bit; the checkpoint restores on one device without stages, where
    `decode.py --eval` reproduces the run's own last validation loss."""
    from train_helpers import cli_args, spawn, tiny_cfg, wait_for

    from mtpjax.cli.decode import main as decode_main
    from mtpjax.eval.log import read_evals
    from mtpjax.train.checkpoint import load_model

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    corpus = write_corpus(tmp_path)
    runs = {name: tmp_path / name for name in ("ref", "kill")}
    args = {name: cli_args(tiny_cfg(tmp_path, *RUN, *STAGED, corpus=corpus, run=name)) for name in runs}
    ref = spawn(args["ref"], tmp_path / "ref.log")
    proc = spawn(args["kill"], tmp_path / "kill.log")
    assert wait_for(lambda: len(_complete(runs["kill"])) >= 1, proc), (tmp_path / "kill.log").read_text()[-2000:]
    assert proc.poll() is None, "the run ended before the kill"
    proc.send_signal(9)
    proc.wait()
    last = _complete(runs["kill"])[-1]
    assert last < 8
    again = spawn(args["kill"], tmp_path / "again.log")
    assert again.wait(timeout=900) == 0 and ref.wait(timeout=900) == 0, (tmp_path / "again.log").read_text()[-3000:]
    assert f"resuming from checkpoint {last}" in (tmp_path / "again.log").read_text()
    (_, a, _), (_, b, _) = (load_model(runs[n]) for n in ("ref", "kill"))  # on one device: no stage axis here
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # decode.py --eval on one device: the validation loss the pipelined run logged at its last eval
    monkeypatch.setenv("XLA_FLAGS", "")
    out = tmp_path / "eval.json"
    assert decode_main(["--run-dir", str(runs["ref"]), "--eval", "--eval-batches", "1", "--eval-prompts", "1",
                        "--prompt-len", "8", "--max-new-tokens", "4", "--json", str(out)]) == 0
    logged = read_evals(runs["ref"])[-1]
    assert logged["step"] == 8
    got = json.loads(out.read_text())["validation"]
    for k in ("loss/main", "loss/mtp_1", "loss/mtp_2"):
        assert got[k] == pytest.approx(logged[k], rel=1e-5), k


@pytest.mark.slow
def test_plan_reports_the_bubble_and_the_state_per_stage(capsys):
    from mtpjax.cli.plan import main as plan_main

    assert plan_main(["--config", "configs/tiny.yaml", "mesh.stage=2", "model.scan_layers=true",
                      "train.micro_batches=4"]) == 0
    out = capsys.readouterr().out
    assert "mesh.stage=2 x train.micro_batches=4 (GPipe), bubble (S-1)/(M+S-1) = 20.0%" in out
    assert "trunk blocks" in out and "MTP modules" in out
