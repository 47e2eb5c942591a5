"""Generate from a trained run (speculatively, with its MTP modules) or evaluate it: `python decode.py --help`."""

import sys

if __name__ == "__main__":  # a spawned worker (data.prepare_workers) imports this file too, and needs no library
    from mtpjax.cli.args import entry

    sys.exit(entry("mtpjax.cli.decode", sys.argv[1:]))
