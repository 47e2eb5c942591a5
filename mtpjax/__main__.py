"""`python -m mtpjax COMMAND [args...]`: one of mtpjax.cli's commands (train, decode, plan, convert, ...)."""

import argparse
import importlib
import sys

from mtpjax.parallel.targets import prepare_environment

# Before anything imports JAX: `compile` builds for devices that are not here, so it starts only the CPU backend.
prepare_environment("cpu" if sys.argv[1:2] == ["compile"] else None)

from mtpjax.cli import COMMANDS  # noqa: E402
from mtpjax.cli.args import Parser, command  # noqa: E402


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
