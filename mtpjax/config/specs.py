"""Values written in YAML as one string and parsed once, at load time, into typed values code reads."""

from __future__ import annotations

import abc
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, Self

from mtpjax.config.errors import fail


class Spec(abc.ABC):
    """A config value written as one string: `parse` reads it (ConfigError naming the key), `str` writes it back."""

    KEY: ClassVar[str]  # the config key it is read from (named in errors)
    FORMS: ClassVar[str]  # the accepted forms, for errors and the reference page

    @classmethod
    @abc.abstractmethod
    def parse(cls, text: str, key: str | None = None) -> Self:
        """The value `text` writes; ConfigError naming `key` (default KEY) unless it is one of FORMS."""

    @abc.abstractmethod
    def __str__(self) -> str:
        """The canonical string: parse(str(x)) == x."""


LambdaKind = Literal["constant", "piecewise", "linear", "cosine"]
_NUM = r"[-+.\deE]+"
_RAMP = re.compile(rf"^(?P<a>{_NUM})->(?P<b>{_NUM})@(?P<n>\d+)$")
_LAMBDA_RE = {"constant": re.compile(rf"^{_NUM}$"), "piecewise": re.compile(rf"^(?:{_NUM}@\d+,)+{_NUM}$"),
              "linear": _RAMP, "cosine": _RAMP}


@dataclass(frozen=True)
class LambdaSchedule(Spec):
    """λ(step), the weight of the MTP losses: a kind and its numbers (nn/loss.py turns it into a schedule)."""

    kind: LambdaKind
    values: tuple[float, ...]  # constant: (v,); piecewise: one per stretch; linear, cosine: (start, end)
    steps: tuple[int, ...] = ()  # piecewise: where each later stretch starts; linear, cosine: (ramp length,)

    KEY: ClassVar[str] = "loss.mtp_lambda"
    FORMS: ClassVar[str] = "constant:0.3 | piecewise:0.3@1000,0.1 | linear:0.3->0.1@1000 | cosine:0.3->0.1@1000"

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> LambdaSchedule:
        """`kind:body` (a bare number is constant); ConfigError unless one of FORMS with finite numbers."""
        bad = fail(key or cls.KEY, text, f"expected one of {cls.FORMS} (finite numbers, steps > 0)")
        spec = text.replace(" ", "")
        kind, _, body = spec.partition(":")
        if not body:
            kind, body = "constant", spec
        pattern = _LAMBDA_RE.get(kind)
        if pattern is None or not pattern.match(body):
            raise bad
        try:
            if kind == "constant":
                out = cls(kind, (float(body),))
            elif kind == "piecewise":
                *pieces, last = body.split(",")
                out = cls(kind, (*(float(p.split("@")[0]) for p in pieces), float(last)),
                          tuple(int(p.split("@")[1]) for p in pieces))
                if any(s1 >= s2 for s1, s2 in zip(out.steps, out.steps[1:])):
                    raise bad
            else:
                m = pattern.match(body)
                out = cls(kind, (float(m["a"]), float(m["b"])), (int(m["n"]),))
                if out.steps[0] <= 0:
                    raise bad
        except ValueError:
            raise bad from None
        if not all(map(math.isfinite, out.values)):  # inf would not survive the saved config's round trip
            raise bad
        return out

    def __str__(self) -> str:
        v = self.values
        if self.kind == "constant":
            return f"constant:{v[0]!r}"
        if self.kind == "piecewise":
            return "piecewise:" + "".join(f"{x!r}@{s}," for x, s in zip(v, self.steps)) + repr(v[-1])
        return f"{self.kind}:{v[0]!r}->{v[1]!r}@{self.steps[0]}"


MtpTarget = Literal["data", "self"]
MTP_TARGETS: tuple[MtpTarget, ...] = typing.get_args(MtpTarget)


@dataclass(frozen=True)
class TargetMix(Spec):
    """What depth k learns: a weight per target in MTP_TARGETS order, summing to 1."""

    weights: tuple[float, ...]

    KEY: ClassVar[str] = "loss.mtp_target"
    FORMS: ClassVar[str] = "data | self | mix:<w> with 0 <= w <= 1 (w self + (1-w) data)"

    def weight(self, target: MtpTarget) -> float:
        return self.weights[MTP_TARGETS.index(target)]

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> TargetMix:
        """A target's name (all weight on it) or mix:<w>; ConfigError otherwise."""
        if text in MTP_TARGETS:
            return cls(tuple(float(t == text) for t in MTP_TARGETS))
        m = re.fullmatch(r"mix:\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", text.strip())
        if not m or not 0 <= float(m[1]) <= 1:
            raise fail(key or cls.KEY, text, f"expected {cls.FORMS}")
        return cls((1 - float(m[1]), float(m[1])))

    def __str__(self) -> str:
        for t in MTP_TARGETS:
            if self.weight(t) == 1:
                return t
        return f"mix:{self.weight('self')!r}"


def parse_profile(spec: str) -> tuple[int, int] | None:
    """train.profile "start:stop" -> (start, stop) with 0 <= start < stop; "" -> None; ConfigError otherwise."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not m or int(m[1]) >= int(m[2]):
        raise fail("train.profile", spec, "expected start:stop with 0 <= start < stop (steps), e.g. 10:15, or empty")
    return int(m[1]), int(m[2])
