"""The train loop and train.py: resume, TensorBoard tags, banner and summary, preemption, NaN policy, bad input."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import HANG, cli_args, one_line_error, spawn, tiny_cfg, wait_for, write_corpus

from mtpjax.data.pipeline import BatchIterator
from mtpjax.train.checkpoint import Checkpointer, load_model
from mtpjax.config import replace
from mtpjax.cli.train import main
from mtpjax.train.loop import NonFiniteError, train

REPO = Path(__file__).resolve().parent.parent


def test_resume_equals_straight_run(tmp_path, monkeypatch):
    """8 steps straight == 4 steps, stop, re-run to 8: same losses, data batches and parameters."""
    corpus = write_corpus(tmp_path)
    straight = train(tiny_cfg(tmp_path, corpus=corpus, run="a"))
    cfg_b = tiny_cfg(tmp_path, corpus=corpus, run="b")
    first = train(cfg_b, max_steps=4)
    shutil.copytree(tmp_path / "b", tmp_path / "c")  # stopped at 4, for the companion below
    assert first["step"] == 4 and Checkpointer(tmp_path / "b", cfg_b.checkpoint).latest_step() == 4
    second = train(cfg_b)
    assert [s for s, _ in second["history"]] == [5, 6, 7, 8]
    np.testing.assert_array_equal(np.array(first["history"] + second["history"]), np.array(straight["history"]))
    assert second["eval/loss/main"] == straight["eval/loss/main"]
    _, ma, _ = load_model(tmp_path / "a")
    _, mb, _ = load_model(tmp_path / "b")
    for a, b in zip(jax.tree.leaves(ma), jax.tree.leaves(mb)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(second["goodput_s"][c] >= v for c, v in first["goodput_s"].items())  # totals carry over a resume
    again = train(cfg_b)  # nothing left to do: no step runs, nothing breaks
    assert again["step"] == 8 and again["history"] == []
    # Companion: the same resume with the data iterator's saved state ignored (it starts over) differs.
    monkeypatch.setattr(BatchIterator, "set_state", lambda self, state: None)
    lost = train(tiny_cfg(tmp_path, corpus=corpus, run="c"))
    assert [s for s, _ in lost["history"]] == [5, 6, 7, 8] and lost["history"] != second["history"]


def test_tensorboard_has_every_tag(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_cfg(tmp_path, "train.steps=6", "train.eval_every=3", "train.peak_flops=0")
    out = train(cfg)
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"loss/main", "lambda", "lr", "grad_norm", "tokens_per_sec", "mfu", "expected_accept_length",
            "eval/loss/main"}
    for k in (1, 2):
        want |= {f"loss/mtp_{k}", f"accuracy/mtp_{k}", f"agreement/mtp_{k}", f"eval/loss/mtp_{k}",
                 f"eval/agreement/mtp_{k}", f"lambda/mtp_{k}"}
    assert want <= tags, want - tags
    texts = {t.split("/text_summary")[0] for t in acc.Tags()["tensors"]}
    assert {"config", "samples/0"} <= texts
    mfu = [e.value for e in acc.Scalars("mfu")]
    assert all(0 < v < 1 for v in mfu) and out["eval/loss/main"] > 0
    # goodput: its parts cover the run, it is their productive share, and TensorBoard and goodput.json say the same
    parts = out["goodput_s"]
    assert {"goodput"} | {f"goodput/{c}_s" for c in parts} <= tags and min(parts.values()) >= 0
    assert parts["step"] > 0 and parts["compile"] > 0 and parts["eval"] > 0 and parts["checkpoint"] > 0
    assert out["goodput"] == pytest.approx(parts["step"] / sum(parts.values()), rel=1e-12)
    assert acc.Scalars("goodput")[-1].value == pytest.approx(out["goodput"], rel=1e-6)
    assert json.loads((tmp_path / "run" / "goodput.json").read_text()) == parts


def test_tokens_per_second_restarts_after_evals_and_checkpoints(tmp_path, monkeypatch):
    """tokens/s and MFU count training steps only: the clock restarts after the first (compiling) step, after each
    eval and after each checkpoint save."""
    from mtpjax.train.report import Logger

    restarts, original = [], Logger.restart_clock
    monkeypatch.setattr(Logger, "restart_clock",
                        lambda self, step, t=None: restarts.append(step) or original(self, step, t))
    train(tiny_cfg(tmp_path, "train.steps=7", "checkpoint.every=2", "train.eval_every=3", "train.log_every=1"))
    assert {1, 2, 3, 4, 6} <= set(restarts), restarts


def test_tokens_per_second_is_right_at_steps_read_at_once(tmp_path, monkeypatch):
    """The reader runs a step behind, but an eval's or a save's tick reads its step at once, right after the step
    before: a step is timed from when the host queued it, not from when it was read. Host-bound steps of 1 s each (a
    fake clock) give batch x seq_len tokens/s at every logged step, the eval steps 4 and 8 included (read back to back
    with steps 3 and 7 they got 0 s: an infinite or, on a real clock, a many-fold rate); the step after an eval starts
    the clock again, without a rate."""
    from types import SimpleNamespace

    from mtpjax.train import loop
    from mtpjax.train.hooks import Tick

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock.now)
    logged = {}
    sink = SimpleNamespace(scalars=lambda step, d: logged.setdefault(step, d), text=lambda *a: None)
    bar = SimpleNamespace(set_postfix=lambda **kw: None, update=lambda n: None)
    cfg = tiny_cfg(tmp_path, "train.steps=8", "train.log_every=1")
    report = loop._Report(cfg, sink, bar, 1)
    met = {"loss/total": 3.0, "loss/main": 2.5, "lr": 0.01, "grad_norm": 1.5, "skipped": 0.0}
    for step in range(1, 9):
        clock.now += 1.0  # the host's work for one step (its batch, the dispatch)
        tick = Tick(step, None, met, last=step == 8)
        if step % 4:
            report.read(tick)
        else:  # an eval step
            report.sync(tick)
            clock.now += 30.0
            report.log.restart_clock(step)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    assert {s: d.get("tokens_per_sec") for s, d in logged.items()} == {
        1: None, 2: tokens, 3: tokens, 4: tokens, 5: None, 6: tokens, 7: tokens, 8: tokens}


def test_a_piped_run_logs_a_line_every_log_every_steps(tmp_path, capsys, monkeypatch):
    """Piped (a scheduler's log file) or with train.progress=false, where no bar redraws, every train.log_every-th
    step is one line: its losses, learning rate, gradient norm and, past the compiling step, tokens/s and MFU;
    companion: in a terminal with the bar on, the bar shows them and no such line is written."""
    from types import SimpleNamespace

    from mtpjax.parallel import console
    from mtpjax.train import loop

    sink = SimpleNamespace(scalars=lambda step, d: None, text=lambda *a: None)
    bar = SimpleNamespace(set_postfix=lambda **kw: None)
    for live, progress, lines in ((False, "true", True), (True, "false", True), (True, "true", False)):
        monkeypatch.setattr(console, "live", lambda live=live: live)
        cfg = tiny_cfg(tmp_path, f"train.progress={progress}", "train.peak_flops=1e12", "train.log_every=2")
        assert loop._Report(cfg, sink, bar, 1).log.lines is lines, (live, progress)
    log = loop._Report(cfg, sink, bar, 1).log
    log.lines = True
    met = {"loss/total": 3.0, "loss/main": 2.5, "loss/mtp_1": 2.75, "loss/mtp_2": 3.0, "lr": 0.01, "grad_norm": 1.5}
    capsys.readouterr()
    for step in (2, 3, 4):
        log.record(step, met)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2  # steps 2 and 4: every log_every-th
    assert lines[0] == "step 2: loss/main 2.5000, mtp_1 2.7500, mtp_2 3.0000, lr 0.01, grad_norm 1.5"  # compiling
    assert re.fullmatch(r"step 4: loss/main 2\.5000, mtp_1 2\.7500, mtp_2 3\.0000, lr 0\.01, grad_norm 1\.5, "
                        r"[\d,]+ tokens/s, mfu [\d.]+%", lines[1]), lines[1]  # past the compiling step: a rate


def test_the_last_step_is_logged_whatever_log_every(tmp_path):
    """TensorBoard gets every train.log_every-th step and the run's last one (the step the summary's train loss is
    from), also when log_every does not divide train.steps; companion: a step that is neither is not logged."""
    from types import SimpleNamespace

    from mtpjax.train.report import Logger

    logged = []
    sink = SimpleNamespace(scalars=lambda step, d: logged.append((step, set(d))), text=lambda *a: None)
    bar = SimpleNamespace(set_postfix=lambda **kw: None)
    cfg = tiny_cfg(tmp_path, "train.steps=8", "train.log_every=3")
    log = Logger(cfg, sink, bar, 1, 1e12)
    met = {"loss/total": 3.0, "loss/main": 2.5, "lr": 0.01, "grad_norm": 1.5}
    for step in range(1, 9):
        log.record(step, met)
    assert [s for s, _ in logged] == [3, 6, 8]
    assert all({"loss/main", "lr", "tokens_per_sec"} <= tags for _, tags in logged)


def test_goodput_moves_lost_steps_to_restart_and_keeps_the_total():
    from mtpjax.train.goodput import CATEGORIES, goodput, resumed

    latest = dict(zip(CATEGORIES, (10.0, 3.0, 2.0, 1.0, 4.0, 0.5)))  # goodput.json of a killed process
    carried = resumed(latest, {"step": 7.0, "compile": 3.0})  # its last checkpoint had 7 s of steps
    assert carried["step"] == 7.0 and carried["restart"] == 3.5 and sum(carried.values()) == sum(latest.values())
    assert resumed(latest, {}) == {**latest, "step": 0.0, "restart": 10.5}  # killed before its first checkpoint
    assert resumed(latest, None) == latest  # a checkpoint without totals: nothing is known to be lost
    assert resumed(None, {}) == dict.fromkeys(CATEGORIES, 0.0) and goodput(dict.fromkeys(CATEGORIES, 0.0)) == 0
    assert goodput(carried) == pytest.approx(7.0 / 20.5)


def test_goodput_is_one_point_per_step_in_tensorboard(tmp_path):
    """An eval, a checkpoint and the run's end at one step each count goodput: TensorBoard gets one point for that
    step (its last totals, what goodput.json holds), not one per count; a later step gets its own point."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mtpjax.train.goodput import Goodput
    from mtpjax.train.loop import _count
    from mtpjax.train.metrics import Writer

    gp, writer = Goodput(tmp_path, 0.0), Writer(tmp_path)
    for step, category in ((2, "eval"), (4, "eval"), (4, "checkpoint"), (4, "checkpoint")):
        _count(gp, category, writer, step)
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    points = acc.Scalars("goodput/checkpoint_s")
    assert [p.step for p in points] == [2, 4]
    assert points[-1].value == pytest.approx(json.loads((tmp_path / "goodput.json").read_text())["checkpoint"])


