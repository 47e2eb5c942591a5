"""Fault injection: kill -9, SIGTERM, corrupt checkpoints, NaN/inf, a full disk; no code runs on load.

The promise under test: a kill at any moment loses at most the steps since the last complete checkpoint,
never corrupts one, and a resumed run ends bit-identical to an uninterrupted one.
"""

import errno
import hashlib
import json
import random
import re
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench.soak import flip_bit
from train_helpers import HANG, cli_args, evaluated_at, spawn, tiny_cfg, wait_for, write_corpus

import mtpjax.train.step
from mtpjax.train.checkpoint import CheckpointError, load_model, load_model_step
from mtpjax.config import ConfigError, load_config, replace
from mtpjax.cli.train import main
from mtpjax.train.loop import NonFiniteError, train

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.eval_batches=0", "train.eval_every=1000", "checkpoint.every=2", "checkpoint.keep=3"]


# ----------------------------------------------------------------------------- helpers


def tree_hash(root: Path) -> dict:
    """Relative path -> sha256 of the bytes of every file under root ('dir' for directories)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(Path(root).rglob("*"))}


def ckpt_hash(run: Path, *steps: int) -> dict:
    """tree_hash of the given checkpoints of a run (each step's directory and everything in it)."""
    return {k: v for k, v in tree_hash(run / "checkpoints").items() if k.split("/")[0] in map(str, steps)}


def complete_steps(run: Path) -> list[int]:
    """Steps with a committed (renamed into place) checkpoint directory."""
    ck = run / "checkpoints"
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) if ck.is_dir() else []


