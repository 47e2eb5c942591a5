"""What a newcomer meets first: `import mtpjax` and its lazy API, text in and text out, prompts of the wrong type,
a clean terminal (status lines above the bar, one bar line when piped, plurals, override hints), and the line
saying why speculation lost. The tests that decode from the shared tiny run (nothing echoed before a request is
checked, a quiet read-only restore, auto's first decode drafting from an estimate) are in test_decode_manners,
whose programs they reuse."""

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tqdm import tqdm

from mtpjax.cli.decode import main as decode_main
from mtpjax.cli.train import main as train_main
from mtpjax.data import ByteTokenizer
from mtpjax.decode.prompts import PromptError, check_token_prompts
from mtpjax.eval import verdict
from mtpjax.parallel import console

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_mtpjax_loads_no_jax_and_its_api_names_load_on_first_use():
    """`import mtpjax` and a command's bad input load neither JAX nor the config's YAML; a name of the API loads its
    module when first used (companion: the probe sees YAML arrive with `mtpjax.load_config`)."""
    probe = ("import sys, mtpjax; from mtpjax.__main__ import main\n"
             "seen = lambda: [m for m in ('jax', 'yaml') if m in sys.modules]\n"
             "print(seen(), mtpjax.load_config.__module__, seen())\n"
             "codes = [main(['nope']), main(['data', 'prepare', '--config', 'configs/tiny.yaml', '--steps', '3'])]\n"
             "print(codes, seen())\n")
    res = _python(probe)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["[] mtpjax.config.load ['yaml']", "[2, 2] ['yaml']"], res.stdout
    assert "train.steps=3" in res.stderr  # data prepare takes overrides: the flag's key form is suggested
    import mtpjax

    assert mtpjax.decode.__name__ == "mtpjax.decode" and mtpjax.Generator.__name__ == "Generator"
    assert [f.__module__ for f in (mtpjax.load, mtpjax.generate, mtpjax.load_model)] == [
        "mtpjax.train.pretrained", "mtpjax.decode.api", "mtpjax.train.checkpoint"]
    assert {"load", "generate", "decode", "train"} <= set(dir(mtpjax))
    assert len(dir(mtpjax)) == len(set(dir(mtpjax)))  # a name loaded already was listed twice
    with pytest.raises(AttributeError, match="module 'mtpjax' has no attribute 'nope'"):
        mtpjax.nope  # noqa: B018


@pytest.mark.parametrize("prompts, words", [
    ("def f():", "prompts is text"),
    ([5, 6, 7], "one flat list of token ids; wrap it"),
    (np.array([5, 6, 7]), "1-D int"),
    (["import os"], "prompt 0 is text"),
    ([[1, 2], "x"], "prompt 1 is text"),
    ([[1, 2.5]], "prompt 0 is not a list of integer token ids"),
    (7, "prompts is a int"),
])
def test_generate_names_the_fix_for_prompts_of_the_wrong_type(prompts, words):
    from mtpjax.decode import generate

    with pytest.raises(PromptError, match="^" + words.split(";")[0] if words.startswith("prompts is") else words):
        generate(None, prompts, max_new_tokens=4)  # checked before the model is touched


def test_companion_token_id_batches_pass_the_prompt_check():
    for ok in ([[1, 2, 3]], [[1], [2, 3]], np.zeros((2, 3), np.int32), [np.array([1, 2])], ((4, 5),)):
        check_token_prompts(ok)


def test_a_generator_takes_text_and_refuses_token_ids():
    from mtpjax import Generator

    gen = Generator(model=None, tokenizer=ByteTokenizer())
    for bad, words in (([[1, 2]], "takes text"), ([], "non-empty list of strings"), (3, "non-empty list"),
                       (["x", ""], "empty prompt: give at least one character of text")):
        with pytest.raises(PromptError, match=words):
            gen(bad)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """What a terminal shows for `raw`: a carriage return moves to column 0, later characters overwrite."""
    lines = []
    for text in raw.split("\n"):
        row: list[str] = []
        col = 0
        for ch in text:
            if ch == "\r":
                col = 0
                continue
            row[col:col + 1] = [ch]
            col += 1
        lines.append("".join(row).rstrip())
    return lines


def _note_under_a_bar(monkeypatch, note) -> list[str]:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = console.bar(3, desc="train", unit="step")
    note()
    bar.update(3)
    bar.close()
    return _screen(term.getvalue())


def test_a_status_line_under_the_bar_is_a_line_of_its_own(monkeypatch):
    from mtpjax.nn import kernels

    monkeypatch.setattr(kernels, "_NOTED", set())
    screen = _note_under_a_bar(monkeypatch, lambda: kernels.note("runs xla"))
    assert "attention: runs xla" in screen, screen


def test_companion_a_print_under_the_bar_glues_to_it(monkeypatch):
    screen = _note_under_a_bar(monkeypatch, lambda: print("attention: runs xla", file=sys.stderr, flush=True))
    assert "attention: runs xla" not in screen and any(s.endswith("attention: runs xla") for s in screen), screen


