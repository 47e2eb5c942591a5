"""`python -m mtpjax distributed`: join the multi-process runtime and all-reduce one number (a launch check)."""

from __future__ import annotations

import sys

import jax

from mtpjax.cli.args import Parser, command
from mtpjax.parallel.distributed import initialize


@command
def main(argv: list[str] | None = None) -> int:
    """`python -m mtpjax distributed`: join, all-reduce one number per device, print what each process sees."""
    Parser(prog="python -m mtpjax distributed", description=__doc__).parse_args(argv)
    launch = initialize()
    import numpy as np
    from jax.experimental import multihost_utils

    total = multihost_utils.process_allgather(np.float32(jax.process_index() + 1)).sum()
    print(f"process {jax.process_index()} of {jax.process_count()} ({launch.method if launch else 'alone'}): "
          f"{jax.local_device_count()} local / {jax.device_count()} global devices, all-reduce {total:g}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
