"""What every command shares: its argument parser (errors in one line) and its one catch of MtpjaxError."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from mtpjax.errors import MtpjaxError, first_line


class UsageError(MtpjaxError):
    """A bad command line: an unknown option, a missing or malformed argument."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a UsageError pointing at --help: one line and exit 2, never a usage block."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A command's main(argv) returning its exit status: an MtpjaxError (a bad argument too) becomes one `error:`
    line on stderr and its exit_status; --help returns 0. Any other exception is a bug and keeps its traceback."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except MtpjaxError as e:
            print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
            return e.exit_status
        except SystemExit as e:  # argparse's --help (and --version) end by exiting
            return 0 if e.code is None else e.code

    return run
