"""What the MTP objective weighs, each a frozen value with its one spelling and its meaning at a step.

    LambdaSchedule  λ(step), the MTP losses' weight (`loss.mtp_lambda`: `0.3`, `linear:0.3->0.1@1000`, ...)
    DepthLambdas    λ per scored application (`loss.mtp_lambda_depths`: empty, `forward:500~100`, `0.3;0.1`)
    TargetMix       what depth k learns (`loss.mtp_target`: `data`, `self`, `tv`, `mix:0.5`, ...)

Parsed once when the config loads (a bad spelling is a SpellingError, which the config names its key in) and
evaluated inside the jitted train step, so a spelling and what it means are read in one place.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mtpjax.errors import SpellingError

if TYPE_CHECKING:
    import jax


_NUM = r"[-+.\deE]+"
_RAMP = re.compile(rf"^{_NUM}->{_NUM}@\d+$")
_LAMBDA_RE = {"constant": re.compile(rf"^{_NUM}$"), "piecewise": re.compile(rf"^(?:{_NUM}@\d+,)+{_NUM}$"),
              "linear": _RAMP, "cosine": _RAMP}


@dataclass(frozen=True)
class LambdaSchedule:
    """λ(step), the weight of the MTP losses: a kind and its numbers; called at a step, λ (an optax.Schedule)."""

    kind: Literal["constant", "piecewise", "linear", "cosine"]
    values: tuple[float, ...]  # constant: (v,); piecewise: one per stretch; linear, cosine: (start, end)
    steps: tuple[int, ...] = ()  # piecewise: where each later stretch starts; linear, cosine: (ramp length,)

    FORMS: typing.ClassVar[str] = ("constant:0.3 | piecewise:0.3@1000,0.1 | linear:0.3->0.1@1000 | "
                                   "cosine:0.3->0.1@1000")

    @classmethod
    def parse(cls, text: str) -> LambdaSchedule:
        """`kind:body` (a bare number is constant); SpellingError unless one of FORMS with finite numbers >= 0."""
        bad = SpellingError(text, f"expected one of {cls.FORMS} (finite numbers >= 0, steps > 0)")
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
        if steps != tuple(sorted(set(steps))) or not ramp_ok or not all(0 <= v < math.inf for v in values):
            # steps out of order, an empty ramp, inf (which would not load again), or a negative weight (the MTP
            # heads trained to predict wrongly: the objective has no lower bound)
            raise bad
        return cls(kind, values, steps)

    def __str__(self) -> str:
        v = self.values
        if self.kind == "constant":
            return f"constant:{v[0]!r}"
        if self.kind == "piecewise":
            return "piecewise:" + "".join(f"{x!r}@{s}," for x, s in zip(v, self.steps)) + repr(v[-1])
        return f"{self.kind}:{v[0]!r}->{v[1]!r}@{self.steps[0]}"

    def __call__(self, step) -> jax.Array:
        """λ at `step` (float32; traceable)."""
        import jax.numpy as jnp  # here: a config (and a command's bad input) loads without JAX
        import optax

        v = self.values
        if self.kind == "constant":
            return jnp.asarray(v[0], jnp.float32)
        if self.kind == "piecewise":
            return jnp.asarray(v, jnp.float32)[jnp.searchsorted(jnp.asarray(self.steps), step, side="right")]
        (a, b), (n,) = v, self.steps
        if self.kind == "linear":
            return jnp.asarray(optax.linear_schedule(a, b, n)(step), jnp.float32)
        # Written out rather than optax.cosine_decay_schedule, whose end value is init*alpha (wrong for init=0).
        return jnp.asarray(b + (a - b) * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(step, n) / n)), jnp.float32)


@dataclass(frozen=True)
class DepthLambdas:
    """λ per scored MTP application (depths 1..D, then the unrolled ones): the same for all, a curriculum, or a list."""

    kind: Literal["same", "forward", "reverse", "each"]
    every: int = 0  # forward, reverse: application a switches on (off) at a·every (at (A+1-a)·every)
    ramp: int = 0  # forward, reverse: steps over which it ramps in (out) linearly; 0 switches at once
    each: tuple[LambdaSchedule, ...] = ()  # each: one schedule per application

    FORMS: typing.ClassVar[str] = ("empty (every application follows loss.mtp_lambda) | forward:<n>[~<ramp>] | "
                                   "reverse:<n>[~<ramp>] | one loss.mtp_lambda form per application, separated by ';'")

    @classmethod
    def parse(cls, text: str) -> DepthLambdas:
        """The curriculum `text` writes; SpellingError unless one of FORMS (steps > 0)."""
        body = text.replace(" ", "")
        if not body:
            return cls("same")
        if m := re.fullmatch(r"(forward|reverse):(\d+)(?:~(\d+))?", body):
            if int(m[2]) <= 0:
                raise SpellingError(text, f"expected {cls.FORMS}: the step <n> must be > 0")
            return cls(m[1], int(m[2]), int(m[3] or 0))
        if body.partition(":")[0] in ("forward", "reverse"):
            raise SpellingError(text, f"expected {cls.FORMS}")
        return cls("each", each=tuple(LambdaSchedule.parse(s) for s in body.split(";")))

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

    def at(self, step, base: LambdaSchedule, apps: int) -> jax.Array:
        """float32[apps]: λ of each scored application at `step`, over the shared schedule `base` (loss.mtp_lambda)."""
        import jax.numpy as jnp  # here: a config loads without JAX

        if not apps:
            return jnp.zeros((0,), jnp.float32)
        if self.kind == "each":
            return jnp.stack([lam(step) for lam in self.each])
        if self.kind == "same":
            return jnp.broadcast_to(base(step), (apps,))
        at = jnp.asarray(self.switch_steps(apps), jnp.float32)
        # forward: off before the switch, then (ramping to) on; reverse: on, then (ramping to) off at the switch.
        ahead = (step - at) if self.kind == "forward" else (at - step)
        gate = jnp.clip(ahead / self.ramp, 0, 1) if self.ramp else (ahead >= 0 if self.kind == "forward" else ahead > 0)
        return base(step) * gate.astype(jnp.float32)


MtpTarget = Literal["data", "self", "tv"]
MTP_TARGETS: tuple[MtpTarget, ...] = typing.get_args(MtpTarget)
_WEIGHT = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


@dataclass(frozen=True)
class TargetMix:
    """What depth k learns: a weight per target in MTP_TARGETS order, summing to 1."""

    weights: tuple[float, ...]

    FORMS: typing.ClassVar[str] = ("data | self | tv | mix:<w> with 0 <= w <= 1 (w self + (1-w) data) | "
                                   "mix:data=<w>,self=<w>,tv=<w> (weights >= 0 summing to 1; a name left out weighs 0)")

    def weight(self, target: MtpTarget) -> float:
        return self.weights[MTP_TARGETS.index(target)]

    @classmethod
    def parse(cls, text: str) -> TargetMix:
        """A target's name (all weight on it), mix:<w> or mix:name=<w>,...; SpellingError otherwise."""
        if text in MTP_TARGETS:
            return cls(tuple(float(t == text) for t in MTP_TARGETS))
        bad, body = SpellingError(text, f"expected {cls.FORMS}"), text.replace(" ", "")
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
