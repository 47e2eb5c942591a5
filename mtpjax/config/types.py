"""The types of config values: YAML scalars taken as written (no silent casts), and values written as one string,
parsed once at load into what code reads (the λ schedule, the MTP target mix, the per-depth λ, the profile window)."""

from __future__ import annotations

import contextlib
import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, PlainValidator

from mtpjax.config.errors import fail


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
Int = Annotated[int, _as(int, lambda v: _plain(v, int) or _plain(v, float) and v.is_integer(), "expected an integer")]
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
        return v if isinstance(v, typing.get_args(tp) or tp) else (read or tp.parse)(_STR.func(v))
    return Annotated[tp, PlainValidator(validate), PlainSerializer(write)]


_NUM = r"[-+.\deE]+"
_RAMP = re.compile(rf"^{_NUM}->{_NUM}@\d+$")
_LAMBDA_RE = {"constant": re.compile(rf"^{_NUM}$"), "piecewise": re.compile(rf"^(?:{_NUM}@\d+,)+{_NUM}$"),
              "linear": _RAMP, "cosine": _RAMP}


@dataclass(frozen=True)
class LambdaSchedule:
    """λ(step), the weight of the MTP losses: a kind and its numbers (nn/loss.py turns it into a schedule)."""

    kind: Literal["constant", "piecewise", "linear", "cosine"]
    values: tuple[float, ...]  # constant: (v,); piecewise: one per stretch; linear, cosine: (start, end)
    steps: tuple[int, ...] = ()  # piecewise: where each later stretch starts; linear, cosine: (ramp length,)

    KEY: typing.ClassVar[str] = "loss.mtp_lambda"
    FORMS: typing.ClassVar[str] = ("constant:0.3 | piecewise:0.3@1000,0.1 | linear:0.3->0.1@1000 | "
                                   "cosine:0.3->0.1@1000")

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> LambdaSchedule:
        """`kind:body` (a bare number is constant); ConfigError unless one of FORMS with finite numbers."""
        bad = fail(key or cls.KEY, text, f"expected one of {cls.FORMS} (finite numbers, steps > 0)")
        kind, sep, body = text.replace(" ", "").partition(":")
        kind, body = (kind, body) if sep else ("constant", kind)
        if kind not in _LAMBDA_RE or not _LAMBDA_RE[kind].match(body):
            raise bad
        nums = re.split(r"->|@|,", body)  # piecewise: value@step,...,value; else the values, then the ramp's steps
        values, steps = (nums[::2], nums[1::2]) if kind == "piecewise" else (nums[:2], nums[2:])
        try:
            values, steps = tuple(map(float, values)), tuple(map(int, steps))
        except ValueError:
            raise bad from None
        ramp_ok = kind not in ("linear", "cosine") or steps[0] > 0
        if steps != tuple(sorted(set(steps))) or not ramp_ok or not all(map(math.isfinite, values)):
            raise bad  # steps out of order, an empty ramp, or inf (which would not load again)
        return cls(kind, values, steps)

    def __str__(self) -> str:
        v = self.values
        if self.kind == "constant":
            return f"constant:{v[0]!r}"
        if self.kind == "piecewise":
            return "piecewise:" + "".join(f"{x!r}@{s}," for x, s in zip(v, self.steps)) + repr(v[-1])
        return f"{self.kind}:{v[0]!r}->{v[1]!r}@{self.steps[0]}"


MtpTarget = Literal["data", "self", "tv"]
MTP_TARGETS: tuple[MtpTarget, ...] = typing.get_args(MtpTarget)
_WEIGHT = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


