"""`python -m mtpjax COMMAND [args...]`: one of mtpjax.cli's commands (train, decode, plan, convert, ...)."""

import argparse
import importlib
import sys

from mtpjax.cli import COMMANDS
from mtpjax.cli.args import Parser, command


@command
def main(argv: list[str] | None = None) -> int:
    """Dispatch to mtpjax.cli.COMMAND.main; a missing or unknown command is one line, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(prog="python -m mtpjax", description=__doc__)
    p.add_argument("command", choices=COMMANDS, help="python -m mtpjax COMMAND --help tells more")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments")
    if not argv:  # argparse would also call the command's arguments missing
        p.error(f"no command given; use one of: {', '.join(COMMANDS)}")
    args = p.parse_args(argv)
    return importlib.import_module(f"mtpjax.cli.{args.command}").main(args.args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
