"""decode.py's manners: it echoes the prompt, says what ran (`plain` for 0 drafts), shows progress while it
calibrates (and evaluates: test_decode), and a first `--num-draft auto` calibration compiles only the loops the
run reuses."""


import json
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
from mtpjax.decode import api, autodraft
from mtpjax.eval import verdict
from mtpjax.cli.decode import _Streamer, label, main
from mtpjax.decode.loop import execute
from mtpjax.drafts import chain, parse


def T(c):
    """A candidate as these tests spell it: a chain's γ, or a tree's shape."""
    return chain(c) if isinstance(c, int) else parse(c)


def _cal(choice, round_cost: dict, expected_tokens: dict, pruned=(), **kw) -> autodraft.Calibration:
    """A Calibration from candidates spelled as T reads them."""
    return autodraft.Calibration(choice=T(choice), round_cost={T(c): v for c, v in round_cost.items()},
                                 expected_tokens={T(c): v for c, v in expected_tokens.items()},
                                 pruned=[T(c) for c in pruned], **kw)


def _argv(run, *extra):
    return ["--run-dir", str(run), "--prompt", "def f(x):", "--max-new-tokens", "8", *extra]


def test_the_prompt_is_echoed_before_the_continuation(tiny_run, capsys):
    _, run = tiny_run
    assert main(_argv(run, "--num-draft", "1")) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and len(out) > len("def f(x):\n")


def _stream(text: str, ends: bytes = b"", progress: bool = False) -> str:
    """What a _Streamer prints for `text` then the bytes `ends` committed one byte token a round."""
    import numpy as np

    from mtpjax.data import ByteTokenizer

    out = _Streamer(ByteTokenizer(), "p:", True)
    for b in text.encode() + ends:
        out.on_commit(np.array([[b]]), np.array([1]))
    if progress:
        out.progress("auto: timing")
    out.finish()
    return out.text()


def test_a_character_split_across_rounds_streams_once_whole(capsys):
    """A round ending inside a multi-byte character holds it back (its text ends in U+FFFD), and streaming goes on:
    the streamed text is the final text, a partial character at the very end included."""
    from mtpjax.data import ByteTokenizer

    assert ByteTokenizer().decode(list("é".encode())[:1]) == "\ufffd"  # what a round ending inside é decodes to
    assert _stream("é and more text") == "p:é and more text" and capsys.readouterr().out == "p:é and more text\n"
    assert _stream("ab", "é".encode()[:1]) == "p:ab\ufffd" and capsys.readouterr().out == "p:ab\ufffd\n"
    # a measurement after the output starts its own line once the held-back text is out
    _stream("ab", "é".encode()[:1], progress=True)
    assert capsys.readouterr().out == "p:ab\ufffd\n"


def test_prompts_file_prints_each_prompt_with_its_continuation(tiny_run, capsys, tmp_path):
    _, run = tiny_run
    f = tmp_path / "p.txt"
    f.write_text("import os\nclass A:\n")
    assert main(["--run-dir", str(run), "--prompts-file", str(f), "--max-new-tokens", "4", "--num-draft", "0"]) == 0
    out = capsys.readouterr().out
    assert "### 'import os'\nimport os" in out and "### 'class A:'\nclass A:" in out


def test_the_label_says_what_ran(tiny_run, capsys):
    assert label("mtp", 0) == "plain" and label("ngram", 0) == "plain" and label("mtp", 2) == "mtp draft=2"
    _, run = tiny_run
    assert main(_argv(run, "--num-draft", "0", "--stats")) == 0
    err = capsys.readouterr().err
    assert "[plain] rounds=" in err and "draft=0" not in err and "acceptance=" not in err
    assert main(_argv(run, "--num-draft", "2", "--stats")) == 0
    assert "[mtp draft=2] rounds=" in capsys.readouterr().err