@dataclass(frozen=True)
class TargetMix:
    """What depth k learns: a weight per target in MTP_TARGETS order, summing to 1."""

    weights: tuple[float, ...]

    KEY: typing.ClassVar[str] = "loss.mtp_target"
    FORMS: typing.ClassVar[str] = ("data | self | tv | mix:<w> with 0 <= w <= 1 (w self + (1-w) data) | "
                                   "mix:data=<w>,self=<w>,tv=<w> (weights >= 0 summing to 1; a name left out weighs 0)")

    def weight(self, target: MtpTarget) -> float:
        return self.weights[MTP_TARGETS.index(target)]

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> TargetMix:
        """A target's name (all weight on it), mix:<w> or mix:name=<w>,...; ConfigError otherwise."""
        if text in MTP_TARGETS:
            return cls(tuple(float(t == text) for t in MTP_TARGETS))
        bad, body = fail(key or cls.KEY, text, f"expected {cls.FORMS}"), text.replace(" ", "")
        if re.fullmatch(rf"mix:{_WEIGHT}", body):  # mix:<w> is mix:data=<1-w>,self=<w> (w > 1: a negative weight)
            body = f"mix:data={1 - float(body[4:])!r},self={body[4:]}"
        names = "|".join(MTP_TARGETS)
        if not re.fullmatch(rf"mix:(?:(?:{names})={_WEIGHT},)*(?:{names})={_WEIGHT}", body):
            raise bad
        pairs = [p.split("=") for p in body[4:].split(",")]
        given = {n: float(w) for n, w in pairs}
        if len(given) < len(pairs) or not math.isclose(sum(given.values()), 1.0, abs_tol=1e-9):
            raise bad  # a name twice, or weights that do not sum to 1
        return cls(tuple(given.get(t, 0.0) for t in MTP_TARGETS))

    def __str__(self) -> str:
        for t in MTP_TARGETS:
            if self.weight(t) == 1:
                return t
        if self.weight("tv") == 0:
            return f"mix:{self.weight('self')!r}"
        return "mix:" + ",".join(f"{t}={self.weight(t)!r}" for t in MTP_TARGETS if self.weight(t))


@dataclass(frozen=True)
class DepthLambdas:
    """λ per scored MTP application (depths 1..D, then the unrolled ones): the same for all, a curriculum, or a list."""

    kind: Literal["same", "forward", "reverse", "each"]
    every: int = 0  # forward, reverse: application a switches on (off) at a·every (at (A+1-a)·every)
    ramp: int = 0  # forward, reverse: steps over which it ramps in (out) linearly; 0 switches at once
    each: tuple[LambdaSchedule, ...] = ()  # each: one schedule per application

    KEY: typing.ClassVar[str] = "loss.mtp_lambda_depths"
    FORMS: typing.ClassVar[str] = ("empty (every application follows loss.mtp_lambda) | forward:<n>[~<ramp>] | "
                                   "reverse:<n>[~<ramp>] | one loss.mtp_lambda form per application, separated by ';'")

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> DepthLambdas:
        """The curriculum `text` writes; ConfigError unless one of FORMS (steps > 0)."""
        key, body = key or cls.KEY, text.replace(" ", "")
        if not body:
            return cls("same")
        if m := re.fullmatch(r"(forward|reverse):(\d+)(?:~(\d+))?", body):
            if int(m[2]) <= 0:
                raise fail(key, text, f"expected {cls.FORMS}: the step <n> must be > 0")
            return cls(m[1], int(m[2]), int(m[3] or 0))
        if body.partition(":")[0] in ("forward", "reverse"):
            raise fail(key, text, f"expected {cls.FORMS}")
        return cls("each", each=tuple(LambdaSchedule.parse(s, key) for s in body.split(";")))

    def __str__(self) -> str:
        if self.kind in ("same", "each"):
            return ";".join(map(str, self.each))
        return f"{self.kind}:{self.every}" + (f"~{self.ramp}" if self.ramp else "")

    def switch_steps(self, apps: int) -> list[int]:
        """The step each of `apps` applications switches on (forward) or off (reverse); [] for other kinds."""
        if self.kind == "forward":
            return [a * self.every for a in range(1, apps + 1)]
        if self.kind == "reverse":
            return [(apps + 1 - a) * self.every for a in range(1, apps + 1)]
        return []


def parse_profile(spec: str) -> tuple[int, int] | None:
    """train.profile "start:stop" -> (start, stop) with 0 <= start < stop; "" -> None; ConfigError otherwise."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not m or int(m[1]) >= int(m[2]):
        raise fail("train.profile", spec, "expected start:stop with 0 <= start < stop (steps), e.g. 10:15, or empty")
    return int(m[1]), int(m[2])
