"""Train an MTP language model: python train.py --config configs/tiny.yaml [--fresh] [section.key=value ...]."""

import sys

if __name__ == "__main__":  # a spawned worker (data.prepare_workers) imports this file too, and needs no library
    from mtpjax.cli.args import entry

    sys.exit(entry("mtpjax.cli.train", sys.argv[1:]))
