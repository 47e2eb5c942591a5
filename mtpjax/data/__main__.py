"""`python -m mtpjax.data`: the same command as `python -m mtpjax data` (mtpjax.cli.data)."""

import sys

from mtpjax.cli.data import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
