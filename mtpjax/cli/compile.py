"""`python -m mtpjax compile --config X --target T [overrides...]`: the run's programs compiled for a TPU slice or
NVIDIA GPUs on any machine, with memory, FLOPs, collectives, kernels and a roofline estimate per program; `--search`
compiles a few meshes for the target and ranks them."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from mtpjax.cli.args import Parser, command, writable, write_json
from mtpjax.config import load_config, replace
from mtpjax.parallel.console import say
from mtpjax.parallel.sharding import MeshError
from mtpjax.parallel.targets import parse_target
from mtpjax.train import meshes
from mtpjax.train.aot import DoesNotFit, compile_report, format_report, report_json


def _parser() -> Parser:
    ap = Parser(prog="python -m mtpjax compile", description=__doc__)
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/gpu_1b.yaml")
    ap.add_argument("--target", required=True,
                    help="v5e-4, v5p-16, v6e-8, v5e:2x2 (JAX's topology), h100:8, h200:8, a100:8, b200:8, h100:2x8")
    ap.add_argument("--alpha", type=float, default=0.8, help="per-draft acceptance (decode.py --eval's) for the "
                    "decode loop's estimated speedup")
    ap.add_argument("--no-decode", action="store_true", help="compile the train and eval steps only")
    ap.add_argument("--decode-batch", type=int, default=1, help="rows of the compiled decode loop")
    ap.add_argument("--search", type=int, nargs="?", const=6, default=0, metavar="N",
                    help="compile the train step on up to N meshes (data / fsdp / expert / tensor, micro-batches; "
                    "default 6) over the target's devices and rank those that fit by the estimate")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--dump-hlo", default=None, help="write each compiled program's optimized HLO text into this "
                    "directory (PROGRAM.hlo.txt)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides such as mesh.fsdp=8")
    return ap


def on_target(cfg, overrides: list[str], target):
    """The config on a mesh over all the target's devices: its own mesh where it has their number, the user's mesh
    overrides as given (MeshError when they do not), else a mesh that fills the target, said on stderr."""
    have, n = meshes.size(cfg.mesh), target.devices
    if have == n:
        return cfg
    if any(o.startswith("mesh.") for o in overrides):
        raise MeshError(f"mesh {meshes.describe(cfg.mesh)} spans {have} device(s) but target {target.name} has {n}; "
                        f"give mesh.* overrides whose product is {n}, none (compile fills the target) or --search")
    mesh = meshes.fills(cfg, n)
    say(f"compile: the config's mesh ({meshes.describe(cfg.mesh)}) does not fill {target.name}'s {n} devices; "
        f"compiling on {meshes.describe(mesh)} ({' '.join(meshes.overrides(mesh))}; pass mesh.* overrides to "
        "choose another, or --search to rank several)")
    return replace(cfg, meshes.overrides(mesh))


@contextlib.contextmanager
def notes_of(logger: str):
    """The lines a library logs while the block runs, kept for the report instead of printed as log records."""
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: notes.append(r.getMessage())
    log = logging.getLogger(logger)
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        yield notes
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


@command
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input or a program that does not fit)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        ap.error(f"--alpha {args.alpha} must be in [0, 1]")
    if args.decode_batch < 1:
        ap.error(f"--decode-batch {args.decode_batch} must be >= 1")
    if args.search < 0:
        ap.error(f"--search {args.search} must be >= 1 (meshes to compile)")
    writable("--json", args.json)
    writable("--dump-hlo", args.dump_hlo, folder=True)
    target = parse_target(args.target)
    cfg = load_config(args.config, args.overrides)
    if args.search:
        rows = meshes.search(cfg, target, args.search, place=lambda o: replace(cfg, o))
        print(meshes.ranking(rows, target.name))
        write_json(args.json, {"target": target.name, "search": rows}, indent=1)
        return 0
    cfg = on_target(cfg, args.overrides, target)
    with notes_of("mtpjax.decode") as notes:
        try:
            report = compile_report(cfg, target, alpha=args.alpha, decode=not args.no_decode, batch=args.decode_batch)
        except DoesNotFit as e:
            print(e.table, flush=True)
            raise
    report["notes"] = notes
    print(format_report(report))
    write_json(args.json, report_json(report), indent=1)
    if args.dump_hlo:
        Path(args.dump_hlo).mkdir(parents=True, exist_ok=True)
        for p in report["programs"]:
            (Path(args.dump_hlo) / f"{p['program']}.hlo.txt").write_text(p["_text"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