def test_auto_choosing_no_drafts_is_labelled_plain(tiny_run, capsys, monkeypatch, tmp_path):
    """When the calibration picks 0 drafts, the stats say `plain` and why, not `[mtp draft=0]`."""
    _, run = tiny_run
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", lambda *a, **k: _cal(
        0, {0: 1.0, 1: 2.5, 2: 3.4}, {0: 1.0, 1: 1.5, 2: 1.6}, alpha_by_position=[0.5, 0.2], seconds=0.5))
    assert main(_argv(run, "--stats", "--recalibrate")) == 0
    err = capsys.readouterr().err
    assert "[plain] rounds=" in err and "[mtp draft=0]" not in err
    assert "-> next time plain (no draft count or tree was predicted to beat plain decoding" in err
    assert main(_argv(run, "--stats")) == 0  # the saved measurement: plain again, and the stats say so
    err = capsys.readouterr().err
    assert "[plain] rounds=" in err and "-> plain (no draft count" in err and "measurement saved in" in err


def _fake_calibration(*a, progress=None, **k):
    progress("auto: timing")
    return _cal(2, {0: 1.0, 1: 1.1, 2: 1.2}, {0: 1.0, 1: 1.9, 2: 2.7}, alpha_by_position=[0.9, 0.9], seconds=0.5)


def test_a_new_request_shape_decodes_plain_then_measures(tiny_run, capsys, monkeypatch, tmp_path):
    """decode.py never waits on a probe before the output: plain first, measured after (with a progress line),
    and the next request of that shape runs what was measured."""
    _, run = tiny_run
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    assert main(_argv(run, "--stats")) == 0
    first = capsys.readouterr()
    assert first.out.startswith("def f(x):") and first.out.endswith("\n")
    assert "[plain] rounds=" in first.err
    assert "no measurement for this request shape yet, so it decoded plain" in first.err
    assert first.err.index("auto: timing") < first.err.index("[plain]")
    assert "-> next time mtp draft=2" in first.err
    assert main(_argv(run, "--stats")) == 0
    again = capsys.readouterr()
    assert again.out == first.out  # greedy: the same text whichever ran
    assert "[mtp draft=2] rounds=" in again.err and "auto: timing" not in again.err


def test_a_tree_chosen_by_auto_is_named_and_runs_next(tiny_run, capsys, monkeypatch, tmp_path):
    """When the calibration picks a tree, --stats names its shape (measured and saved), the next request of that
    shape runs the tree and says so, and the greedy text is plain's; companion: a chain's choice reads as a chain."""
    _, run = tiny_run
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    cost, tokens = {0: 1.0, 1: 1.3, 2: 1.6, "2x1": 1.5, "2x2": 1.5}, {0: 1.0, 1: 1.6, 2: 1.9, "2x1": 2.4, "2x2": 2.55}
    monkeypatch.setattr(autodraft, "calibrate", lambda *a, **k: _cal(
        "2x2", cost, tokens, pruned=[1, 2], alpha_by_position=[0.6, 0.5], seconds=0.5))
    assert main(_argv(run, "--stats")) == 0
    first = capsys.readouterr()
    assert "[plain] rounds=" in first.err and "-> next time mtp draft=2x2" in first.err
    assert "2x2: 1.50}" in first.err and "(timed in the first pass only: 1, 2)" in first.err
    assert main(_argv(run, "--stats")) == 0
    again = capsys.readouterr()
    assert again.out == first.out  # greedy: plain's text whichever ran
    assert "[mtp draft=2x2 (6 nodes)] rounds=" in again.err and "-> mtp draft=2x2 (measurement saved in" in again.err
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    assert main(_argv(run, "--stats", "--recalibrate")) == 0
    assert "-> next time mtp draft=2" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["my notes\n", '{"theme": "dark"}\n', "[1, 2]"])
def test_a_calibration_file_holding_something_else_is_refused_and_left_as_it_is(tiny_run, tmp_path, capsys, text):
    """--calibration-file naming a user's file: one line before anything is echoed (it was overwritten)."""
    f = tmp_path / "notes.txt"
    f.write_text(text)
    assert main(_argv(tiny_run[1], "--calibration-file", str(f))) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"error: calibration file '{f}' holds something other than mtpjax's decode "
                                         "calibrations (left as it is); give another path (decode.py "
                                         "--calibration-file) or remove it\n")
    assert f.read_text() == text
    assert main(_argv(tiny_run[1], "--calibration-file", str(tmp_path))) == 2  # a directory cannot be told apart
    assert capsys.readouterr().err.startswith(f"error: calibration file '{tmp_path}' cannot be read ([Errno 21]")


