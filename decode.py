"""Generate from a trained run (speculatively, with its MTP modules) or evaluate it: `python decode.py --help`."""

import sys


def main(argv: list[str]) -> int:
    """mtpjax.cli.decode.main(argv), loaded when called: a spawned worker (data.prepare_workers) imports this file too,
    and needs no library."""
    from mtpjax.cli.args import entry

    return entry("mtpjax.cli.decode", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
