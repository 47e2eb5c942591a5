"""`python train.py --config X [--fresh] [section.key=value ...]`: pretrain (or post-train) an MTP model."""

from __future__ import annotations

import sys

from mtpjax.cli.args import Parser, command
from mtpjax.config import load_config
from mtpjax.parallel import distributed
from mtpjax.train.loop import Interrupted, train


@command
def main(argv: list[str] | None = None) -> int:
    """CLI: train.py --config PATH [--fresh] [section.key=value ...]; exit 2 on bad input, 1 on divergence."""
    ap = Parser(prog="train.py", description="Pretrain an MTP language model.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("--fresh", action="store_true", help="move an existing run dir aside and start over")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = ap.parse_intermixed_args(argv)
    distributed.initialize()  # before any other JAX use; a no-op on one process
    try:
        out = train(load_config(args.config, args.overrides), fresh=args.fresh)
    except Interrupted as e:  # Ctrl-C: the step it stopped at is saved, and the exit status says it was interrupted
        print(_stopped("interrupted", e.out), file=sys.stderr)
        return 130
    except Exception:  # a collective or save may fail because a peer died: the peer watch then ends this process
        distributed.await_lost_peer()
        raise
    distributed.finished()
    if out["preempted"] and distributed.is_primary():
        print(_stopped("preempted", out), file=sys.stderr)
    return 0


def _stopped(why: str, out: dict) -> str:
    """The last line of a run stopped by a signal: the step saved, or that there was none to save."""
    return (f"{why}: checkpoint saved at step {out['step']}" if out["checkpoint"] else
            f"{why} at step {out['step']}, before anything to save; run the same command again")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