def test_a_calibration_file_that_is_a_pipe_or_device_is_refused_and_left_as_it_is(tiny_run, tmp_path, capsys,
                                                                                     monkeypatch):
    """A pipe (or a device: /dev/null) is neither read nor replaced: a pipe's read may never end, and a save replaced
    the node with a file (as root, /dev/null). Here a writer opens and closes the pipe until told to stop, so each
    unfixed read got '' (not a hang) and the save replaced the pipe."""
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    fifo, stop = tmp_path / "cal.fifo", threading.Event()
    os.mkfifo(fifo)

    def writer():
        while not stop.is_set() and stat.S_ISFIFO(fifo.stat().st_mode):
            open(fifo, "w").close()  # noqa: SIM115 - blocks until a reader opens it

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        assert main(_argv(tiny_run[1], "--calibration-file", str(fifo))) == 2
        assert capsys.readouterr().err == (f"error: calibration file '{fifo}' is not a regular file (left as it is); "
                                           "give another path (decode.py --calibration-file)\n")
        assert stat.S_ISFIFO(fifo.stat().st_mode)
    finally:
        stop.set()
        if stat.S_ISFIFO(fifo.stat().st_mode):
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # a reader, so the writer's open returns
        t.join()


def test_companion_an_empty_or_damaged_calibration_file_is_rebuilt(tiny_run, tmp_path, capsys, monkeypatch):
    """mtpjax's own file cut short (or an empty one) counts as empty: measured again, rebuilt, then read back."""
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    f = tmp_path / "cal.json"
    for text in ("", '{\n "cpu || /runs/tiny step 7 || (1, 16'):
        f.write_text(text)
        assert main(_argv(tiny_run[1], "--calibration-file", str(f), "--stats")) == 0
        assert "-> next time mtp draft=2" in capsys.readouterr().err and len(json.loads(f.read_text())) == 1
    assert main(_argv(tiny_run[1], "--calibration-file", str(f), "--stats")) == 0
    assert f"measurement saved in {f}" in capsys.readouterr().err


@pytest.mark.slow
def test_calibration_compiles_only_the_loops_the_run_reuses(tiny_run):
    """`draft="auto"` compiles each candidate's loop once; the real runs add no compilation."""
    from mtpjax.train.checkpoint import load_model

    _, run = tiny_run
    _, model, tok = load_model(run)
    prompts = [tok.encode("import os")]
    kw = dict(max_new_tokens=19, seed=3, eos_id=tok.eos_id)  # a request shape no other test compiles
    # decode.py's order: plain first, then the probe, which reuses the plain loop and compiles the others once
    before = execute._cache_size()
    res = api.generate(model, prompts, draft="auto", plain_first=True, on_commit=lambda *_: None, **kw)
    assert res.stats["drafts"] == 0 and res.stats["calibration"]["source"] == "after"
    assert execute._cache_size() - before == len(autodraft.candidates(model, "mtp")) == 5  # 0, 1, 2, 2x1, 2x2
    again = api.generate(model, prompts, draft="auto", plain_first=True, on_commit=lambda *_: None, **kw)
    assert again.stats["draft"] == res.stats["calibration"]["draft"]  # remembered...
    assert execute._cache_size() - before == 5  # ...and already compiled
    # the counter does count: a request of another shape compiles its loop
    mid = execute._cache_size()
    api.generate(model, prompts, draft=1, **{**kw, "max_new_tokens": 21})
    assert execute._cache_size() - mid == 1


