"""The command shell: every command parses with the shared Parser and reports an MtpjaxError once, as one line."""

import argparse
import importlib
from pathlib import Path

import pytest

import mtpjax.config
import mtpjax.convert
import mtpjax.train.checkpoint
from mtpjax.__main__ import main as mtpjax_main
from mtpjax.cli import COMMANDS
from mtpjax.cli.args import Parser
from mtpjax.errors import MtpjaxError
from mtpjax.train.loop import NonFiniteError

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def _main(name: str):
    return importlib.import_module(f"mtpjax.cli.{name}").main


def _run(capsys, fn, argv) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of a command's main; a SystemExit counts as its code."""
    capsys.readouterr()
    try:
        code = fn(argv)
    except SystemExit as e:
        code = e.code
    cap = capsys.readouterr()
    assert cap.out == ""
    return code, cap.err.strip().splitlines()


def _is_one_line_usage_error(code, err: list[str]) -> bool:
    return code == 2 and len(err) == 1 and err[0].startswith("error: ") and err[0].endswith(" --help)")


@pytest.mark.parametrize("name", COMMANDS)
def test_bad_arguments_are_one_line_exit_2_through_the_shared_parser(capsys, name):
    code, err = _run(capsys, _main(name), ["--no-such-option"])
    assert _is_one_line_usage_error(code, err), err
    assert "--no-such-option" in err[0] or "required" in err[0]


@pytest.mark.parametrize("name", COMMANDS)
def test_companion_argparse_s_own_error_prints_a_usage_block(capsys, monkeypatch, name):
    """Companion: with argparse's own error() the same input prints a usage block, which the check refuses."""
    monkeypatch.setattr(Parser, "error", argparse.ArgumentParser.error)
    code, err = _run(capsys, _main(name), ["--no-such-option"])
    assert code == 2 and err[0].startswith("usage: ")
    assert not _is_one_line_usage_error(code, err)


def test_python_m_mtpjax_answers_a_missing_or_unknown_command_in_one_line(capsys):
    for argv, words in (([], "no command given"), (["nope"], "invalid choice: 'nope'")):
        code, err = _run(capsys, mtpjax_main, argv)
        assert _is_one_line_usage_error(code, err) and words in err[0], err


def test_help_returns_0(capsys):
    for name in COMMANDS:
        assert _main(name)(["--help"]) == 0
        assert "usage: " in capsys.readouterr().out


class _Refused(MtpjaxError):
    exit_status = 3


# Where each command's work starts: (module, attribute) replaced by a function that raises.
WORK = {
    "train": ("mtpjax.cli.train", "train"),
    "decode": ("mtpjax.cli.decode", "_mesh"),  # its first work: the run's mesh
    "plan": ("mtpjax.cli.plan", "load_config"),
    "compile": ("mtpjax.cli.compile", "compile_report"),
    "convert": (mtpjax.convert, "export_run"),
    "data": (mtpjax.config, "load_config"),
    "distributed": ("mtpjax.cli.distributed", "initialize"),
    "lm_eval": ("mtpjax.cli.lm_eval", "check_run_args"),
}
ARGV = {
    "train": ["--config", TINY], "decode": ["--run-dir", "r", "--prompt", "x"], "plan": ["--config", "x.yaml"],
    "compile": ["--config", TINY, "--target", "v5e-4", "mesh.fsdp=2", "mesh.tensor=2"],  # a mesh that fills it
    "convert": ["export", "--run-dir", "r", "--out", "o"], "data": ["prepare"], "distributed": [],
    "lm_eval": ["--model", "mtpjax", "--model_args", "run_dir=r", "--tasks", "mtpjax"],
}


def _raise_in_work(monkeypatch, name: str, error: Exception) -> None:
    def fail(*args, **kwargs):
        raise error

    module, attr = WORK[name]
    monkeypatch.setattr(importlib.import_module(module) if isinstance(module, str) else module, attr, fail)


@pytest.mark.parametrize("name", COMMANDS)
def test_an_mtpjax_error_in_a_command_s_work_is_one_line_with_its_exit_status(capsys, monkeypatch, name):
    _raise_in_work(monkeypatch, name, _Refused("refused: the problem and its fix\nmore detail"))
    assert _run(capsys, _main(name), ARGV[name]) == (3, ["error: refused: the problem and its fix"])


