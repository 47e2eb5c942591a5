"""Does generated text read as Python? A pure checker for the quickstart test (no model, no I/O).

The rules, applied to the lines a continuation starts (the rest of the prompt's line and a last line cut
off mid-way by the token limit are not judged):
- physical lines join into logical lines while a bracket is open or a line ends in a backslash (as Python
  joins them); a logical line still open at the end of the text is not judged;
- lines inside a triple-quoted string are prose (docstrings) and are neither counted for nor against;
- a *code line* is any other non-blank logical line; a *statement line* is a code line that parses as
  Python on its own (a block header such as `def f(x):` or `else:` parses with a body added; comments
  count); a *keyword line* is a code line that starts, after its indentation, with a Python keyword,
  `self.` or `@`;
- a code line is consistently indented when it is indented by a multiple of 4 spaces, with no tabs, and
  is deeper than the code line before only after a block header (a line ending in `:`); one line in ten
  may break this (a reader still recognises Python around one odd line, and a small model's text has some);
- the text looks like Python when it has at least `min_code_lines` different code lines, at least `min_keyword_lines`
  keyword lines starting with at least two different keywords, at least `min_statement_share` of its
  code lines are statement lines, at least two indentation levels, and at most `max_bad_indent_share` of its
  code lines inconsistently indented.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass, field

_KEYWORDS = frozenset(keyword.kwlist) | {"match", "case"}
_FIRST_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_TRIPLE = re.compile(r'"""|\'\'\'')
# a header whose body is elsewhere: parsing it alone needs a block before it (elif/else/except/finally)
_NEEDS_IF = ("elif", "else")
_NEEDS_TRY = ("except", "finally")


@dataclass
class PythonishReport:
    """What the checker counted, and the verdict with the reasons it failed."""

    code_lines: int = 0
    distinct_code_lines: int = 0
    keyword_lines: int = 0
    keywords: set = field(default_factory=set)
    statement_lines: int = 0
    indent_levels: set = field(default_factory=set)
    bad_indents: list = field(default_factory=list)
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _parses(stmt: str) -> bool:
    """Whether one dedented line parses as a Python statement (block headers get a body)."""
    s = stmt.rstrip()
    body = "\n    pass" if _is_header(s) else ""
    word = (_FIRST_WORD.match(s) or [""])[0]
    pre = "if 1:\n    pass\n" if word in _NEEDS_IF else "try:\n    pass\n" if word in _NEEDS_TRY else ""
    if word == "try":
        body += "\nfinally:\n    pass"
    if word == "case":
        pre, body = "match x:\n    ", "\n        pass"
    try:
        ast.parse(pre + s + body)
        return True
    except (SyntaxError, ValueError):
        return False


_STRING = re.compile(r"'[^'\\\n]*(?:\\.[^'\\\n]*)*'|\"[^\"\\\n]*(?:\\.[^\"\\\n]*)*\"")


def _code(line: str) -> str:
    """A line without its one-line string literals and its comment (good enough to count brackets and colons)."""
    return _STRING.sub("''", line).split("#")[0]


def _is_header(line: str) -> bool:
    """Whether a line opens a block (ends in `:` before any comment)."""
    return _code(line).rstrip().endswith(":")


def _open_brackets(line: str) -> int:
    """Net unclosed (, [, { on a line, outside one-line string literals and comments."""
    code = _code(line)
    return sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")


_STATEMENT = re.compile(r"(def|class|return|if|elif|else|for|while|with|try|except|finally|import|from|raise)\b|@")


def _new_statement(line: str, first: str) -> bool:
    """Whether `line` starts a statement at or left of the indentation of `first` (an open logical line's start)."""
    stripped = line.lstrip(" ")
    return bool(_STATEMENT.match(stripped)) and len(line) - len(stripped) <= len(first) - len(first.lstrip(" "))