def test_auto_never_picks_drafts_within_the_noise_of_plain():
    """A draft count predicted less than MARGIN faster than plain is not worth the risk: plain is chosen."""
    from mtpjax.nn.speed import by_position, choose_fastest, expected_tokens

    def pick(alpha, cost: dict, margin=autodraft.MARGIN) -> int:
        trees = {T(g): c for g, c in cost.items()}
        return choose_fastest({t: expected_tokens(t, by_position(alpha)) for t in trees}, trees, margin).size

    alpha = [0.5]
    assert 1.0 < expected_tokens(T(1), by_position(alpha)) / 1.45 < autodraft.MARGIN  # 1.5 / 1.45 = 1.03
    assert pick(alpha, {0: 1.0, 1: 1.45}, margin=1.0) == 1  # the bare cost model would take the noise
    assert pick(alpha, {0: 1.0, 1: 1.45}) == 0
    assert pick(alpha, {0: 1.0, 1: 1.2}) == 1  # a clear win (1.25) is taken
    assert pick([], {0: 1.0}) == 0


def test_a_refused_request_echoes_nothing_and_restores_quietly(tiny_run, capfd, caplog):
    """The request is checked before the prompt is echoed; reading the run logs no read-only notice."""
    _, run = tiny_run
    for flag in (["--top-p", "1.5"], ["--temperature", "-1"]):
        assert main(["--run-dir", str(run), "--prompt", "def f():", *flag]) == 2
        out = capfd.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1 and out.err.startswith("error: "), out
    from mtpjax import load_model

    with caplog.at_level(logging.INFO, logger="absl"):  # decode.py quiets absl for the whole process
        load_model(run)
    assert not [r for r in caplog.records if "read only" in r.getMessage()]


def test_companion_orbax_logs_its_read_only_notice_unfiltered(tiny_run, caplog, monkeypatch):
    from mtpjax.train import checkpoint

    monkeypatch.setattr(checkpoint, "_READ_ONLY_NOTICE", "a message orbax never logs")
    with caplog.at_level(logging.INFO, logger="absl"):
        checkpoint.load_model(tiny_run[1])
    assert [r for r in caplog.records if "read only" in r.getMessage()]


def _with_agreement(tiny_run, tmp_path, agreement: list[float]) -> Path:
    """A copy of the tiny run whose eval.jsonl logged `agreement` at its last step."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run[1], run)
    rec = {"step": 7, **{f"agreement/mtp_{k}": a for k, a in enumerate(agreement, start=1)}}
    (run / "eval.jsonl").write_text(json.dumps(rec) + "\n")
    return run


def _first_call(run, monkeypatch, tmp_path, capsys) -> str:
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autodraft, "calibrate", lambda *a, **k: _cal(
        0, {0: 1.0, 1: 1.9, 2: 2.8}, {0: 1.0, 1: 1.6, 2: 1.84}, alpha_by_position=[0.6, 0.4], seconds=0.5))
    assert main(_argv(run, "--stats")) == 0
    return capsys.readouterr().err


def test_auto_s_first_call_drafts_as_the_estimate_from_training_s_agreement_says(tiny_run, monkeypatch, tmp_path,
                                                                                   capsys):
    """No measurement yet: the cost model on the run's agreement chooses (here 1 draft); the measurement after it
    says plain, and the stats line says why, from its own numbers."""
    err = _first_call(_with_agreement(tiny_run, tmp_path, [0.9, 0.8]), monkeypatch, tmp_path, capsys)
    assert "[mtp draft=1] rounds=" in err, err
    assert "so it ran mtp draft=1, the cost model's choice from training's agreement [0.9, 0.8]" in err
    assert "-> next time plain" in err
    assert "[why plain] a round of mtp draft=1 costs 1.90 plain steps for 1.60 tokens (0.84x): " in err
    assert "compute-bound" in err and verdict.DOCS in err


def test_companion_low_agreement_estimates_plain(tiny_run, monkeypatch, tmp_path, capsys):
    err = _first_call(_with_agreement(tiny_run, tmp_path, [0.02, 0.01]), monkeypatch, tmp_path, capsys)
    assert "[plain] rounds=" in err and "so it ran plain, the cost model's choice" in err, err


def _most_drafts(monkeypatch, n: int) -> None:
    """The mtp proposer's most_drafts is n (as a draft model k times smaller than its target drafts k)."""
    import dataclasses

    from mtpjax.decode.proposers import DRAFTERS

    monkeypatch.setitem(DRAFTERS, "mtp", dataclasses.replace(DRAFTERS["mtp"], most_drafts=lambda t, d: n))


