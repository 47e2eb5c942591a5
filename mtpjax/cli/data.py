"""`python -m mtpjax data prepare|inspect --config X [section.key=value ...]`: build the cached corpus; show its use.

prepare: tokenize and cache the corpus (every source of a mixture) and summarise it.
inspect: per source, documents and tokens, the first documents and sample training windows with their
segment ids decoded: what the model will be fed.
"""

from __future__ import annotations

import sys

from mtpjax.cli.args import Parser, command


@command
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad input, with a one-line message)."""
    parser = Parser(prog="python -m mtpjax data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("prepare", "tokenize and cache the corpus of a config"),
                       ("inspect", "show documents, tokens and decoded sample windows per source")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None, help="YAML config (default: all defaults)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.tokenizer=bpe")
        if name == "inspect":
            p.add_argument("--docs", type=int, default=3, help="documents shown per source")
            p.add_argument("--windows", type=int, default=2, help="training windows shown per source")
            p.add_argument("--width", type=int, default=120, help="characters shown per text")
    args = parser.parse_args(argv)

    from mtpjax.config import load_config
    from mtpjax.data import check_vocab, check_vocab_early, prepare, summary

    cfg = load_config(args.config, args.overrides)
    check_vocab_early(cfg.data, cfg.model.vocab_size)
    prepared = prepare(cfg.data, progress=sys.stderr.isatty())
    check_vocab(prepared.tokenizer, cfg.model.vocab_size)
    if args.command == "inspect":
        from mtpjax.data.inspection import report

        print(report(cfg, prepared, docs=args.docs, windows=args.windows, width=args.width))
    else:
        print(summary(prepared))
    return 0


if __name__ == "__main__":
    sys.exit(main())
