"""The types of config values: YAML scalars taken as written (no silent casts), values written as one string (parsed
once at load by the type's home, e.g. mtpjax.objective), and the profile window."""

from __future__ import annotations

import contextlib
import math
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, PlainValidator

from mtpjax.config.errors import fail
from mtpjax.errors import SpellingError


def _plain(v: Any, *types: type) -> bool:
    return isinstance(v, types) and not isinstance(v, bool)


def _number(v: Any) -> float:
    """A finite float from a number or a numeric string (YAML reads 3e-4, without a dot, as a string)."""
    with contextlib.suppress(ValueError):
        if _plain(v, int, float, str) and math.isfinite(x := float(v)):  # .inf would pass every "> 0" check
            return x
    raise fail(None, v, "expected a number (not inf or nan)")


def _list(v: Any, one: type | tuple = str) -> Any:
    """A list as given (a lone `one`, e.g. one path, is a list of it; `()`: none is)."""
    if isinstance(v, (list, tuple, one)):
        return [v] if isinstance(v, one) else v
    raise fail(None, v, "expected a list")


def _as(tp: type, ok: typing.Callable[[Any], bool], allowed: str) -> BeforeValidator:
    """A YAML value taken as `tp` only where `ok` (then converted): no silent cast from another type."""
    def check(v: Any) -> Any:
        if ok(v):
            return tp(v)
        raise fail(None, v, allowed)
    return BeforeValidator(check)


_STR = _as(str, lambda v: _plain(v, str, int, float), "expected a string")
Str = Annotated[str, _STR]
# within int64 (what numpy and JAX hold it in: a seed of 10**23 was an OverflowError traceback)
Int = Annotated[int, _as(int, lambda v: (_plain(v, int) or _plain(v, float) and v.is_integer()) and abs(v) < 2**63,
                         "expected an integer (between -2**63 and 2**63)")]
Bool = Annotated[bool, _as(bool, lambda v: isinstance(v, bool), "expected true or false")]
Float = Annotated[float, BeforeValidator(_number)]
Strs = Annotated[tuple[Str, ...], BeforeValidator(_list)]
Ints = Annotated[tuple[Int, ...], BeforeValidator(lambda v: _list(v, int))]


def listed(item: type) -> Any:
    """A tuple of sections (`data.mixture`): a list of mappings."""
    return Annotated[tuple[item, ...], BeforeValidator(lambda v: _list(v, ()))]


def choice(*names: str) -> Any:
    """A field taking one of `names` (a Literal): a string, then one of them (the error lists them)."""
    return Annotated[Literal[names], _STR]


def one_of(doc: str, runtime: bool = False, **meanings: str) -> Any:
    """A choice field documented once: its doc, then each name (the first is the default) with what it means."""
    extra = {"choices": meanings, "runtime": True} if runtime else {"choices": meanings}
    return Annotated[choice(*meanings), Field(next(iter(meanings)), description=doc, json_schema_extra=extra)]


def parsed(tp: Any, read: typing.Callable | None = None, write: typing.Callable = str) -> Any:
    """A value written as one string: `read` (default tp.parse) at load, `write` back; a typed value passes."""
    def validate(v: Any) -> Any:
        if isinstance(v, typing.get_args(tp) or tp):
            return v
        try:
            return (read or tp.parse)(_STR.func(v))
        except SpellingError as e:
            raise fail(None, e.value, str(e)) from None
    return Annotated[tp, PlainValidator(validate), PlainSerializer(write)]


def parse_profile(spec: str) -> tuple[int, int] | None:
    """train.profile "start:stop" -> (start, stop) with 0 <= start < stop; "" -> None; ConfigError otherwise."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not m or int(m[1]) >= int(m[2]):
        raise fail("train.profile", spec, "expected start:stop with 0 <= start < stop (steps), e.g. 10:15, or empty")
    return int(m[1]), int(m[2])
