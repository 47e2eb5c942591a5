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
    """main(argv) -> exit status: an MtpjaxError (a bad argument too) is one `error:` line and its exit_status."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except MtpjaxError as e:  # any other exception is a bug and keeps its traceback
            print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
            return e.exit_status
        except SystemExit as e:  # argparse's --help (and --version) end by exiting
            return 0 if e.code is None else e.code

    return run
