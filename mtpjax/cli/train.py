"""`python train.py --config X [--fresh] [section.key=value ...]`: pretrain (or post-train) an MTP model."""

from __future__ import annotations

import argparse
import sys

from mtpjax import data
from mtpjax.config import ConfigError, load_config
from mtpjax.parallel import distributed
from mtpjax.parallel.sharding import MeshError
from mtpjax.train import posttrain, rundir
from mtpjax.train.checkpoint import CheckpointError
from mtpjax.train.loop import NonFiniteError, TrainError, train


def main(argv: list[str] | None = None) -> int:
    """CLI: train.py --config PATH [--fresh] [section.key=value ...]; exit 2 on bad input, 1 on divergence."""
    ap = argparse.ArgumentParser(prog="train.py", description="Pretrain an MTP language model.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("--fresh", action="store_true", help="move an existing run dir aside and start over")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = ap.parse_intermixed_args(argv)
    try:
        distributed.initialize()  # before any other JAX use; a no-op on one process
        cfg = load_config(args.config, args.overrides)
        out = train(cfg, fresh=args.fresh)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, data.DataError, CheckpointError, MeshError, TrainError, rundir.RunDirError,
            distributed.DistributedError, posttrain.InitFromError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out["preempted"] and distributed.is_primary():
        print(f"preempted: checkpoint saved at step {out['step']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
