"""`python -m mtpjax compile --config X --target T [overrides...]`: the run's programs compiled for a TPU slice or
NVIDIA GPUs on any machine, with memory, FLOPs, collectives, kernels and a roofline estimate per program."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mtpjax.cli.args import Parser, command
from mtpjax.config import load_config
from mtpjax.parallel.targets import parse_target
from mtpjax.train.aot import DoesNotFit, compile_report, format_report, report_json


@command
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input or a program that does not fit)."""
    ap = Parser(prog="python -m mtpjax compile", description=__doc__)
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/gpu_1b.yaml")
    ap.add_argument("--target", required=True,
                    help="v5e-4, v5p-16, v6e-8, v5e:2x2 (JAX's topology), h100:8, h200:8, a100:8, b200:8, h100:2x8")
    ap.add_argument("--alpha", type=float, default=0.8, help="per-draft acceptance (decode.py --eval's) for the "
                    "decode loop's estimated speedup")
    ap.add_argument("--no-decode", action="store_true", help="compile the train and eval steps only")
    ap.add_argument("--decode-batch", type=int, default=1, help="rows of the compiled decode loop")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--dump-hlo", default=None, help="write each compiled program's optimized HLO text into this "
                    "directory (PROGRAM.hlo.txt)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides such as mesh.fsdp=8")
    args = ap.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        ap.error(f"--alpha {args.alpha} must be in [0, 1]")
    if args.decode_batch < 1:
        ap.error(f"--decode-batch {args.decode_batch} must be >= 1")
    target = parse_target(args.target)
    cfg = load_config(args.config, args.overrides)
    try:
        report = compile_report(cfg, target, alpha=args.alpha, decode=not args.no_decode, batch=args.decode_batch)
    except DoesNotFit as e:
        print(e.table, flush=True)
        raise
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report_json(report), indent=1, default=float) + "\n")
    if args.dump_hlo:
        Path(args.dump_hlo).mkdir(parents=True, exist_ok=True)
        for p in report["programs"]:
            (Path(args.dump_hlo) / f"{p['program']}.hlo.txt").write_text(p["_text"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
