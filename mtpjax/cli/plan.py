"""`python -m mtpjax plan --config X [overrides...]`: the MTP plan of a run, printed before launch."""

from __future__ import annotations

import math
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
    ap.add_argument("--verify-cost", default="1",
                    help="v(n): one decode forward of n rows over one row's, for the ceiling E/(v(g+1)+g*r): one "
                         "number for every n, or measured rows:v pairs such as 2:1.2,3:1.25,4:1.3 "
                         "(bench/cache_cliff.py --rows); default 1, verification taken as free")
    ap.add_argument("--alpha-rank2", type=float, default=None,
                    help="for the draft trees: the share of rounds in which a node's second child is the one "
                         "accepted (default (1 - alpha)/2; decode.py --eval --tree measures it)")
    ap.add_argument("--max-gamma", type=int, default=None, help="largest number of drafts to tabulate (default D+2)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides such as model.mtp_depth=3")
    args = ap.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        ap.error(f"--alpha {args.alpha} must be in [0, 1]")
    if args.alpha_rank2 is not None and not 0.0 <= args.alpha_rank2 <= 1.0 - args.alpha:
        ap.error(f"--alpha-rank2 {args.alpha_rank2} must be in [0, 1 - alpha]: siblings are accepted exclusively")
    if args.draft_cost is not None and not (math.isfinite(args.draft_cost) and args.draft_cost >= 0):
        ap.error(f"--draft-cost {args.draft_cost} must be a finite number >= 0")
    if args.max_gamma is not None and args.max_gamma < 1:
        ap.error(f"--max-gamma {args.max_gamma} must be >= 1")
    verify = parse_verify_cost(args.verify_cost)
    if verify is None:
        ap.error(f"--verify-cost {args.verify_cost!r} must be a number >= 1 or rows:v pairs with rows >= 1 and "
                 "v >= 1, such as 2:1.2,4:1.3")
    cfg = load_config(args.config, args.overrides)
    plan = build_plan(cfg, args.alpha, args.draft_cost, args.max_gamma, verify, args.alpha_rank2)
    print(format_plan(plan, cfg))
    print("\n".join(evidence_lines(plan["params"]["trunk"])))
    return 0


def parse_verify_cost(text: str) -> float | dict | None:
    """--verify-cost as a number or a {rows: v} table; None when malformed or below one row's cost."""
    try:
        if ":" not in text:
            v = float(text)
            return v if v >= 1.0 else None
        table = {int(n): float(v) for n, v in (pair.split(":") for pair in text.split(","))}
    except ValueError:
        return None
    return table if all(n >= 1 and v >= 1.0 for n, v in table.items()) else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
