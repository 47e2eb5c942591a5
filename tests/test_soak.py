"""A pod's reliability, small: a process killed in a 2-process run stops the other, naming it; a run interrupted
by SIGTERM and kill -9 at seeded moments, resumed alternately on 1 and 2 processes, with a corrupted latest
checkpoint once, ends bit-identical to a straight run (bench/soak.py; docs/reliability.md)."""

import shutil
from pathlib import Path

import pytest

from bench import soak

# seed 1: SIGTERM on 1 process after a commit, kill -9 of process 1 of 2 after a commit (then the corrupted checkpoint),
# kill -9 on 1 process during a save; the final segment on 2 processes
STEPS, SEED, INTERRUPTIONS, HEARTBEAT = 20, 1, 3, 10


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    """(tmp, events, final exit codes) of a soak of STEPS steps beside its straight run (tmp/straight)."""
    tmp = tmp_path_factory.mktemp("soak")
    corpus = soak.write_corpus(tmp)
    assert soak.wait_all(soak.launch(soak.soak_overrides(tmp, corpus, "straight", STEPS), 1, tmp / "straight")) == [0]
    events, final = soak.soak(soak.soak_overrides(tmp, corpus, "soak", STEPS), tmp / "soak", tmp / "logs",
                              INTERRUPTIONS, SEED, heartbeat=HEARTBEAT)
    return tmp, events, final


@pytest.mark.slow
@pytest.mark.as_users_compile  # every segment, the straight run and the companion compile alike
def test_a_killed_process_stops_the_other_which_names_it_and_commits_nothing_partial(soaked):
    tmp, events, _ = soaked
    [k] = [(i, e) for i, e in enumerate(events) if e.kind == "kill9" and e.procs == 2]
    i, ev = k
    assert ev.victim == 1 and ev.exit_codes[1] == -9 and ev.exit_codes[0] == 75, ev
    errors = [ln for ln in (tmp / "logs" / f"seg{i}-p0.log").read_text().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: process 1 of 2 was lost (no heartbeat for {HEARTBEAT} s")
    # every committed checkpoint is whole: each process that wrote arrays wrote its digests (orbax commits a save
    # only once every process has written its part)
    for step in soak.committed(tmp / "soak"):
        d = tmp / "soak" / "checkpoints" / str(step)
        writers = len(list((d / "model").glob("ocdbt.process_*")))
        assert len(list((d / "digests").glob("process_*.json"))) == writers >= 1, step


@pytest.mark.slow
@pytest.mark.as_users_compile
def test_the_soak_ends_bit_identical_to_a_straight_run(soaked):
    tmp, events, final = soaked
    assert len(events) == INTERRUPTIONS and final == [0] * (1 if INTERRUPTIONS % 2 == 0 else 2)
    assert {(e.kind, e.procs) for e in events} == {("sigterm", 1), ("kill9", 1), ("kill9", 2)}
    assert {e.moment for e in events} == {"committed", "saving"}
    for i, e in enumerate(events):  # SIGTERM: every process checkpoints one step and exits 0
        assert e.kind == "kill9" or e.exit_codes == [0] * e.procs, (i, e)
    [bad] = [(i, e.corrupted) for i, e in enumerate(events) if e.corrupted is not None]
    after = (tmp / "logs" / f"seg{bad[0] + 1}-p0.log").read_text()
    assert f"warning: checkpoint {bad[1]} in" in after and "does not match its xxh3-128 digest" in after
    got = soak.compare(tmp / "straight", tmp / "soak")
    assert got["steps"] == [STEPS, STEPS] and got["model_bitwise"] and got["train_bitwise"], got
    assert got["data_position_equal"] and got["eval_loss"][0] == got["eval_loss"][1], got
    assert got["logged_steps_once"] and got["loss_max_abs_diff"] == 0.0, got  # every step's loss, logged once


@pytest.mark.slow
@pytest.mark.as_users_compile
def test_companion_a_resume_that_skips_the_data_position_ends_elsewhere(soaked):
    """The straight run cut back to its checkpoint at step STEPS - 4 and resumed on 1 process by a train.py that does
    not restore the data position: the same comparison fails."""
    tmp, _, _ = soaked
    shutil.copytree(tmp / "straight", tmp / "skip")
    for step in soak.committed(tmp / "skip"):
        if step > STEPS - 4:
            shutil.rmtree(tmp / "skip" / "checkpoints" / str(step))
    (tmp / "skip" / "eval.jsonl").unlink()
    overrides = soak.soak_overrides(tmp, soak.write_corpus(tmp), "skip", STEPS)
    procs = soak.launch(overrides, 1, tmp / "skip", script=Path(__file__).parent / "skip_data_position.py")
    assert soak.wait_all(procs) == [0]
    assert f"resuming from checkpoint {STEPS - 4}" in (tmp / "skip-p0.log").read_text()
    got = soak.compare(tmp / "straight", tmp / "skip")
    assert not got["data_position_equal"] and not got["model_bitwise"], got
