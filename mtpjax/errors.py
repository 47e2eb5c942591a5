"""The package's error base: every bad input or refused run is an MtpjaxError, printed by its command as one line."""

from __future__ import annotations

from typing import Any


class MtpjaxError(Exception):
    """A problem the user can fix; the message is one line naming the problem and the fix."""

    exit_status = 2  # the command's exit status: bad input (a divergence, NonFiniteError, is 1)


class MtpjaxWarning(UserWarning):
    """Something the user should know that does not stop the work; a command prints it as one `warning:` line."""


class SpellingError(MtpjaxError, ValueError):
    """`value` is none of its type's spellings; the message is what is allowed (the config adds the key)."""

    def __init__(self, value: Any, allowed: str):
        super().__init__(allowed)
        self.value = value


def first_line(e: BaseException, *, typed: bool = False) -> str:
    """The first line of `e`'s message, after `Type: ` if typed; cut at 200 characters unless it is ours."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0] if isinstance(e, MtpjaxError) else text.splitlines()[0][:200]
    return f"{type(e).__name__}: {line}" if typed else line
