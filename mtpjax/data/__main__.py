"""`python -m mtpjax.data prepare --config X [section.key=value ...]`: build the cached corpus and summarise it."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input, with a one-line message)."""
    parser = argparse.ArgumentParser(prog="python -m mtpjax.data", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize and cache the corpus of a config")
    p.add_argument("--config", default=None, help="YAML config (default: all defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.tokenizer=bpe")
    args = parser.parse_args(argv)

    from mtpjax.config import ConfigError, load_config
    from mtpjax.data import DataError, check_vocab, check_vocab_early, prepare, summary

    try:
        cfg = load_config(args.config, args.overrides)
        check_vocab_early(cfg.data, cfg.model.vocab_size)
        prepared = prepare(cfg.data, progress=sys.stderr.isatty())
        check_vocab(prepared.tokenizer, cfg.model.vocab_size)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(prepared))
    return 0


if __name__ == "__main__":
    sys.exit(main())
