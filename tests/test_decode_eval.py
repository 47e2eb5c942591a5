"""decode.py --eval's refusals (before it evaluates: no report, no --json) and where its report goes, on the tiny run;
the report itself is test_decode's (slow tier)."""

import json
import os
from pathlib import Path

import numpy as np

import pytest

from mtpjax.cli import decode_eval
from mtpjax.cli.decode import main
from mtpjax.data import prepare


def _refused(run, capsys, tmp_path, *flags) -> str:
    """The one `error:` line decode.py --eval answers `flags` with (exit 2, nothing on stdout, no --json written)."""
    out = tmp_path / "eval.json"
    code = main(["--run-dir", str(run), "--eval", "--eval-batches", "1", "--json", str(out), *flags])
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert code == 2 and err.out == "" and not out.exists() and lines[-1].startswith("error: "), err
    assert not any(line.startswith("eval: validation") for line in lines), lines
    return lines[-1]


@pytest.mark.parametrize("flags,text", [
    (["--eval-prompts", "0"], "error: --eval-prompts 0 must be >= 1"),
    (["--prompt-len", "0"], "error: --prompt-len 0 must be >= 1"),
    (["--max-new-tokens", "0"], "error: max_new_tokens=0 must be >= 1"),
    # decode.max_new_tokens (128) when the flag is not given, against decode.max_len (2048), as plain decoding
    (["--prompt-len", "5000"], "error: prompt of 5000 tokens + max_new_tokens=128 exceeds the cache capacity "
                               "max_len=2048; shorten the prompt or raise max_len (decode.py --max-len, the config's "
                               "decode.max_len)"),
    (["--prompt-len", "100", "--max-new-tokens", "8", "--max-len", "64"], "exceeds the cache capacity max_len=64"),
])
def test_eval_refuses_what_it_could_not_decode(tiny_run, capsys, tmp_path, flags, text):
    assert text in _refused(tiny_run[1], capsys, tmp_path, *flags)


def test_eval_refuses_a_validation_split_with_no_held_out_prompt(tiny_run, capsys, tmp_path):
    """No stretch of --prompt-len tokens free of an end of text: one line naming --prompt-len (it was an IndexError);
    the same for the teacher-forced texts, --prompt-len + --max-new-tokens long."""
    cfg, run = tiny_run
    n = len(prepare(cfg.data).val_tokens)  # a stretch of n holds the split's last token, an end of text
    line = _refused(run, capsys, tmp_path, "--prompt-len", str(n), "--max-new-tokens", "1", "--max-len", str(n + 8))
    assert line == (f"error: the validation split has no stretch of --prompt-len {n} tokens without an end of text "
                    "to decode from; lower --prompt-len")
    line = _refused(run, capsys, tmp_path, "--prompt-len", "8", "--max-new-tokens", str(n), "--max-len", str(n + 16))
    assert f"no stretch of --prompt-len 8 + --max-new-tokens {n} tokens" in line
    assert line.endswith("; lower --prompt-len or --max-new-tokens")


def test_eval_decodes_the_config_s_max_new_tokens_without_the_flag(tiny_run, capsys, tmp_path, monkeypatch):
    """No --max-new-tokens: decode.max_new_tokens of the run's config (it was a fixed 128)."""
    from mtpjax.train import checkpoint

    real = checkpoint.load_model_step

    def with_decode_length(*a, **k):
        cfg, *rest = real(*a, **k)
        return (cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"max_new_tokens": 5})}), *rest)

    monkeypatch.setattr(checkpoint, "load_model_step", with_decode_length)
    assert "prompt of 2044 tokens + max_new_tokens=5 exceeds" in _refused(tiny_run[1], capsys, tmp_path,
                                                                         "--prompt-len", "2044")


@pytest.mark.parametrize("mode", [["--eval"], ["--tasks", "mtpjax"]])
@pytest.mark.parametrize("at, says", [
    ("FILE/r.json", "--json FILE/r.json: 'FILE' is a file; give another path"),
    ("DIR", "--json DIR is a directory; give a file path"),
    ("DIR/new/r.json", "--json DIR/new/r.json: 'DIR' is not writable; give another path"),
])
def test_a_report_with_nowhere_to_go_is_refused_before_the_run_loads(tiny_run, tmp_path, capsys, monkeypatch, mode,
                                                                      at, says):
    """--eval's and --tasks' --json is checked first, creating nothing (it was a traceback after the whole
    evaluation); the shared check of compile's --json (test_meshes)."""
    from train_helpers import one_line_error

    from mtpjax.train import checkpoint

    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(checkpoint, "load_model_step", lambda *a, **k: pytest.fail("the run loaded"))
    if "not writable" in says:  # a read-only folder (os.access: root may write anywhere)
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    at, says = (x.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path)) for x in (at, says))
    err = one_line_error(capsys, main, ["--run-dir", str(tiny_run[1]), *mode, "--json", at])
    assert err == f"error: {says}" and [p.name for p in tmp_path.iterdir()] == ["FILE"]


def test_a_report_s_missing_folders_are_made(tmp_path):
    """A --json path whose folders do not exist yet passes the check and is written (it was a FileNotFoundError)."""
    from mtpjax.cli.args import writable, write_json

    out = tmp_path / "new" / "sub" / "r.json"
    writable("--json", str(out))
    write_json(str(out), {"speedup": np.float32(1.5)})
    assert json.loads(out.read_text()) == {"speedup": 1.5}


REPORT = {"validation": {"loss/main": 1.0}, "decode": {"speedup": 1.2, "acceptance_by_position": [0.5]}}


def test_a_run_dir_without_room_for_the_report_is_one_warning(tmp_path, capsys):
    """A run's TensorBoard log --eval cannot write (read-only, shared; here a file in its place) is one warning line
    after the report, not a traceback."""
    (tmp_path / "tensorboard").write_text("")
    decode_eval._to_tensorboard(tmp_path, 7, REPORT)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the report is not in the run's TensorBoard log ("), err
    assert err[0].endswith("it was printed above (and written to --json if given)")


def test_companion_a_writable_run_dir_gets_the_report(tmp_path, capsys):
    decode_eval._to_tensorboard(tmp_path, 7, REPORT)
    assert capsys.readouterr().err == "" and list(Path(tmp_path, "tensorboard").glob("events.out.tfevents.*"))