def test_fresh_moves_the_old_run_aside(tiny_run, tmp_path):
    cfg, run = _copy_run(tiny_run, tmp_path)
    other = replace(cfg, ["data.val_fraction=0.2", "train.steps=2"])  # another run: the same model, other data
    out = train(other, fresh=True)
    assert out["step"] == 2 and out["history"][0][0] == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "7").is_dir()
    assert "val_fraction: 0.1" in (aside[0] / "config.yaml").read_text()


@pytest.mark.slow
def test_nan_policy_stop_and_skip(tmp_path):
    """A real divergence (no injected NaN): stopped at once, or after max_skipped_steps skipped updates."""
    corpus = write_corpus(tmp_path)
    blowup = ["optim.lr=1e12", "optim.grad_clip=0", "optim.warmup_steps=0", "train.eval_every=100"]
    with pytest.raises(NonFiniteError, match="nan_policy=stop"):
        train(tiny_cfg(tmp_path, *blowup, corpus=corpus, run="stop"))
    with pytest.raises(NonFiniteError, match="max_skipped_steps=2"):
        train(tiny_cfg(tmp_path, *blowup, "train.nan_policy=skip", "train.max_skipped_steps=2",
                       corpus=corpus, run="skip"))


def _copy_run(tiny_run, tmp: Path):
    cfg, run = tiny_run
    shutil.copytree(run, tmp / "run")
    return replace(cfg, [f"train.run_dir={tmp / 'run'}"]), tmp / "run"


