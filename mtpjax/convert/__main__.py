"""`python -m mtpjax.convert`: the same command as `python -m mtpjax convert` (mtpjax.cli.convert)."""

import sys

from mtpjax.cli.convert import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
