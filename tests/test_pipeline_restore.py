"""Issue 49: a run trained with pipeline stages restores without them and the reverse. A staged run (mesh.stage=2,
on 2 simulated devices in tests/pipeline_restore_worker.py) is evaluated by `decode.py --eval` on one device and
resumed on one device, as is one of 3 blocks staged 2 + 1; a run trained on one device is resumed with stages; a
staged run killed with -9 resumes bit-identically. Checkpoints hold the stacked blocks [L, ...] whole, whatever
split trained them."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import HANG, PATIENT_COLLECTIVES, cli_args, spawn, tiny_cfg, wait_for, write_corpus

from mtpjax.cli.decode import main as decode_main
from mtpjax.train import checkpoint
from mtpjax.train.loop import train

pytestmark = pytest.mark.slow

STEPS, MID = 6, 4  # a run's length and the checkpoint a resumed copy continues from
# No eval: the staged run alone evaluates (EVAL), once, at its end. A constant learning rate after warmup moves the
# blocks apart whatever a decay's details, so a resume that swapped two stages' blocks is told apart by a wide margin
# (the companions).
BASE = ["model.scan_layers=true", f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=3",
        "checkpoint.async_save=false", f"train.eval_every={STEPS}", "train.eval_batches=0", "train.num_samples=0",
        "train.micro_batches=2", "optim.schedule=constant"]
STAGED, EVAL = ["mesh.stage=2"], ["train.eval_batches=2"]
UNEVEN = ["model.n_layers=3"]  # staged as 2 + 1 (mesh.stage_layers): the second stage's stack padded to 2 blocks
TWO_DEVICES = f"{PATIENT_COLLECTIVES} --xla_force_host_platform_device_count=2"
METRIC_RTOL = 2e-6  # float32 rounding of one forward on another split (tests/test_pipeline.py's metrics tolerance)


def run_cfg(tmp: Path, corpus: Path, name: str, *overrides: str):
    """The runs' shared config (train.run_dir tmp/name) plus `overrides`."""
    return tiny_cfg(tmp, *BASE, *overrides, corpus=corpus, run=name)


def resumable_copy(run: Path, dst: Path) -> Path:
    """A copy of a finished run cut back to its checkpoint at MID: what a run stopped there would have left."""
    shutil.copytree(run, dst)
    for p in (dst / "checkpoints").iterdir():
        if p.name.isdigit() and int(p.name) > MID:
            shutil.rmtree(p)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp, corpus, the unstaged run's history, the worker's results): the unstaged run trains here, on one
    device; the worker trains the staged run and resumes the unstaged one with stages."""
    tmp = tmp_path_factory.mktemp("restore")
    corpus = write_corpus(tmp)
    jax.config.update("jax_disable_most_optimizations", True)  # as the tests compile (conftest), so they reuse it
    try:
        unstaged = train(run_cfg(tmp, corpus, "unstaged"))["history"]
    finally:
        jax.config.update("jax_disable_most_optimizations", False)
    inp = {"tmp": str(tmp), "corpus": str(corpus), "unstaged": str(tmp / "unstaged")}
    (tmp / "in.json").write_text(json.dumps(inp))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = PATIENT_COLLECTIVES  # the worker adds its 2 devices
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # as the kill test's runs compile (bitwise equal to them)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "pipeline_restore_worker.py"),
                           str(tmp / "in.json"), str(tmp / "out.json")], env=env, capture_output=True, text=True,
                          timeout=HANG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, corpus, unstaged, json.loads((tmp / "out.json").read_text())


def losses_after(history, step: int) -> list[float]:
    return [loss for s, loss in history if s > step]


def restore_blocks_rolled(monkeypatch) -> None:
    """Every restore hands back the stacked blocks rolled by one (the last block first): a layout that depended on
    the split that trained them."""
    real = checkpoint.Checkpointer.restore_latest

    def rolled(self, target):
        step, state, data_state, meta = real(self, target)
        state.params["blocks"] = jax.tree.map(lambda v: jnp.roll(v, 1, axis=0), state.params["blocks"])
        return step, state, data_state, meta

    monkeypatch.setattr(checkpoint.Checkpointer, "restore_latest", rolled)


def test_a_staged_run_resumes_on_one_device(runs):
    tmp, corpus, _, out = runs
    cont = resumable_copy(tmp / "staged", tmp / "staged-on-one-device")
    resumed = train(run_cfg(tmp, corpus, cont.name))["history"]
    assert [s for s, _ in resumed] == list(range(MID + 1, STEPS + 1))
    # the first step runs on the restored parameters: the same loss but for the split's rounding
    np.testing.assert_allclose(resumed[0][1], losses_after(out["staged"], MID)[0], rtol=METRIC_RTOL)
    np.testing.assert_allclose(losses_after(resumed, MID), losses_after(out["staged"], MID), rtol=1e-5)


def test_companion_a_resume_with_the_stages_blocks_swapped_is_caught(runs, monkeypatch):
    """A resume that read stage 1's blocks back first starts from other parameters: its first loss is told apart."""
    tmp, corpus, _, out = runs
    restore_blocks_rolled(monkeypatch)
    cont = resumable_copy(tmp / "staged", tmp / "staged-swapped")
    first = train(run_cfg(tmp, corpus, cont.name))["history"][0][1]
    expect = losses_after(out["staged"], MID)[0]
    assert abs(first - expect) > 100 * METRIC_RTOL * expect