def test_banner_and_summary(tiny_run, tmp_path, capsys):
    """train.py opens with what it is about to do and ends with losses, the checkpoint and the next command."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    capsys.readouterr()
    assert main(cli_args(cfg, "train.steps=8", "train.eval_batches=1")) == 0
    err = capsys.readouterr().err.splitlines()
    head = err[err.index(next(ln for ln in err if ln.startswith("mtpjax train: "))):][:5]
    assert head[0].startswith("mtpjax train: 49,632 parameters (trunk 18,592, embedding/head 8,192, 2 MTP modules")
    assert head[1] == "  devices: 1 x cpu on 1 process(es); mesh data=1 fsdp=1 expert=1 tensor=1", head
    assert head[2] == f"  run dir: {run} (resuming from step 7)"
    assert re.fullmatch(r"  data: text \(1 file\), [\d,]+ train / [\d,]+ val tokens, byte tokenizer \(vocab 256\), "
                        r"content [0-9a-f]{12}", head[3]), head[3]
    assert head[4].startswith("  steps 7 -> 8: batch 8 x 32 tokens")
    tail = err[-5:]
    assert tail[0].startswith("done: 8 steps of 8 in ")
    assert tail[1].startswith("  train loss: main ") and ", mtp_2 " in tail[1]
    assert tail[2].startswith("  eval loss: main ") and ", mtp_2 " in tail[2]
    assert tail[3] == f"  checkpoint: {run / 'checkpoints' / '8'}"
    # sampled: greedy text of a young model repeats one line (test_main_job runs it on the quickstart's run)
    assert tail[4] == (f"  next: python decode.py --run-dir {run} --prompt 'def fibonacci(n):' --temperature 0.7 "
                       "--top-k 40 --stats")
    # (tests/test_main_job.py runs that command as printed, on the README's main job)


def test_summary_of_a_fresh_stopped_run_says_how_to_resume(tiny_run, tmp_path, capsys):
    cfg = replace(tiny_run[0], [f"train.run_dir={tmp_path / 'run'}"])
    capsys.readouterr()
    train(cfg, max_steps=1)
    err = capsys.readouterr().err
    assert "  run dir: " + str(tmp_path / "run") + " (fresh start)" in err
    assert "stopped at step 1 of 7 in " in err and "  resume: run the same command again" in err
    assert f"  checkpoint: {tmp_path / 'run' / 'checkpoints' / '1'}" in err


def test_summary_of_a_run_resumed_past_its_steps_says_nothing_was_trained(tiny_run, tmp_path, capsys):
    """A shortened train.steps below the run's step trains nothing and says so (it read "done: 7 steps of 5")."""
    cfg, run = _copy_run(tiny_run, tmp_path)
    capsys.readouterr()
    out = train(replace(cfg, ["train.steps=5"]))
    err = capsys.readouterr().err
    assert out["step"] == 7 and out["history"] == []
    assert "nothing trained: the run is at step 7, past train.steps=5 (raise it to train on)" in err
    assert "done: 7 steps" not in err


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def _error(capsys, argv) -> str:
    return one_line_error(capsys, main, argv)


