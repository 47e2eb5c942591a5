"""Generate from a trained run (speculatively, with its MTP modules) or evaluate it: `python decode.py --help`."""

from __future__ import annotations

import sys

from mtpjax.parallel.targets import prepare_environment

prepare_environment()  # before JAX loads

from mtpjax.cli.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
