"""Decode speed, side by side in one process: plain greedy vs MTP and n-gram speculation at batch 1 and 8.

    python bench/decode_speed.py [--run-dir runs/tiny] [--num-draft 2] [--max-new 128] [--prompts 8]

Prints tokens/s, the speculative/plain ratios, acceptance by position, and the speedup E/(v + γc)
predicts from the measured α, c and v. Needs a trained run (the README's main command makes runs/tiny).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument("--num-draft", type=int, default=None, help="default: the model's mtp_depth")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)

    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    from mtpjax.checkpoint import CheckpointError, load_model
    from mtpjax.data import prepare
    from mtpjax.evaluate import heldout_prompts, speed_report

    try:
        cfg, model, tok = load_model(args.run_dir)
    except CheckpointError as e:
        print(f"error: {e} (the README's main command trains runs/tiny)", file=sys.stderr)
        return 2
    gamma = args.num_draft if args.num_draft is not None else max(1, cfg.model.mtp_depth)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompts = heldout_prompts(prepare(cfg.data).val_tokens, max(args.prompts, b), args.prompt_len, tok.eos_id)
        rows.append(speed_report(model, prompts, num_draft=gamma, max_new=args.max_new, batch=b, repeats=args.repeats))
    print(f"{'batch':>5} {'plain tok/s':>12} {'mtp tok/s':>10} {'mtp/plain':>10} {'predicted':>10} "
          f"{'ngram tok/s':>12} {'ngram/plain':>12} {'tok/round':>10} {'alpha by position':>20} {'exact':>6}")
    for r in rows:
        alpha = "[" + ",".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])) + "]"
        print(f"{r['batch']:>5} {r['plain_tokens_per_sec']:>12.1f} {r.get('mtp_tokens_per_sec', 0):>10.1f} "
              f"{r.get('speedup', 0):>10.2f} {r.get('predicted_speedup', 0):>10.2f} {r['ngram_tokens_per_sec']:>12.1f} "
              f"{r['ngram_speedup']:>12.2f} {r.get('tokens_per_round', 0):>10.2f} {alpha:>20} "
              f"{r['outputs_identical']!s:>6}")
    print(f"num_draft={gamma}; costs relative to one plain round: " + "; ".join(
        f"batch {r['batch']}: v={r['verify_cost_v']:.2f} c={r.get('draft_cost_c', 0):.2f}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
