"""Train an MTP language model: python train.py --config configs/tiny.yaml [--fresh] [section.key=value ...]."""

import sys

from mtpjax.cli.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