@pytest.mark.parametrize("name", COMMANDS)
def test_companion_another_error_in_a_command_s_work_escapes(capsys, monkeypatch, name):
    """Companion: an error that is not an MtpjaxError is a bug and keeps its traceback."""
    _raise_in_work(monkeypatch, name, KeyError("a bug"))
    with pytest.raises(KeyError, match="a bug"):
        _main(name)(ARGV[name])


def test_a_divergence_exits_1(capsys, monkeypatch):
    _raise_in_work(monkeypatch, "train", NonFiniteError("non-finite loss at step 3; stopped"))
    assert _run(capsys, _main("train"), ARGV["train"]) == (1, ["error: non-finite loss at step 3; stopped"])


@pytest.mark.parametrize("deaf", [True, False])
def test_data_workers_start_deaf_to_ctrl_c_and_the_companion_without(deaf):
    """Ctrl-C reaches the whole process group: the preparation workers start with SIGINT ignored (inherited across
    exec), so a press while they start does not kill one (it ended the run as "a data.prepare_workers process died")
    nor print their tracebacks; the companion: a worker started without it has Python's handler."""
    import contextlib
    import multiprocessing
    import signal
    import sys
    from concurrent.futures import ProcessPoolExecutor

    from mtpjax.data import encode

    sys.path.insert(0, str(Path(__file__).parent))
    import sigint_probe

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background pytest starts it ignored
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            with encode._workers_deaf_to_ctrl_c() if deaf else contextlib.nullcontext():
                got = pool.submit(sigint_probe.at_import)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own, restored
            assert (got.result() == signal.SIG_IGN) == deaf
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("press", [True, False])
def test_ctrl_c_while_a_script_loads_its_libraries_is_one_line_130(capsys, monkeypatch, press):
    """train.py / decode.py import the libraries inside `entry`: a Ctrl-C then is `interrupted`, 130 (it was a
    traceback of wherever it landed, or lost when a library's gc callback swallowed it, as the probe does)."""
    import signal
    import sys

    from mtpjax.cli.args import entry

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delitem(sys.modules, "sigint_probe", raising=False)
    monkeypatch.setenv("MTPJAX_TEST_PRESS", "1" if press else "")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert entry("sigint_probe", []) == (130 if press else 0)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
        sys.modules.pop("sigint_probe", None)
    assert capsys.readouterr().err == ("interrupted\n" if press else "")


@pytest.mark.parametrize("script", ["train.py", "decode.py"])
def test_a_spawned_worker_importing_the_script_loads_no_library(script):
    """A spawn worker imports the parent's script as __mp_main__: the scripts load JAX only when run, so a
    data.prepare_workers process starts in a fraction of the time (it imported JAX, seconds each)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    code = (f"import runpy, sys; g = runpy.run_path({str(root / script)!r}, run_name='__mp_main__'); "
            "print(sorted(m for m in ('jax', 'flax', 'mtpjax.cli.train', 'mtpjax.cli.decode') if m in sys.modules), "
            "callable(g.get('main')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    # ... and it keeps its main(argv) for a caller that loads it as a module (test_quickstart's README sampling)
    assert out.returncode == 0 and out.stdout.strip() == "[] True", out.stderr[-2000:]
    main = subprocess.run([sys.executable, "-c", code.replace("__mp_main__", "__main__").replace("print(", "(")
                           .replace("runpy.run_path", "sys.argv[1:] = ['--help']; runpy.run_path")],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert main.returncode == 0 and "usage:" in main.stdout  # run as a script it is the command


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["-h"], 0), (["--out", "x"], 2)])
def test_the_task_generator_answers_help_or_a_bad_argument_and_writes_nothing(capsys, monkeypatch, tmp_path, argv,
                                                                              code):
    """`python -m mtpjax.eval.tasks.generate --help` says what it writes (it used to ignore its arguments and rewrite
    the committed tasks from this interpreter's stdlib); another argument is one line, exit 2. Companion: with no
    argument it writes the four files."""
    from mtpjax.eval.tasks import generate

    monkeypatch.setattr(generate, "HERE", tmp_path)
    monkeypatch.setattr(generate, "heldout_files", lambda: [("a.py", "def f():\n    return 1\n")])
    assert generate.main(argv) == code
    out, err = capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    assert ("nextline.jsonl" in out) if code == 0 else (err.count("\n") == 1 and "takes none" in err)
    assert generate.main([]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["funcret.jsonl", "heldout.jsonl", "meta.json",
                                                          "nextline.jsonl"]
