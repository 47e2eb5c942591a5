"""What a process shows on stderr: progress bars that redraw in a terminal and print one line when piped.

Status lines go through `tqdm.write` (the bars' own writer: it lifts a bar, prints the line, redraws the bar), so a
line never lands glued to the end of a bar. Piped to a file or a CI log, a bar's redraws would be one long line of
carriage returns, and its closing redraw would repeat the last state: there a bar prints nothing while it runs and
one line, its final state, when its phase ends (none for a bar that leaves nothing behind, `leave=False`).
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class _FinalLine:
    """A stream for a piped bar: keeps the latest redraw and writes it, once, when the bar ends its line."""

    def __init__(self):
        self.line = ""

    @property
    def encoding(self) -> str:
        return getattr(sys.stderr, "encoding", None) or "utf-8"

    def write(self, s: str) -> int:
        if s == "\n":  # the bar closed with leave=True: its final state is the phase's one line
            if self.line:
                sys.stderr.write(self.line + "\n")
            self.line = ""
        elif s:
            self.line = s.rsplit("\r", 1)[-1].rstrip()
        return len(s)

    def flush(self) -> None:
        sys.stderr.flush()


def live() -> bool:
    """Whether stderr is a terminal, where bars redraw (else piped: a file, a CI or scheduler log)."""
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def bar(total: int, *, enabled: bool = True, leave: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr (kw: tqdm's desc, unit, initial, ...): redrawn in a terminal, one final line when piped."""
    return tqdm(total=total, disable=not enabled, leave=leave, file=sys.stderr if live() else _FinalLine(), **kw)


def say(text: str) -> None:
    """A status line on stderr, written above any bar (tqdm.write lifts and redraws it)."""
    tqdm.write(text, file=sys.stderr)
