"""Train an MTP language model: python train.py --config configs/tiny.yaml [--fresh] [section.key=value ...]."""

import sys


def main(argv: list[str]) -> int:
    """mtpjax.cli.train.main(argv), loaded when called: a spawned worker (data.prepare_workers) imports this file too,
    and needs no library."""
    from mtpjax.cli.args import entry

    return entry("mtpjax.cli.train", argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