def test_an_unevenly_staged_run_resumes_on_one_device(runs):
    """The checkpoint holds the 3 blocks, not the stages' padded 2 + 2: the run resumes unstaged where it left off."""
    tmp, corpus, _, out = runs
    cont = resumable_copy(tmp / "uneven", tmp / "uneven-on-one-device")
    resumed = train(run_cfg(tmp, corpus, cont.name, *UNEVEN))["history"]
    assert [s for s, _ in resumed] == list(range(MID + 1, STEPS + 1))
    np.testing.assert_allclose(resumed[0][1], losses_after(out["uneven"], MID)[0], rtol=METRIC_RTOL)
    np.testing.assert_allclose(losses_after(resumed, MID), losses_after(out["uneven"], MID), rtol=1e-5)


def test_companion_an_uneven_resume_with_the_second_stages_block_first_is_caught(runs, monkeypatch):
    """Had the checkpoint put the second stage's block (2) before the first stage's (0, 1), the first resumed loss
    is told apart."""
    tmp, corpus, _, out = runs
    restore_blocks_rolled(monkeypatch)
    cont = resumable_copy(tmp / "uneven", tmp / "uneven-shifted")
    first = train(run_cfg(tmp, corpus, cont.name, *UNEVEN))["history"][0][1]
    # the test's own check: at a loss near ln 256 the blocks move it little (8.8e-6 relative here, 0 when right)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(first, losses_after(out["uneven"], MID)[0], rtol=METRIC_RTOL)


def test_an_unstaged_run_resumes_with_stages(runs):
    _, _, unstaged, out = runs
    resumed = out["unstaged_resumed_on_stages"]
    assert [s for s, _ in resumed] == list(range(MID + 1, STEPS + 1))
    np.testing.assert_allclose(resumed[0][1], losses_after(unstaged, MID)[0], rtol=METRIC_RTOL)
    np.testing.assert_allclose(losses_after(resumed, MID), losses_after(unstaged, MID), rtol=1e-5)


def _decode_eval(run: Path, report: Path, capsys) -> dict:
    argv = ["--run-dir", str(run), "--eval", "--eval-prompts", "1", "--prompt-len", "8", "--max-new-tokens", "8",
            "--json", str(report)]
    assert decode_main(argv) == 0, capsys.readouterr().err
    return json.loads(report.read_text())


def test_decode_eval_on_one_device_reproduces_the_staged_runs_last_eval(runs, capsys):
    tmp, _, _, out = runs
    assert jax.device_count() == 1
    (rec,) = [e for e in out["staged_evals"] if e["step"] == STEPS]
    rep = _decode_eval(tmp / "staged", tmp / "eval.json", capsys)
    assert "the run's mesh stage=2" in capsys.readouterr().err  # said in one line: it decodes on one device
    assert rep["step"] == STEPS and set(rep["validation"]) == set(rec) - {"step"}
    for k, v in rec.items():
        if k != "step":
            assert rep["validation"][k] == pytest.approx(v, rel=METRIC_RTOL, abs=1e-7), k


def test_an_unevenly_staged_run_evaluates_on_its_own_mesh_as_on_one_device(runs, capsys):
    """decode.py --eval on the 2 stages the run trained on, split 2 + 1 as it was (the even split of 3 blocks over 2
    stages does not exist), gives one device's metrics."""
    tmp, _, _, out = runs
    on_mesh = out["uneven_eval_on_its_mesh"]
    assert on_mesh.get("rc") == 0, on_mesh
    one = _decode_eval(tmp / "uneven", tmp / "uneven-one.json", capsys)["validation"]
    assert set(on_mesh["validation"]) == set(one)
    for k, v in one.items():
        assert on_mesh["validation"][k] == pytest.approx(v, rel=METRIC_RTOL, abs=1e-7), k


def test_companion_a_restore_with_the_stages_blocks_swapped_is_caught(runs, capsys, monkeypatch):
    """A layout that depended on the stage count (stage 1's blocks read back first) fails the equality above."""
    tmp, _, _, out = runs
    real = checkpoint.SavedRun.model

    def swapped(self, step, mesh=None):
        cfg, model = real(self, step, mesh)
        params = nnx.state(model.blocks, nnx.Param)
        nnx.update(model.blocks, jax.tree.map(lambda v: jnp.roll(v, 1, axis=0), params))
        return cfg, model

    monkeypatch.setattr(checkpoint.SavedRun, "model", swapped)
    (rec,) = [e for e in out["staged_evals"] if e["step"] == STEPS]
    rep = _decode_eval(tmp / "staged", tmp / "eval-swapped.json", capsys)
    assert abs(rep["validation"]["loss/main"] - rec["loss/main"]) > 100 * METRIC_RTOL * rec["loss/main"]


def test_a_staged_run_killed_with_minus_9_resumes_bit_identically(runs, monkeypatch):
    """kill -9 once its first checkpoint is complete (no collective then or later is waited on by the test), then
    run to the end: every parameter equals the uninterrupted staged run's, bit for bit."""
    tmp, corpus, _, _ = runs
    monkeypatch.setenv("XLA_FLAGS", TWO_DEVICES)  # the worker's devices and compile settings
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    args = cli_args(run_cfg(tmp, corpus, "killed", *STAGED))
    run, log = tmp / "killed", tmp / "killed.log"
    proc = spawn(args, log)
    try:
        assert wait_for(lambda: checkpoint.complete_steps(run) != [], proc), log.read_text()[-3000:]
        assert proc.poll() is None, "the run ended before the kill"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    first = checkpoint.complete_steps(run)
    assert first[-1] < STEPS, first
    log = tmp / "resumed.log"
    proc = spawn(args, log)
    try:
        assert proc.wait(timeout=HANG) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert f"resuming from checkpoint {first[-1]}" in log.read_text()
    _, a, _ = checkpoint.load_model(tmp / "staged", STEPS)
    _, b, _ = checkpoint.load_model(run, STEPS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