def test_auto_probes_at_most_the_one_draft_limit(tiny_run, capsys, monkeypatch, tmp_path):
    """drafts.MAX_NODES is the one limit: auto's candidates stop there, and a default `--num-draft auto` whose
    candidates reach 32 decodes (the flag the user never gave is not refused)."""
    from mtpjax import load_model
    from mtpjax.drafts import MAX_NODES

    _, run = tiny_run
    model = load_model(run)[1]
    _most_drafts(monkeypatch, 100)
    assert max(t.size for t in autodraft.candidates(model, "mtp")) == MAX_NODES
    # long chains are probed sparsely (each probe is a compile): 13 chains, not 65
    chains = [t.size for t in autodraft.candidates(model, "mtp") if t.is_chain()]
    assert chains == [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert autodraft.chain_lengths(5) == [0, 1, 2, 3, 4, 5] and autodraft.chain_lengths(0) == [0]
    _most_drafts(monkeypatch, 32)
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    assert main(_argv(run, "--stats")) == 0, capsys.readouterr().err
    assert "[plain] rounds=" in capsys.readouterr().err


def test_n_gram_s_first_call_says_n_gram_gets_no_estimate(tiny_run, monkeypatch, tmp_path, capsys):
    """A run that logged agreement, decoding with n-gram lookup: plain first because n-gram lookup gets no estimate,
    not for want of agreement; companion: the MTP modules on a run without agreement say that."""
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    assert main(_argv(_with_agreement(tiny_run, tmp_path, [0.9, 0.8]), "--stats", "--proposer", "ngram")) == 0
    err = capsys.readouterr().err
    assert "so it decoded plain (n-gram lookup and a draft model get no estimate; only the MTP modules' drafts" in err
    assert "logged no agreement" not in err
    assert main(_argv(tiny_run[1], "--stats", "--proposer", "mtp", "--recalibrate")) == 0
    assert "so it decoded plain (the run logged no agreement to estimate from)" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", [["mesh.stage_layers=[3,1]"], ["mesh.stage_repeats=2", "train.micro_batches=2"]])
def test_a_staged_runs_schedule_does_not_refuse_the_stage_count_decoding_is_given(monkeypatch, schedule):
    """A run trained with an uneven split or a circular schedule decodes with mesh.stage=1 (what the one-device note
    tells it to pass), as it does without them."""
    import argparse
    import contextlib

    import mtpjax.train.checkpoint as checkpoint
    from mtpjax.cli.decode import _mesh
    from mtpjax.config import Config, replace

    saved = replace(Config(), ["model.n_layers=4", "model.scan_layers=true", "mesh.stage=2", *schedule])
    run = argparse.Namespace(newest_config=lambda step: saved)
    monkeypatch.setattr(checkpoint, "SavedRun", lambda run_dir: contextlib.nullcontext(run))
    args = argparse.Namespace(run_dir="RUN", step=None, mesh_overrides=["mesh.stage=1"])
    assert _mesh(args) is None  # one device here: decoded on one, not refused


@pytest.mark.parametrize("new", [1, 2])
def test_auto_runs_plain_unmeasured_where_no_draft_can_save_a_round(tiny_run, capsys, monkeypatch, tmp_path, new):
    """The prompt gives the first token and one round the second: for 1 or 2 new tokens auto decodes plain and
    compiles no candidate to measure (a probe would cost seconds and could only say so)."""
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", lambda *a, **k: pytest.fail("measured a request no draft can speed"))
    argv = ["--run-dir", str(tiny_run[1]), "--prompt", "def f(x):", "--max-new-tokens", str(new), "--stats"]
    assert main(argv) == 0
    assert f"[plain] rounds={new - 1} " in capsys.readouterr().err


def test_companion_auto_measures_from_three_new_tokens(tiny_run, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", _fake_calibration)
    argv = ["--run-dir", str(tiny_run[1]), "--prompt", "def f(x):", "--max-new-tokens", "3", "--stats"]
    assert main(argv) == 0
    assert "[auto] no measurement for this request shape yet" in capsys.readouterr().err