def assert_same_params(run_a: Path, run_b: Path, step: int | None = None) -> None:
    _, ma, _ = load_model(run_a, step)
    _, mb, _ = load_model(run_b, step)
    for a, b in zip(jax.tree.leaves(ma), jax.tree.leaves(mb), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def resumed_from(log: Path) -> int | None:
    m = re.findall(r"resuming from checkpoint (\d+)", log.read_text())
    return int(m[-1]) if m else None


# ----------------------------------------------------------------------------- kill -9 and SIGTERM


def _big_corpus(tmp: Path) -> Path:
    """~2 MB of text, so that corpus preparation lasts long enough to be killed in the middle."""
    small = write_corpus(tmp).read_text()
    path = tmp / "big.txt"
    path.write_text("\n".join(f"# copy {i}\n{small}" for i in range(32)))
    return path


@pytest.mark.slow
def test_kill9_anywhere_resumes_from_last_complete_checkpoint_and_ends_identical(tmp_path):
    """SIGKILL during data preparation, async checkpoint saves, steps and at random times; then run to the end."""
    corpus = _big_corpus(tmp_path)
    over = [*FAST, "train.steps=32"]
    t0 = time.time()
    ref = train(tiny_cfg(tmp_path, *over, corpus=corpus, run="ref"))
    ref_secs = time.time() - t0  # a whole run in-process: the random kill lands inside a run of that length
    cfg = tiny_cfg(tmp_path, *over, f"data.cache_dir={tmp_path / 'cache-kill'}", corpus=corpus, run="kill")
    args, run, cache = cli_args(cfg), tmp_path / "kill", tmp_path / "cache-kill"
    ck = run / "checkpoints"
    rng = random.Random(0)
    in_prep = lambda: cache.is_dir() and any(p.name.startswith(".tmp-") for p in cache.iterdir())
    in_save = lambda: ck.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in ck.iterdir())
    # the random kill comes second, while nearly the whole run (prep included) is still ahead of it
    phases = ["prep", "random", "save", "step", "save"]
    caught, retries = [], 4
    for i, phase in enumerate(phases):  # grows: a save the kill missed is aimed at again
        before = complete_steps(run)
        log = tmp_path / f"kill{i}.log"
        proc = spawn(args, log)
        if phase == "prep":
            assert wait_for(in_prep, proc), log.read_text()[-2000:]
        elif phase == "save":
            assert wait_for(lambda b=before: in_save() and complete_steps(run) != b, proc), log.read_text()[-2000:]
        elif phase == "step":
            assert wait_for(lambda b=before: complete_steps(run) != b, proc), log.read_text()[-2000:]
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            wait_for(lambda: False, proc, timeout=rng.uniform(0.2, 0.8) * ref_secs)
        assert proc.poll() is None, f"phase {phase}: the run ended before the kill"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        caught.append((phase, in_prep() if phase == "prep" else in_save() if phase == "save" else None))
        half = next(ck.glob("*.orbax-checkpoint-tmp"), None) if phase == "save" else None
        if half is not None:  # the half-written checkpoint is invisible to load_model
            with pytest.raises(CheckpointError, match="no checkpoint at step"):
                load_model(run, step=int(half.name.split(".")[0]))
        elif phase == "save" and retries:  # the save finished between seeing it and the kill landing: aim again
            retries -= 1
            phases.append("save")
        if i:  # every re-run resumed from the newest complete checkpoint present when it started
            assert resumed_from(log) == (max(before) if before else None), (phase, log.read_text()[-2000:])
    assert ("prep", True) in caught and ("save", True) in caught, caught  # the kills hit what they aimed at
    final_log, last = tmp_path / "final.log", max(complete_steps(run))
    proc = spawn(args, final_log)
    assert proc.wait(timeout=600) == 0, final_log.read_text()[-3000:]
    assert resumed_from(final_log) == last, final_log.read_text()[-2000:]
    assert complete_steps(run)[-1] == 32 and ref["step"] == 32
    assert_same_params(tmp_path / "ref", run)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_exits_0_and_the_rerun_continues_there(tmp_path):
    # an eval every 3 steps shows progress on disk; past the first step's, regular checkpoints come at step 1000
    cfg = tiny_cfg(tmp_path, *FAST, "train.steps=100000", "checkpoint.every=1000", "train.eval_every=3",
                   "train.eval_batches=1", "train.num_samples=0")
    log = tmp_path / "term.log"
    proc = spawn(cli_args(cfg), log)
    run = tmp_path / "run"
    assert wait_for(lambda: evaluated_at(run, 3), proc), log.read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == 0, log.read_text()[-2000:]
    step = int(re.search(r"preempted: checkpoint saved at step (\d+)", log.read_text())[1])
    assert step >= 3 and complete_steps(run)[-1] == step  # the stop's own save: no regular one is due
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
    out = train(tiny_cfg(tmp_path, *FAST, f"train.steps={step + 2}", "checkpoint.every=1000"))
    assert [s for s, _ in out["history"]] == [step + 1, step + 2]


# ----------------------------------------------------------------------------- corrupt checkpoints


def _copy_run(tiny_run, tmp: Path, name: str):
    cfg, run = tiny_run
    dst = tmp / name
    shutil.copytree(run, dst)
    return replace(cfg, [f"train.run_dir={dst}"]), dst


