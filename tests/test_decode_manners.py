"""decode.py's manners: it echoes the prompt, says what ran (`plain` for 0 drafts), shows progress while it
calibrates (and evaluates: test_decode), and a first `--num-draft auto` calibration compiles only the loops the
run reuses."""

from types import SimpleNamespace

import numpy as np
import pytest

from mtpjax.decode import api, autodraft
from mtpjax.decode.cli import label, main
from mtpjax.decode.loop import execute


def _argv(run, *extra):
    return ["--run-dir", str(run), "--prompt", "def f(x):", "--max-new-tokens", "8", *extra]


def test_the_prompt_is_echoed_before_the_continuation(tiny_run, capsys):
    _, run = tiny_run
    assert main(_argv(run, "--num-draft", "1")) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and len(out) > len("def f(x):\n")


def test_prompts_file_prints_each_prompt_with_its_continuation(tiny_run, capsys, tmp_path):
    _, run = tiny_run
    f = tmp_path / "p.txt"
    f.write_text("import os\nclass A:\n")
    assert main(["--run-dir", str(run), "--prompts-file", str(f), "--max-new-tokens", "4", "--num-draft", "0"]) == 0
    out = capsys.readouterr().out
    assert "### 'import os'\nimport os" in out and "### 'class A:'\nclass A:" in out


def test_the_label_says_what_ran(tiny_run, capsys):
    assert label("mtp", 0) == "plain" and label("ngram", 0) == "plain" and label("mtp", 2) == "mtp num_draft=2"
    _, run = tiny_run
    assert main(_argv(run, "--num-draft", "0", "--stats")) == 0
    err = capsys.readouterr().err
    assert "[plain] rounds=" in err and "num_draft=0" not in err and "acceptance=" not in err
    assert main(_argv(run, "--num-draft", "2", "--stats")) == 0
    assert "[mtp num_draft=2] rounds=" in capsys.readouterr().err


def test_auto_choosing_no_drafts_is_labelled_plain(tiny_run, capsys, monkeypatch, tmp_path):
    """When the calibration picks 0 drafts, the stats say `plain` and why, not `[mtp num_draft=0]`."""
    _, run = tiny_run
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autodraft, "calibrate", lambda *a, **k: autodraft.Calibration(
        num_draft=0, round_cost={0: 1.0, 1: 2.5, 2: 3.4}, alpha_by_position=[0.5, 0.2],
        expected_tokens={0: 1.0, 1: 1.5, 2: 1.6}, seconds=0.5))
    assert main(_argv(run, "--stats")) == 0
    err = capsys.readouterr().err
    assert "[plain] rounds=" in err and "[mtp num_draft=0]" not in err
    assert "-> plain (no draft count was predicted to beat plain decoding" in err
    assert "measured now: the probe took 0.5s of the request's" in err


def test_auto_calibrates_with_a_progress_line_and_says_what_it_cost(tiny_run, capsys, monkeypatch, tmp_path):
    _, run = tiny_run
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path))
    assert main(_argv(run, "--stats")) == 0
    err = capsys.readouterr().err
    progress = [ln for ln in err.splitlines() if ln.startswith("auto: timing")]
    # the progress line comes before the result; 8 new tokens: a timed run decodes 8 (the floor of the probe)
    assert len(progress) == 1 and "3 draft counts (0, 1, 2)" in progress[0] and "8 tokens a run" in progress[0]
    assert err.index("auto: timing") < err.index("[auto] round cost")
    assert "measured now: the probe took" in err


def test_probe_is_a_fraction_of_the_request(monkeypatch):
    """A timed run decodes 1/8 of the request's new tokens (8..64), not a fixed 64."""

    class Stop(Exception):
        pass

    def fake_run(model, prompts, loop, seed, budget=None, draft=None):
        if budget > 1:
            raise Stop(budget)
        return SimpleNamespace(n_B=np.zeros(1), rounds_B=np.zeros(1))

    monkeypatch.setattr(autodraft.host, "run", fake_run)
    for max_new, tokens in ((512, 64), (128, 16), (24, 8), (4096, 64)):
        loop = SimpleNamespace(max_new=max_new)
        with pytest.raises(Stop) as e:
            autodraft.calibrate(None, [[1]], {0: loop, 1: loop})
        assert e.value.args == (tokens,), max_new


def test_calibration_compiles_only_the_loops_the_run_reuses(tiny_run):
    """`num_draft="auto"` compiles each candidate's loop once; the real run adds no compilation."""
    from mtpjax.checkpoint import load_model

    _, run = tiny_run
    _, model, tok = load_model(run)
    prompts = [tok.encode("import os")]
    kw = dict(max_new_tokens=19, seed=3, eos_id=tok.eos_id)  # a request shape no other test compiles
    before = execute._cache_size()
    res = api.generate(model, prompts, num_draft="auto", on_commit=lambda *_: None, **kw)
    assert res.stats["calibration"]["source"] == "probe"
    assert execute._cache_size() - before == len(autodraft.candidates(model, "mtp")) == 3
    # the counter does count: a request of another shape compiles its loop
    mid = execute._cache_size()
    api.generate(model, prompts, num_draft=1, **{**kw, "max_new_tokens": 21})
    assert execute._cache_size() - mid == 1


def test_auto_never_picks_drafts_within_the_noise_of_plain():
    """A draft count predicted less than MARGIN faster than plain is not worth the risk: plain is chosen."""
    from mtpjax.speed import choose_num_draft, predicted_speedup

    alpha = [0.5]
    assert 1.0 < predicted_speedup(alpha, 1, 1.45) < autodraft.MARGIN  # 1.5 / 1.45 = 1.03
    assert choose_num_draft(alpha, {1: 1.45}) == 1  # the bare cost model would take the noise
    assert autodraft.choose(alpha, {0: 1.0, 1: 1.45}) == 0
    assert autodraft.choose(alpha, {0: 1.0, 1: 1.2}) == 1  # a clear win (1.25) is taken
    assert autodraft.choose([], {0: 1.0}) == 0
