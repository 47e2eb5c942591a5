"""Values written in YAML as one string and parsed once, at load time, into typed values code reads."""

from __future__ import annotations

import abc
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, Self

from mtpjax import drafts
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


MtpTarget = Literal["data", "self", "tv"]
MTP_TARGETS: tuple[MtpTarget, ...] = typing.get_args(MtpTarget)
_WEIGHT = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


@dataclass(frozen=True)
class TargetMix(Spec):
    """What depth k learns: a weight per target in MTP_TARGETS order, summing to 1."""

    weights: tuple[float, ...]

    KEY: ClassVar[str] = "loss.mtp_target"
    FORMS: ClassVar[str] = ("data | self | tv | mix:<w> with 0 <= w <= 1 (w self + (1-w) data) | "
                            "mix:data=<w>,self=<w>,tv=<w> (weights >= 0 summing to 1; a name left out weighs 0)")

    def weight(self, target: MtpTarget) -> float:
        return self.weights[MTP_TARGETS.index(target)]

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> TargetMix:
        """A target's name (all weight on it), mix:<w> or mix:name=<w>,...; ConfigError otherwise."""
        if text in MTP_TARGETS:
            return cls(tuple(float(t == text) for t in MTP_TARGETS))
        bad = fail(key or cls.KEY, text, f"expected {cls.FORMS}")
        body = text.replace(" ", "")
        if m := re.fullmatch(rf"mix:({_WEIGHT})", body):
            if not 0 <= float(m[1]) <= 1:
                raise bad
            return cls((1 - float(m[1]), float(m[1]), 0.0))
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


CurriculumKind = Literal["same", "forward", "reverse", "each"]


@dataclass(frozen=True)
class DepthLambdas(Spec):
    """λ per scored MTP application (depths 1..D, then the unrolled ones): the same for all, a curriculum, or a list."""

    kind: CurriculumKind
    every: int = 0  # forward, reverse: application a switches on (off) at a·every (at (A+1-a)·every)
    ramp: int = 0  # forward, reverse: steps over which it ramps in (out) linearly; 0 switches at once
    each: tuple[LambdaSchedule, ...] = ()  # each: one schedule per application

    KEY: ClassVar[str] = "loss.mtp_lambda_depths"
    FORMS: ClassVar[str] = ("empty (every application follows loss.mtp_lambda) | forward:<n>[~<ramp>] | "
                            "reverse:<n>[~<ramp>] | one loss.mtp_lambda form per application, separated by ';'")

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> DepthLambdas:
        """The curriculum `text` writes; ConfigError unless one of FORMS (steps > 0)."""
        key = key or cls.KEY
        body = text.replace(" ", "")
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
        if self.kind == "same":
            return ""
        if self.kind == "each":
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


@dataclass(frozen=True)
class DecodeDraft(Spec):
    """decode.draft: what a request drafts (mtpjax.drafts: a tree whose nodes say their source, or auto)."""

    value: drafts.Tree | drafts.Auto = drafts.Auto()

    KEY: ClassVar[str] = "decode.draft"
    FORMS: ClassVar[str] = drafts.FORMS

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> DecodeDraft:
        """The draft `text` spells; ConfigError naming the key otherwise."""
        try:
            return cls(drafts.parse(text))
        except drafts.DraftError as e:
            raise fail(key or cls.KEY, text, str(e)) from None

    def __str__(self) -> str:
        return self.value.name()
