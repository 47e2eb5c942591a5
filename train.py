"""Train an MTP language model: python train.py --config configs/tiny.yaml [--fresh] [section.key=value ...]."""

import sys

from mtpjax.parallel.targets import prepare_environment

prepare_environment()  # before JAX loads

from mtpjax.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
