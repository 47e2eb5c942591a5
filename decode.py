"""Generate from a trained run (speculatively, with its MTP modules) or evaluate it: `python decode.py --help`."""

from __future__ import annotations

import sys

from mtpjax.cli.decode import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