def logical_lines(text: str) -> list[tuple[int, str, bool]]:
    """(first physical line, text, is_prose) per logical line; brackets and backslashes join physical lines.

    Docstring lines are prose; a logical line still open when the text ends (cut off mid-call) is dropped.
    A line opening a statement (`def`, `return`, ...) no deeper than an open logical line's first line ends
    that logical line: its bracket was never closed (a human reader does the same; Python would not parse it).
    """
    out, buf, depth, in_string = [], [], 0, False
    for i, line in enumerate(text.split("\n")):
        if in_string:
            out.append((i, line, True))
            in_string = len(_TRIPLE.findall(line)) % 2 == 0
            continue
        if buf and _new_statement(line, buf[0]):  # a bracket never closed: that line ends there, broken
            out.append((i - len(buf), "\n".join(buf), False))
            buf, depth = [], 0
        buf.append(line)
        start = i - len(buf) + 1
        if len(_TRIPLE.findall(line)) % 2:  # a triple-quoted string opens here: it ends the logical line
            in_string = True
            out.append((start, "\n".join(buf) + _TRIPLE.findall(line)[-1], False))  # closed, so it parses
            buf, depth = [], 0
            continue
        depth = max(0, depth + _open_brackets(line))
        if depth == 0 and not line.rstrip().endswith("\\"):
            out.append((start, "\n".join(buf), False))
            buf = []
    return out


def check_pythonish(continuation: str, prompt: str = "", *, min_code_lines: int = 5, min_keyword_lines: int = 3,
                    min_statement_share: float = 0.6, max_bad_indent_share: float = 0.1) -> PythonishReport:
    """Judge whether `continuation` (generated after `prompt`) reads as Python; see the module docstring."""
    rep = PythonishReport()
    # Judged: logical lines starting after the prompt's last line (which the continuation may extend), up to a
    # last line cut off by the token limit. The prompt's lines still set the indentation context.
    first = prompt.count("\n") + (0 if prompt == "" or prompt.endswith("\n") else 1)
    text = prompt + continuation
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    distinct = set()
    prev_indent, prev_opens = None, False  # previous code line: indentation, and whether it opens a block
    for start, line, prose in logical_lines(text):
        if prose or not line.strip():
            continue  # docstring prose and blank lines are not judged
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        judged = start >= first
        comment = stripped.startswith("#")  # Python ignores a comment line's indentation, and so do we
        if judged:
            rep.code_lines += 1
            distinct.add(line)
            if not comment:
                rep.indent_levels.add(indent)
            if not comment and (stripped.startswith("\t") or indent % 4 or (
                    prev_indent is not None and indent > prev_indent and not prev_opens)):
                rep.bad_indents.append(line)
            word = (_FIRST_WORD.match(stripped) or [""])[0]
            kw = word if word in _KEYWORDS else "self." if stripped.startswith("self.") else \
                "@" if stripped.startswith("@") else None
            if kw is not None:
                rep.keyword_lines += 1
                rep.keywords.add(kw)
            rep.statement_lines += _parses(stripped)
        if not comment:
            prev_indent, prev_opens = indent, _is_header(stripped)
    rep.distinct_code_lines = len(distinct)
    if rep.distinct_code_lines < min_code_lines:
        rep.failures.append(f"{rep.distinct_code_lines} different code lines (need {min_code_lines})")
    if rep.keyword_lines < min_keyword_lines or len(rep.keywords) < 2:
        rep.failures.append(f"{rep.keyword_lines} lines start with a keyword, self. or @ ({sorted(rep.keywords)}); "
                            f"need {min_keyword_lines}, with two different ones")
    if rep.code_lines and rep.statement_lines < min_statement_share * rep.code_lines:
        rep.failures.append(f"{rep.statement_lines} of {rep.code_lines} code lines parse as Python statements "
                            f"(need {min_statement_share:.0%})")
    if len(rep.indent_levels) < 2:
        rep.failures.append(f"indentation levels {sorted(rep.indent_levels)} (need two or more)")
    if len(rep.bad_indents) > max_bad_indent_share * rep.code_lines:
        rep.failures.append(f"{len(rep.bad_indents)} of {rep.code_lines} code lines inconsistently indented "
                            f"(at most {max_bad_indent_share:.0%}), e.g. {rep.bad_indents[0]!r}")
    return rep