def _largest_file(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


CORRUPTIONS = {  # name: (damage, whether the model arrays (all load_model reads) are hit)
    "truncated array data": (lambda d: _largest_file(d / "model").open("r+b").truncate(100), True),
    "garbled array metadata": (lambda d: (d / "model" / "_METADATA").write_bytes(b"\x00garbage{"), True),
    "garbled data-iterator state": (lambda d: next((d / "data").glob("*")).write_text("{not json"), False),
    "missing optimizer state": (lambda d: shutil.rmtree(d / "train"), False),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tiny_run, tmp_path, capsys, kind):
    cfg, run = _copy_run(tiny_run, tmp_path, "run")
    damage, hits_model = CORRUPTIONS[kind]
    damage(run / "checkpoints" / "7")
    capsys.readouterr()
    _, model, _ = load_model(run)  # read-only: warns and falls back if it must, moves nothing
    err = capsys.readouterr().err
    assert ("warning:" in err and "checkpoint 7" in err) == hits_model, err
    assert complete_steps(run) == [4, 6, 7]
    _, expect, _ = load_model(tiny_run[1], step=6 if hits_model else 7)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(expect), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if hits_model:
        with pytest.raises(CheckpointError, match="checkpoint 7"):  # asked for explicitly: no silent substitute
            load_model(run, step=7)
    good = tree_hash(run / "checkpoints" / "6")
    capsys.readouterr()
    out = train(cfg)
    err = capsys.readouterr().err
    assert "checkpoint 7" in err and "resuming from checkpoint 6" in err, err
    assert [s for s, _ in out["history"]] == [7]
    moved = list((run / "checkpoints-corrupt").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("7-")  # kept for inspection, never deleted
    assert complete_steps(run) == [4, 6, 7] and tree_hash(run / "checkpoints" / "6") == good
    assert_same_params(run, tiny_run[1], step=7)  # the re-done step 7 equals the original one


def test_no_readable_checkpoint_is_an_error_not_a_silent_restart(tiny_run, tmp_path, capsys):
    cfg, run = _copy_run(tiny_run, tmp_path, "run")
    for s in (4, 6, 7):
        CORRUPTIONS["truncated array data"][0](run / "checkpoints" / str(s))
    before = tree_hash(run)
    with pytest.raises(CheckpointError, match="none of the checkpoints"):
        train(cfg)
    after = tree_hash(run)
    assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints")}
    with pytest.raises(CheckpointError, match="no checkpoint of run .* is readable"):
        load_model(run)


def shift_data_position(step_dir: Path) -> None:
    """The checkpoint's data position moved one batch on (still valid JSON)."""
    path = step_dir / "data" / "metadata"
    state = json.loads(path.read_text())
    state["batch"] += 1
    path.write_text(json.dumps(state))


TAMPERING = {  # what is changed in checkpoint 7 -> (damage, what the one line names)
    "a parameter": (lambda d: flip_bit(d, "model", "embed"), "array model.embed "),
    "an optimizer moment": (lambda d: flip_bit(d, "train", "opt.inner_state.1.0.mu.embed"),
                            "array train.opt.inner_state.1.0.mu.embed "),
    "the data position": (shift_data_position, "the data position (data) "),
}


def _restore_latest(cfg, run: Path, *overrides: str):
    from mtpjax.parallel.sharding import make_mesh
    from mtpjax.train.checkpoint import Checkpointer
    from mtpjax.train.step import make_programs

    cfg = replace(cfg, list(overrides))
    ck = Checkpointer(run, cfg.checkpoint)
    try:
        return ck.restore_latest(make_programs(cfg, make_mesh(cfg.mesh)).target)
    finally:
        ck.close()


@pytest.mark.parametrize("kind", list(TAMPERING))
def test_a_changed_byte_that_still_reads_is_caught_and_the_previous_checkpoint_used(tiny_run, tmp_path, capsys, kind):
    cfg, run = _copy_run(tiny_run, tmp_path, "run")
    damage, named = TAMPERING[kind]
    damage(run / "checkpoints" / "7")
    # load_model reads the model item only: it falls back when a parameter changed
    assert load_model_step(run)[3] == (6 if kind == "a parameter" else 7)
    capsys.readouterr()
    step, state, data_state, _ = _restore_latest(cfg, run)
    err = [ln for ln in capsys.readouterr().err.splitlines() if "checkpoint 7" in ln]
    assert step == 6 and "does not match its xxh3-128 digest" in err[0] and named in err[0], err
    moved = list((run / "checkpoints-corrupt").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("7-") and complete_steps(run) == [4, 6]
    _, model6, _ = load_model(tiny_run[1], step=6)
    np.testing.assert_array_equal(np.asarray(state.params["embed"][...]), np.asarray(model6.embed[...]))


@pytest.mark.parametrize("kind", list(TAMPERING))
def test_companion_without_verification_the_changed_checkpoint_loads_silently(tiny_run, tmp_path, capsys, kind):
    """checkpoint.verify=false: the same damage restores step 7 without a word, the change carried into training."""
    cfg, run = _copy_run(tiny_run, tmp_path, "run")
    damage, _ = TAMPERING[kind]
    damage(run / "checkpoints" / "7")
    capsys.readouterr()
    step, state, data_state, _ = _restore_latest(cfg, run, "checkpoint.verify=false")
    assert step == 7 and "warning" not in capsys.readouterr().err
    _, clean, clean_data, _ = _restore_latest(tiny_run[0], tiny_run[1])
    differs = [not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(clean), strict=True)]
    assert sum(differs) == (0 if kind == "the data position" else 1)
    assert (data_state != clean_data) == (kind == "the data position")


# ----------------------------------------------------------------------------- NaN / inf


@jax.custom_vjp
def _nan_grad(x, hit):
    return x


_nan_grad.defvjp(lambda x, hit: (x, hit), lambda hit, g: (jnp.where(hit, jnp.nan, g), None))


POISONED = (5, 6, 7)  # NaN gradients (finite loss) in the updates producing steps 6, 7 and 8


def _poison(monkeypatch):
    """NaN gradients at the POISONED step counters; one program for every NaN test (compiled once)."""
    real = mtpjax.train.step.mtp_loss

    def poisoned(*args, step, **kw):
        loss, met = real(*args, step=step, **kw)
        return _nan_grad(loss, jnp.isin(step, jnp.asarray(POISONED))), met

    monkeypatch.setattr(mtpjax.train.step, "mtp_loss", poisoned)


@pytest.fixture
def at_step_4(tiny_run, tmp_path):
    """A copy of the shared run cut back to checkpoint 4 (as if it had been stopped at step 4)."""
    cfg, run = _copy_run(tiny_run, tmp_path, "run")
    for s in (6, 7):
        shutil.rmtree(run / "checkpoints" / str(s))
    return cfg, run


@pytest.mark.slow
def test_nan_stop_policy_keeps_the_last_good_checkpoint_untouched(at_step_4, monkeypatch):
    cfg, run = at_step_4
    before = tree_hash(run / "checkpoints")
    _poison(monkeypatch)  # the first bad update produces step 6, a checkpoint step
    with pytest.raises(NonFiniteError, match="step 6.*nan_policy=stop"):
        train(replace(cfg, ["train.steps=9"]))  # the NaN tests share one program: the same step count
    assert tree_hash(run / "checkpoints") == before  # no checkpoint of the bad step, nothing rewritten
    monkeypatch.undo()
    assert [s for s, _ in train(cfg)["history"]] == [5, 6, 7]


def test_nan_skip_policy_skips_up_to_the_limit(at_step_4, monkeypatch):
    cfg, run = at_step_4
    _poison(monkeypatch)
    out = train(replace(cfg, ["train.nan_policy=skip", "train.max_skipped_steps=3", "train.steps=9"]))
    assert out["skipped_steps"] == 3 and [s for s, _ in out["history"]] == [5, 9]
    assert complete_steps(run) == [6, 8, 9]
    _, m6, _ = load_model(run, step=6)
    _, m8, _ = load_model(run, step=8)  # the updates to steps 7 and 8 were skipped: the parameters did not move
    for a, b in zip(jax.tree.leaves(m6), jax.tree.leaves(m8), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(m8))
    _, m9, _ = load_model(run, step=9)  # and the next good update moved them again
    assert not np.array_equal(np.asarray(m8.embed[...]), np.asarray(m9.embed[...]))


def test_nan_skip_policy_stops_past_the_limit(at_step_4, monkeypatch):
    cfg, run = at_step_4
    before = ckpt_hash(run, 4)
    _poison(monkeypatch)
    with pytest.raises(NonFiniteError, match="step 8.*max_skipped_steps=2"):
        train(replace(cfg, ["train.nan_policy=skip", "train.max_skipped_steps=2", "train.steps=9"]))
    assert ckpt_hash(run, 4) == before
    assert complete_steps(run) == [4, 6]  # step 6 (one skip, within the limit) was still a good state


def test_nan_skip_policy_counts_the_skips_before_a_restart(at_step_4, monkeypatch):
    """Stopped at step 7 after 2 skips, the resumed run stops at the third (step 8) as an uninterrupted one does; it
    did not when the count restarted at 0 with the process."""
    cfg, run = at_step_4
    _poison(monkeypatch)
    cfg = replace(cfg, ["train.nan_policy=skip", "train.max_skipped_steps=2", "train.steps=9"])
    assert train(cfg, max_steps=7)["skipped_steps"] == 2 and complete_steps(run) == [4, 6, 7]
    with pytest.raises(NonFiniteError, match="step 8.*3 updates skipped > train.max_skipped_steps=2"):
        train(cfg)
    assert complete_steps(run) == [4, 6, 7]


# ----------------------------------------------------------------------------- a full disk


def _full_disk_at(monkeypatch, step: int) -> None:
    """Committing checkpoint `step` fails as a full disk does (its data is already in the temporary directory)."""
    from orbax.checkpoint._src.path import atomicity

    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def full(self, *a, **kw):
        if self.get_final().name == str(step):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, *a, **kw)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", full)


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_during_a_save_is_a_clear_error_and_keeps_the_previous_checkpoint(at_step_4, monkeypatch, capsys,
                                                                                     async_save):
    cfg, run = at_step_4
    _full_disk_at(monkeypatch, 6)
    before = tree_hash(run / "checkpoints")
    capsys.readouterr()
    assert main(cli_args(cfg, f"checkpoint.async_save={str(async_save).lower()}", "train.steps=8")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: saving a checkpoint") and "No space left on device" in err[-1], err
    assert ckpt_hash(run, 4) == before
    assert complete_steps(run) == [4]
    monkeypatch.undo()
    out = train(cfg)  # the failed save's temporary directory is never taken for a checkpoint
    assert [s for s, _ in out["history"]] == [5, 6, 7] and complete_steps(run) == [4, 6, 7]


def test_a_last_asynchronous_save_that_fails_is_reported_when_the_run_waits_for_it(at_step_4, monkeypatch, capsys):
    """No later save reports it: the run's final wait for the background save does, and exits 2."""
    cfg, run = at_step_4
    _full_disk_at(monkeypatch, 6)
    capsys.readouterr()
    assert main(cli_args(cfg, "checkpoint.async_save=true", "train.steps=6")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: saving a checkpoint") and "No space left on device" in err[-1], err
    assert complete_steps(run) == [4]


# ----------------------------------------------------------------------------- nothing executes code on load


def test_no_pickle_or_unsafe_yaml_in_the_package():
    import yaml

    from mtpjax.config import load

    # yaml.load is allowed with config's own loader only, a SafeLoader (no python tags) that keeps 10:15 a string
    assert issubclass(load._Loader, yaml.SafeLoader)
    bad = re.compile(r"\bpickle\b|\bdill\b|\bcloudpickle\b|yaml\.load\((?![^)]*Loader=_Loader\))|yaml\.unsafe_load|"
                     r"yaml\.Loader|allow_pickle\s*=\s*True|\beval\(|\bexec\(|torch\.load")
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for p in [*(REPO / "mtpjax").rglob("*.py"), REPO / "train.py", REPO / "decode.py"]
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []


def test_yaml_with_a_python_tag_is_refused(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"train:\n  steps: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=r"^config file '.*evil.yaml' uses a YAML tag that safe loading refuses "
                                          r"\(line 2\): could not determine a constructor for the tag "
                                          r"'tag:yaml.org,2002:python/object/apply:os.system'; write plain values$"):
        load_config(evil)
    assert main(["--config", str(evil)]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not marker.exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"model: !!python/object/new:os.system ['touch {marker}']\n")
    from mtpjax.train.checkpoint import read_run_config

    with pytest.raises(CheckpointError, match="not a valid config"):
        read_run_config(run)
    assert not marker.exists()
