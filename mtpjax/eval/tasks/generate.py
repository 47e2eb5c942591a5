"""Write the shipped tasks' JSONL from the held-out split of the embedded corpus; run once, its output committed.

`python -m mtpjax.eval.tasks.generate` reads the running interpreter's stdlib files that data.source=stdlib puts in
the validation split (sources.is_val at the default data.val_fraction), never a training file, and writes:

    nextline.jsonl   multiple choice: which of four lines follows a file's preceding lines (three distractors
                     from other held-out files, at the same indentation)
    funcret.jsonl    generation: a short function's last line, given the function up to it
    heldout.jsonl    rolling loglikelihood: the first lines of each held-out file

The files are committed, so a task does not change with the Python version that runs it (meta.json says which
stdlib made them).
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

from mtpjax.config import DataConfig
from mtpjax.data import sources

HERE = Path(__file__).resolve().parent
CONTEXT_LINES = 8  # lines before the one to choose
NEXTLINE_DOCS, FUNCRET_DOCS, HELDOUT_CHARS = 200, 150, 1500


def heldout_files() -> list[tuple[str, str]]:
    """(key, text) of the stdlib files the embedded corpus holds out for validation."""
    frac = DataConfig().val_fraction
    return [(key, path.read_text(errors="replace")) for path, key in sources.stdlib_files()
            if sources.is_val(key, frac)]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _candidate(line: str) -> bool:
    """A line worth choosing: code of modest length, not a comment."""
    s = line.strip()
    return 8 <= len(s) <= 100 and not s.startswith("#")


def nextline(files, rng: random.Random) -> list[dict]:
    """Multiple-choice docs: {context, choices, gold}."""
    pool = [ln for _, text in files for ln in text.splitlines() if _candidate(ln)]
    by_indent: dict[str, list[str]] = {}
    for ln in pool:
        by_indent.setdefault(_indent(ln), []).append(ln)
    spots = []
    for key, text in files:
        lines = text.splitlines()
        for i in range(CONTEXT_LINES, len(lines)):
            ctx = lines[i - CONTEXT_LINES: i]
            others = [c for c in by_indent.get(_indent(lines[i]), []) if c != lines[i]]
            if _candidate(lines[i]) and sum(bool(c.strip()) for c in ctx) >= 4 and len(set(others)) >= 3:
                spots.append((key, ctx, lines[i], sorted(set(others))))
    docs = []
    for key, ctx, line, others in rng.sample(spots, min(NEXTLINE_DOCS, len(spots))):
        choices = [line, *rng.sample(others, 3)]
        rng.shuffle(choices)
        docs.append({"file": key, "context": "\n".join(ctx) + "\n", "choices": choices, "gold": choices.index(line)})
    return docs


def _short_functions(key: str, text: str):
    """(key, def line up to the last line, the last line) of each 2-8 line function ending in a one-line statement."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first, last = node.lineno, node.end_lineno
        stmt = node.body[-1]
        if 2 <= last - first + 1 <= 8 and stmt.lineno == stmt.end_lineno == last and _candidate(lines[last - 1]):
            yield key, "\n".join(lines[first - 1: last - 1]) + "\n", lines[last - 1].strip()


def funcret(files, rng: random.Random) -> list[dict]:
    """Generation docs: {prompt, target} (the target without its indentation)."""
    found = [f for key, text in files for f in _short_functions(key, text)]
    return [{"file": k, "prompt": p, "target": t} for k, p, t in rng.sample(found, min(FUNCRET_DOCS, len(found)))]


def heldout(files) -> list[dict]:
    """Rolling-loglikelihood docs: {text}, each file's first lines up to HELDOUT_CHARS."""
    docs = []
    for key, text in files:
        cut = text[:HELDOUT_CHARS]
        cut = cut[: cut.rfind("\n") + 1] or cut
        if cut.strip():
            docs.append({"file": key, "text": cut})
    return docs


def write(name: str, docs: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Write the task files; `--help` prints what they are, any other argument is one line, exit 2: neither writes."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):  # said, not run: a run rewrites the committed files (from this stdlib)
        print(__doc__)
        return 0
    if args:
        print(f"error: unrecognized arguments: {' '.join(args)} (python -m mtpjax.eval.tasks.generate takes none; "
              "--help says what it writes)", file=sys.stderr)
        return 2
    files = heldout_files()
    write("nextline.jsonl", nextline(files, random.Random(0)))
    write("funcret.jsonl", funcret(files, random.Random(1)))
    write("heldout.jsonl", heldout(files))
    meta = {"python": sys.version.split()[0], "files": [k for k, _ in files]}
    (HERE / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
