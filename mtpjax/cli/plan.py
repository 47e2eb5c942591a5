"""`python -m mtpjax plan --config X [overrides...]`: the MTP plan of a run, printed before launch."""

from __future__ import annotations

import sys

from mtpjax.cli.args import Parser, command
from mtpjax.config import load_config
from mtpjax.eval.evidence import evidence_lines
from mtpjax.eval.plan import build_plan, format_plan


@command
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input, with a one-line error)."""
    ap = Parser(prog="python -m mtpjax plan", description="Print the MTP plan of a run before launch.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny.yaml")
    ap.add_argument("--alpha", type=float, default=0.8, help="per-draft acceptance rate in [0, 1]")
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="draft/target forward cost ratio c for every gamma (default: the FLOPs MTP drafting computes)")
    ap.add_argument("--max-gamma", type=int, default=None, help="largest number of drafts to tabulate (default D+2)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides such as model.mtp_depth=3")
    args = ap.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        ap.error(f"--alpha {args.alpha} must be in [0, 1]")
    if args.draft_cost is not None and args.draft_cost < 0:
        ap.error(f"--draft-cost {args.draft_cost} must be >= 0")
    if args.max_gamma is not None and args.max_gamma < 1:
        ap.error(f"--max-gamma {args.max_gamma} must be >= 1")
    cfg = load_config(args.config, args.overrides)
    plan = build_plan(cfg, args.alpha, args.draft_cost, args.max_gamma)
    print(format_plan(plan, cfg))
    print("\n".join(evidence_lines(plan["params"]["trunk"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
