"""The config's one error type, its one-line message form, and pydantic's ValidationError read into it."""

from __future__ import annotations

import difflib
import math
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from mtpjax.errors import MtpjaxError


class ConfigError(MtpjaxError, ValueError):
    """A config value is wrong; the message is one line naming the key, the value and what is allowed."""

    def __init__(self, message: str, key: str | None = None, value: Any = None, allowed: str = ""):
        super().__init__(message)
        self.key, self.value, self.allowed = key, value, allowed


def fail(key: str | None, value: Any, allowed: str) -> ConfigError:
    """The error for `key` holding `value`, saying what is allowed (key None: a field validator's, keyed by loc)."""
    return ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}", key, value, allowed)


def bounds(f: FieldInfo) -> str:
    """The interval a number field keeps (`in [0, 1)`, `> 0`, ...); '' if it has none."""
    b = {k: getattr(m, k) for m in f.metadata for k in ("gt", "ge", "lt", "le") if getattr(m, k, None) is not None}
    lo, hi = b.get("gt", b.get("ge")), b.get("lt", b.get("le"))
    if lo is not None and hi is not None:
        return f"in {'[' if 'ge' in b else '('}{_num(lo)}, {_num(hi)}{']' if 'le' in b else ')'}"
    if lo is not None:
        return f"{'>' if 'gt' in b else '>='} {_num(lo)}"
    return f"{'<' if 'lt' in b else '<='} {_num(hi)}" if hi is not None else ""


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)


def _place(raw: Any, loc: tuple) -> list[int]:
    """Where `loc` is written in the input `raw` (the place of each key or item), for reporting in reading order."""
    out = []
    for part in loc:
        keys = [str(k) for k in raw] if isinstance(raw, dict) else range(len(raw)) if isinstance(raw, list) else ()
        if part not in keys:
            break
        out.append(list(keys).index(part))
        raw = list(raw.values())[out[-1]] if isinstance(raw, dict) else raw[part]
    return out


def one_line(e: ValidationError, root: type[BaseModel], prefix: str = "", raw: Any = None) -> ConfigError:
    """The first of pydantic's errors as the one-line ConfigError: a wrong or unknown key first, in the order `raw`
    writes them, then a value outside its choices or bounds, in schema order."""
    def rank(x: dict) -> tuple:
        wrong = x["type"] in ("value_error", "extra_forbidden")
        return (0, _place(raw, x["loc"])) if wrong else (1, [])
    err = min(e.errors(), key=rank)
    loc, cls, f = err["loc"], root, None
    for part in (p for p in loc[:-1] if isinstance(p, str)):  # the section (or a tuple's item section) it names
        tp = cls.model_fields[part].annotation
        cls = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
    if loc and isinstance(loc[-1], str) and loc[-1] in cls.model_fields:
        f = cls.model_fields[loc[-1]]
    key = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if err["type"] == "extra_forbidden":
        names, at = list(cls.model_fields), key.rpartition(".")[0] + "." if "." in key else ""
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"; did you mean '{at}{close[0]}'?" if close else f"; known keys: {', '.join(names)}"
        return ConfigError(f"unknown config key '{key}'{hint}")
    if isinstance(cause := err.get("ctx", {}).get("error"), ConfigError):
        keyed = cause.key is not None or not cause.allowed  # a rule's or a parser's error names its key already
        return cause if keyed else fail(key or "<root>", cause.value, cause.allowed)
    if f is not None and typing.get_origin(f.annotation) is Literal:
        return fail(key, err["input"], f"expected one of {', '.join(typing.get_args(f.annotation))}")
    if f is not None and bounds(f):
        return fail(key, err["input"], f"must be {bounds(f)}")
    return fail(key or "<root>", err["input"], err["msg"])
