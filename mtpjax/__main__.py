"""`python -m mtpjax COMMAND [args...]`: one of mtpjax.cli's commands (train, decode, plan, convert, ...)."""

import importlib
import sys

from mtpjax.cli import COMMANDS


def main(argv: list[str]) -> int:
    """Dispatch to mtpjax.cli.COMMAND.main; a missing or unknown command is one line, exit 2."""
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"error: {got}; use one of: {', '.join(COMMANDS)} (python -m mtpjax COMMAND --help)", file=sys.stderr)
        return 2
    return importlib.import_module(f"mtpjax.cli.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
