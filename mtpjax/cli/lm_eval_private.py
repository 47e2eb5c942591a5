"""The lm-eval internals `python -m mtpjax lm_eval` uses, in one place: lm_eval._cli's HarnessCLI, its parsers
(`_parser`, `_subparsers`) and `execute`, lm-eval's own command line with no public entry that returns its parsers.
`tests/test_private_apis.py` fails, naming the upgrade, when an lm-eval release moves them. Written against lm-eval
WRITTEN_AGAINST (pyproject.toml's `eval` extra pins it)."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from collections.abc import Callable

WRITTEN_AGAINST = "0.4.13"


@dataclass(frozen=True)
class HarnessParsers:
    """lm-eval's command line as mtpjax drives it: the top parser, its subcommands' parsers, and running parsed
    arguments."""

    parser: argparse.ArgumentParser
    commands: dict[str, argparse.ArgumentParser]
    execute: Callable[[argparse.Namespace], object]


def harness_parsers() -> HarnessParsers:
    """A fresh lm_eval._cli.HarnessCLI's parsers."""
    cli = importlib.import_module("lm_eval._cli").HarnessCLI()
    return HarnessParsers(cli._parser, dict(cli._subparsers.choices), cli.execute)


def moved() -> list[str]:
    """One line naming what this lm-eval no longer has where mtpjax reads it (empty: all present)."""
    from importlib.metadata import version

    try:
        p = harness_parsers()
        ok = isinstance(p.parser, argparse.ArgumentParser) and "run" in p.commands and callable(p.execute)
        what = "" if ok else "a `run` subcommand among HarnessCLI()._subparsers"
    except (ImportError, AttributeError, TypeError) as e:
        what = f"lm_eval._cli.HarnessCLI with _parser, _subparsers and execute ({type(e).__name__}: {e})"
    if not what:
        return []
    return [f"lm-eval {version('lm_eval')} (mtpjax was written against {WRITTEN_AGAINST}) has no {what}, which "
            "mtpjax.cli.lm_eval_private.harness_parsers reads: find its new home in that release"]