def _piped(monkeypatch, make) -> str:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    bar = make(10, initial=8, desc="train", unit="step")  # a resumed run
    for _ in range(2):
        bar.update(1)
        console.say("step: eval")
    bar.close()
    done = make(10, initial=10, desc="train", unit="step")  # resumed when already done
    done.close()
    return out.getvalue()


def test_a_piped_bar_prints_one_line_per_phase(monkeypatch):
    text = _piped(monkeypatch, lambda total, **kw: console.bar(total, **kw))
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[:2] == ["step: eval", "step: eval"] and len(lines) == 4, lines
    assert all(ln.startswith("train: 100%") and "10/10" in ln for ln in lines[2:])


def test_companion_tqdm_piped_repeats_its_last_bar(monkeypatch):
    text = _piped(monkeypatch, lambda total, **kw: tqdm(total=total, file=sys.stderr, **kw))
    assert text.count("10/10") >= 3  # the finished run's bar twice, the resumed one's at least once more


def test_the_banner_counts_one_mtp_module_in_the_singular():
    from mtpjax.config import load_config
    from mtpjax.train.report import banner

    part = SimpleNamespace(meta={"files": 1}, train_tokens=[0] * 9, val_tokens=[0])
    prepared = SimpleNamespace(sources=lambda: [(None, None, part)], tokenizer=SimpleNamespace(vocab_size=1024),
                               content_hash="abc")
    mesh = SimpleNamespace(shape={"data": 1})
    text = banner(load_config(TINY), mesh, Path("runs/tiny"), 0, prepared, 8)
    assert ", 1 MTP module x " in text and "(1 file)" in text, text
    two = banner(load_config(TINY, ["model.mtp_depth=2"]), mesh, Path("r"), 0, prepared, 8)
    assert ", 2 MTP modules x " in two


def test_the_banner_says_how_many_batches_an_eval_reads():
    """A validation split shorter than train.eval_batches is read once, and the banner says so; no eval is said."""
    from mtpjax.config import load_config
    from mtpjax.train.report import banner

    part = SimpleNamespace(meta={"files": 1}, train_tokens=[0] * 9, val_tokens=[0])
    prepared = SimpleNamespace(sources=lambda: [(None, None, part)], tokenizer=SimpleNamespace(vocab_size=1024),
                               content_hash="abc")

    def plan(got: int, *overrides: str) -> str:
        cfg = load_config(TINY, ["train.eval_batches=8", "train.eval_every=50", *overrides])
        return banner(cfg, SimpleNamespace(shape={"data": 1}), Path("r"), 0, prepared, got).splitlines()[-1]
    assert "eval every 50 on 8 batches, checkpoint" in plan(8)
    assert "eval every 50 on 1 batch (the whole validation split; train.eval_batches=8 asks more)," in plan(1)
    assert "no eval (train.eval_batches=0)," in plan(0, "train.eval_batches=0")


def test_a_flag_named_like_a_config_key_suggests_the_override(capsys):
    for argv, hint in ((["--steps", "10"], "train.steps=10"), (["--lr=3e-4"], "optim.lr=3e-4"),
                       (["--seq-len", "64"], "data.seq_len=64")):
        assert train_main(["--config", TINY, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"config keys are set as section.key=value: {hint}" in err[0], err


def test_companion_no_hint_for_an_unknown_flag_or_a_command_without_overrides(capsys):
    assert train_main(["--config", TINY, "--no-such-option"]) == 2
    assert "section.key=value" not in capsys.readouterr().err
    assert decode_main(["--run-dir", "x", "--steps", "3"]) == 2
    assert "section.key=value" not in capsys.readouterr().err


def test_the_eval_line_names_why_speculation_lost():
    d = {"speedup": 0.83, "verify_cost_v": 1.8, "draft_cost_c": 0.12, "gamma": 1, "tokens_per_round": 1.6,
         "round_cost": 1.92, "speedup_ceiling": 1.04}
    line = verdict.eval_line(d)
    assert line.startswith("why MTP is slower here (0.83x): verifying 2 tokens costs v=1.80 plain steps, a draft "
                           "c=0.12, a round 1.92 for 1.60 tokens: the decode step is compute-bound")
    assert line.endswith(f"(ceiling 1.04; {verdict.DOCS})")
    cheap_v = verdict.eval_line({**d, "verify_cost_v": 1.05, "draft_cost_c": 0.6, "round_cost": 1.65})
    assert ": the drafts cost more than their accepted tokens save" in cheap_v


def test_companion_no_eval_line_when_speculation_wins():
    assert verdict.eval_line({"speedup": 1.2}) is None and verdict.eval_line({}) is None
    assert verdict.stats_line({"drafts": 1, "round_cost": {"0": 1.0, "1": 1.2}, "expected_tokens": {}}, "mtp") is None