@pytest.mark.parametrize("override, expected", [
    (["data.paths=/nonexistent/corpus"], "/nonexistent/corpus"),
    (["model.vocab_size=100"], "model.vocab_size=100"),
    (["mesh.data=2"], "2*1*1 = 2 but 1 device"),
    (["train.batch_size=4096"], "batch"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, override, expected):
    cfg = tiny_cfg(tmp_path)
    assert expected in _error(capsys, cli_args(cfg, *override))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_empty_data_dir(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cfg = tiny_cfg(tmp_path, f"data.paths={tmp_path / 'empty'}")
    assert "empty" in _error(capsys, cli_args(cfg))


def test_unwritable_run_dir(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cfg = tiny_cfg(tmp_path, f"train.run_dir={tmp_path / 'file' / 'run'}")
    assert "not writable" in _error(capsys, cli_args(cfg))


def test_a_run_dir_that_is_a_file(tmp_path, capsys):
    """train.run_dir naming a file is one line (with or without --fresh), the file untouched."""
    (tmp_path / "file").write_text("mine")
    cfg = tiny_cfg(tmp_path, f"train.run_dir={tmp_path / 'file'}")
    for fresh in ([], ["--fresh"]):
        assert _error(capsys, cli_args(cfg, *fresh)) == (f"error: train.run_dir '{tmp_path / 'file'}' is a file, not a "
                                                        "directory; choose another train.run_dir")
    assert (tmp_path / "file").read_text() == "mine"


def test_config_mismatch_with_existing_run(tiny_run, tmp_path, capsys):
    cfg, run = _copy_run(tiny_run, tmp_path)
    before = sorted(p.name for p in run.rglob("*"))
    err = _error(capsys, cli_args(cfg, "model.d_model=64"))
    assert "model.d_model: 32 -> 64" in err and "--fresh" in err
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing clobbered
    assert main(cli_args(cfg, "train.steps=8")) == 0  # train.* may change on resume


def _run_cli(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_cli_error_has_no_traceback(tmp_path):
    cfg = tiny_cfg(tmp_path, "data.paths=/nonexistent/corpus")
    out, err = _run_cli(cli_args(cfg)).communicate(timeout=120)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err


def test_preempted_before_the_first_step_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    """A SIGTERM during setup stops a fresh run at step 0 with nothing to save, and train.py says so (exit 0); the
    companion below: after steps, the line names the saved step."""
    from mtpjax.train import loop

    monkeypatch.setattr(loop._Preemption, "check", lambda self, step: setattr(self, "requested", True) or True)
    cfg = tiny_cfg(tmp_path)
    assert main(cli_args(cfg)) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "preempted at step 0, before anything to save; run the same command again"
    assert "  checkpoint: none" in err and Checkpointer(tmp_path / "run", cfg.checkpoint).latest_step() is None
    assert not [ln for ln in err if "next: python decode.py" in ln]  # nothing saved, nothing to decode


@pytest.mark.parametrize("presses", [1, 2, "ignored"])
def test_ctrl_c_saves_the_step_and_exits_130_and_twice_stops_at_once(tmp_path, monkeypatch, capfd, presses):
    """A first Ctrl-C stops the run as SIGTERM does, after its step, saved, in one line and exit 130 (it was a JAX
    traceback, the steps since the last checkpoint lost); a second stops at once, one line, exit 130; Python's own
    Ctrl-C handling is back after either. A process that ignores SIGINT (a background job) goes on ignoring it."""
    from mtpjax.train import loop

    check = loop._Preemption.check

    def press_at_step_2(self, step):
        for _ in range(1 if presses == "ignored" else presses if step == 2 and not self.interrupted else 0):
            signal.raise_signal(signal.SIGINT)  # its handler runs before this returns
        return check(self, step)

    monkeypatch.setattr(loop._Preemption, "check", press_at_step_2)
    given = signal.SIG_IGN if presses == "ignored" else signal.default_int_handler  # whatever this worker inherited
    outer = signal.signal(signal.SIGINT, given)
    try:
        cfg = tiny_cfg(tmp_path, "train.steps=6", "checkpoint.every=100", "train.eval_every=100")
        rc, after = main(cli_args(cfg)), signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, outer)
    err = capfd.readouterr().err.strip().splitlines()  # the handler writes to the file descriptor
    saved = Checkpointer(tmp_path / "run", cfg.checkpoint).latest_step()
    assert after is given
    if presses == "ignored":
        assert rc == 0 and saved == 6 and not [line for line in err if "interrupt" in line]
        return
    assert rc == 130 and "interrupt: stopping after this step and saving it (Ctrl-C again to stop at once)" in err
    if presses == 1:
        assert err[-1] == "interrupted: checkpoint saved at step 2" and saved == 2
        assert any(line.startswith("interrupted at step 2 of 6") for line in err)
    else:
        assert err[-1] == "interrupted" and saved == 1  # the fresh run's first step only



def test_ctrl_c_during_setup_says_the_run_stops_before_its_first_step(tmp_path, monkeypatch, capfd):
    """A first Ctrl-C while the run sets up (data, compile) cannot stop "after this step": the line says the run
    stops once set up, before its first step, and it does, nothing saved, exit 130."""
    from mtpjax.train import setup

    real = setup.open_run

    def press_then_open(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(setup, "open_run", press_then_open)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cfg = tiny_cfg(tmp_path, "train.steps=6")
        rc = main(cli_args(cfg))
    finally:
        signal.signal(signal.SIGINT, outer)
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 130 and "interrupt: stopping once set up, before the first step (Ctrl-C again to stop at once)" in err
    assert err[-1] == "interrupted at step 0, before anything to save; run the same command again"
    assert Checkpointer(tmp_path / "run", cfg.checkpoint).latest_step() is None

@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.steps=100000", "checkpoint.every=5", "train.eval_every=100000")
    log = tmp_path / "train.log"
    proc = spawn(cli_args(cfg), log)
    ck = tmp_path / "run" / "checkpoints"
    assert wait_for(lambda: (ck / "5" / "commit_success.txt").exists(), proc), log.read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == 0, log.read_text()[-2000:]
    err = log.read_text()
    step = int(err.strip().splitlines()[-1].split("step ")[-1])
    assert step >= 5 and Checkpointer(tmp_path / "run", cfg.checkpoint).latest_step() == step
