"""What every command shares: its argument parser (errors in one line) and its one catch of MtpjaxError."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from mtpjax.errors import MtpjaxError, MtpjaxWarning, first_line


class UsageError(MtpjaxError):
    """A bad command line: an unknown option, a missing or malformed argument."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a UsageError pointing at --help: one line and exit 2, never a usage block.

    A command that takes config overrides (a positional `overrides`) answers an unknown `--flag` named like a config
    key with the `section.key=value` to write instead."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        takes = takes_overrides(self)
        hint = override_hint(message, getattr(self, "_argv", [])) if takes else ""
        if hint:
            message = f"{message}; config keys are set as section.key=value: {hint}"
        raise UsageError(f"{message} (see {self.prog} --help)")


def takes_overrides(p: argparse.ArgumentParser) -> bool:
    """Whether the parser, or one of its subcommands (whose unknown flags it reports), takes config overrides."""
    subs = [q for a in p._actions if isinstance(a, argparse._SubParsersAction) for q in a.choices.values()]
    return any(a.dest == "overrides" for a in p._actions) or any(map(takes_overrides, subs))


def override_hint(message: str, argv: list[str]) -> str:
    """`train.steps=10` for an unrecognized `--steps 10` (or `--steps=10`) that names a config key; else ''."""
    from mtpjax.config import KEYS

    if not message.startswith("unrecognized arguments: "):
        return ""
    keys = list(KEYS)
    hints = []
    for flag in message.removeprefix("unrecognized arguments: ").split():
        name, eq, value = flag.removeprefix("--").partition("=")
        matches = [k for k in keys if k.rpartition(".")[2] == name.replace("-", "_")] if flag.startswith("--") else []
        if matches and not eq and flag in argv:
            i = argv.index(flag) + 1
            value = argv[i] if i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i] else "VALUE"
        hints += [" or ".join(f"{k}={value}" for k in matches)] if matches else []
    return ", ".join(hints)


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """main(argv) -> exit status: an MtpjaxError (a bad argument too) is one `error:` line and its exit_status; Ctrl-C
    is one line, 130."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        warnings.formatwarning = _warning_line
        try:
            return main(argv)
        except MtpjaxError as e:  # any other exception is a bug and keeps its traceback
            print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
            return e.exit_status
        except SystemExit as e:  # argparse's --help (and --version) end by exiting
            return 0 if e.code is None else e.code
        except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
            print("interrupted", file=sys.stderr, flush=True)
            return 130

    return run


def entry(module: str, argv: list[str]) -> int:
    """A script's run of `module`'s main(argv): the environment set before JAX loads, and a Ctrl-C while the libraries
    load one line, 130, as it is once they have (`command`)."""
    from mtpjax.parallel.targets import prepare_environment

    prepare_environment()
    pressed, python = [], signal.getsignal(signal.SIGINT)
    ours = python is signal.default_int_handler and threading.current_thread() is threading.main_thread()
    if ours:  # a flag, not Python's exception, which JAX's import can swallow (a gc callback's "Exception ignored")
        signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        main = importlib.import_module(module).main
    finally:
        if ours:
            signal.signal(signal.SIGINT, python)
    if pressed:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return main(argv)


def _warning_line(message, category, filename, lineno, line=None, _python=warnings.formatwarning) -> str:
    """Our warnings as one `warning:` line, as our errors are; others' (a library's) as Python writes them."""
    if issubclass(category, MtpjaxWarning):
        return f"warning: {message}\n"
    return _python(message, category, filename, lineno, line)


def draft_flag(num_draft: str | None, tree: str | None):
    """decode.draft from the flags that spell it (decode.py's --num-draft and --tree, the harness's num_draft= and
    tree=): the one place they map onto the key; None when neither is given."""
    if num_draft is not None and tree is not None:
        raise UsageError(f"--num-draft {num_draft} and --tree {tree} both say what to draft (decode.draft); give one "
                         "of them")
    from mtpjax.config import DecodeConfig  # here: a command's bad flags are answered before the config loads

    given = tree if tree is not None else num_draft
    return None if given is None else DecodeConfig(draft=str(given)).draft


def writable(flag: str, given: str | None, folder: bool = False) -> None:
    """Before the work starts (minutes), and creating nothing: `given` names a file (folder=True: a directory) that
    can be written, its nearest existing folder a writable directory; UsageError naming `flag` otherwise."""
    if not given:
        return
    path = Path(given).absolute()
    if not folder and path.is_dir():
        raise UsageError(f"{flag} {given} is a directory; give a file path")
    start = path if folder else path.parent
    near = next(p for p in (start, *start.parents) if p.exists())
    if not near.is_dir() or not os.access(near, os.W_OK):
        raise UsageError(f"{flag} {given}: '{near}' is {'not writable' if near.is_dir() else 'a file'}; "
                         "give another path")


def write_json(path: str | None, payload, indent: int = 2, default: Callable = float) -> None:
    """A command's report as JSON at `path` (--json, checked by writable before the work; None: not asked for), its
    missing folders made; `default` writes what JSON has no type for (numpy scalars)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=indent, default=default) + "\n")


class _ModeFlag(argparse.Action):
    """A flag only some modes read (`modes`: --eval, --tasks, --prompt, ...): stored (a switch's `const`), and listed
    in the namespace's mode_flags as given, so check_modes can refuse it without its mode (it would be ignored)."""

    def __init__(self, *a, modes: tuple[str, ...], **kw):
        super().__init__(*a, **kw)
        self.modes = modes

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.mode_flags = [*getattr(namespace, "mode_flags", []), (option_string, self.modes)]


def mode_flag(p: Parser, modes: tuple[str, ...], flag: str, help: str, switch: bool = False, **kw) -> None:
    """Add `flag` (a switch: takes no value, False unless given), read only by `modes` (the flags that choose what a
    command does): its help starts with them, and given without one of them it is refused."""
    if switch:
        kw.update(nargs=0, const=True, default=False)
    p.add_argument(flag, action=functools.partial(_ModeFlag, modes=modes), help=f"{', '.join(modes)}: {help}", **kw)


def check_modes(p: Parser, args) -> None:
    """UsageError for a flag given without the mode that reads it (--batch-size without --tasks): silently ignored,
    it would look as if it had been used."""
    for flag, modes in getattr(args, "mode_flags", []):
        if not any(getattr(args, m.removeprefix("--").replace("-", "_")) not in (None, False) for m in modes):
            p.error(f"{flag} is only for {' or '.join(modes)} (here it would be ignored); drop it")
