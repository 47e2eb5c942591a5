"""CLI of the MTP ablation (see bench/ablation/__init__.py): sweep, step times, results.json, table, plots."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from bench.ablation import grid, report, sweep, timing
from mtpjax.cli.args import Parser, command
from mtpjax.config import ConfigError, load_config
from mtpjax.parallel import distributed

# --smoke: a few seconds of training per variant on a 2-layer, 32-wide model (what the tests run)
SMOKE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "data.seq_len=32", "train.batch_size=8", "train.eval_every=1", "train.eval_batches=1", "train.log_every=2",
         "train.num_samples=1", "train.peak_flops=1e9", "train.progress=false", "checkpoint.every=4",
         "optim.warmup_steps=2", "optim.lr=1e-2"]
SMOKE_STEPS, SMOKE_ROUNDS = 8, 2


def parse_args(argv):
    ap = Parser(prog="python -m bench.ablation", description=__doc__)
    ap.add_argument("--config", default="configs/ablation.yaml", help="base config of every run")
    ap.add_argument("--depths", default="0,1,2", help="MTP depths, 0 = the plain model every variant is compared to")
    ap.add_argument("--kinds", default="sequential,parallel@2",
                    help="module kinds, each optionally restricted to some depths: sequential,parallel@2")
    ap.add_argument("--lambda", dest="lambdas", action="append", default=None,
                    help="λ schedule (repeatable; default the config's loss.mtp_lambda)")
    ap.add_argument("--curriculum", dest="curricula", action="append", default=[],
                    help="per-depth λ curriculum (loss.mtp_lambda_depths, e.g. forward:25; repeatable): each adds "
                         "every (depth, kind, λ) variant again under it")
    ap.add_argument("--target", dest="targets", action="append", default=[],
                    help="an extra loss.mtp_target, optionally @depths (e.g. tv@1; repeatable): adds every (kind, λ) "
                         "variant at those depths trained on it")
    ap.add_argument("--steps", type=int, default=None, help="steps of every variant (default train.steps)")
    ap.add_argument("--seeds", default="1", help="N (seeds train.seed .. train.seed+N-1) or a list: 0,1,2")
    ap.add_argument("--out", default="runs/ablation", help="run directories (re-running resumes them)")
    ap.add_argument("--report", default=None, help="where results.json and the plots go (default --out)")
    ap.add_argument("--timing-rounds", type=int, default=None, help="interleaved step-time rounds (default 5)")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing, measure no step times: report the seeds whose runs are all complete")
    ap.add_argument("--smoke", action="store_true", help=f"tiny model, {SMOKE_STEPS} steps: a check in seconds")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run")
    return ap.parse_intermixed_args(argv)


def _seeds(text: str, base_seed: int) -> list[int]:
    try:
        if "," in text:
            seeds = sorted({int(x) for x in text.split(",") if x.strip()})
        else:
            seeds = list(range(base_seed, base_seed + int(text)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds '{text}' must be a count >= 1 or a list of seeds >= 0, e.g. 2 or 0,1")
    return seeds


def setup(args):
    """(base config, variants, seeds, steps, runs, timing rounds) from the command line; ConfigError if wrong."""
    base = load_config(args.config, (SMOKE if args.smoke else []) + list(args.overrides))
    if base.train.eval_batches < 1:
        raise ConfigError("train.eval_batches=0: the ablation compares validation losses; set it >= 1")
    steps = args.steps if args.steps is not None else (SMOKE_STEPS if args.smoke else base.train.steps)
    if steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1")
    rounds = args.timing_rounds if args.timing_rounds is not None else (SMOKE_ROUNDS if args.smoke else 5)
    if rounds < 1:
        raise ConfigError(f"--timing-rounds {rounds} must be >= 1")
    depths = grid.parse_depths(args.depths)
    if 0 not in depths:
        raise ConfigError(f"--depths '{args.depths}' must include 0: every variant is compared to D=0")
    kinds = grid.parse_kinds(args.kinds, depths)
    lambdas = args.lambdas or [str(base.loss.mtp_lambda)]
    vs = grid.variants(depths, kinds, lambdas, args.curricula, grid.parse_targets(args.targets, depths))
    seeds = _seeds(args.seeds, base.train.seed)
    for v in vs:  # every λ, kind, curriculum and target validated before anything trains
        grid.variant_config(base, v, seeds[0], steps, Path(args.out))
    runs = grid.plan_runs(base, vs, seeds, steps, Path(args.out))
    return base, vs, seeds, steps, runs, rounds


@command
def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the sweep, then write the report; exit 2 on bad input, 1 on divergence."""
    args = parse_args(argv)
    distributed.initialize()
    base, vs, seeds, steps, runs, rounds = setup(args)
    print(f"ablation: {len(vs)} variants x {len(seeds)} seed(s), {steps} steps each, {len(runs)} runs "
          f"({grid.mode(base)} mode: lr schedule {base.optim.schedule}); run dirs under {args.out}", flush=True)
    if args.report_only:
        seeds = [s for s in seeds if all(sweep.done_step(r) >= r.steps for r in runs if r.seed == s)]
        if not seeds:
            raise ConfigError(f"--report-only: no seed has all its runs complete under {args.out}; run the sweep")
        runs = [r for r in runs if r.seed in seeds]
    elif not sweep.run_all(runs, out=Path(args.out)):
        return 0
    out = Path(args.report or args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {v.name: next(r.cfg for r in runs if r.variant == v and steps in r.stops) for v in vs}
    times = None if args.report_only else timing.cached_measure(Path(args.out), cfgs, rounds)
    res = report.collect(base, runs, vs, seeds, steps, times)
    res["command"] = "python -m bench.ablation " + shlex.join(sys.argv[1:] if argv is None else argv)
    res["sweep_load"] = report.loads(Path(args.out))
    res["summary"] = report.summary(res)
    from bench.ablation.plots import make_plots

    res["plots"] = make_plots(res, out)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out / "results.json")
    print(report.table(res))
    print(f"results: {out / 'results.json'}; plots: {', '.join(res['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
