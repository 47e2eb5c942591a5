"""Values written in YAML as one string and parsed once, at load time, into typed values code reads."""

from __future__ import annotations

import abc
import functools
import math
import re
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, Self

from mtpjax.config.errors import fail
from mtpjax.errors import MtpjaxError


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


MAX_TREE_NODES = 64  # verifying more rows than this per round never pays; the drafting loop is unrolled per node


class TreeError(MtpjaxError, ValueError):
    """A draft-tree spec that cannot be built (one line naming the problem and the fix)."""


@dataclass(frozen=True)
class Tree:
    """A static draft tree by its parents (node i continues node parents[i]; -1: the last committed token, the root).
    A chain of γ drafts is the tree `1x1x…x1` (`chain(γ)`): every proposer drafts a tree, most of them chains."""

    parents: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> tuple[int, ...]:
        """Each node's depth (1: a child of the root)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    def children(self, node: int) -> tuple[int, ...]:
        """The nodes continuing `node` (-1: the root), in rank order."""
        return tuple(i for i, p in enumerate(self.parents) if p == node)

    @functools.cached_property
    def rank(self) -> tuple[int, ...]:
        """Each node's place among its siblings (0: drafted first, the likeliest when greedy)."""
        return tuple(self.children(p).index(i) for i, p in enumerate(self.parents))

    def at_depth(self, lo: int, hi: int) -> tuple[int, ...]:
        """The nodes of depths lo..hi, in node order."""
        return tuple(i for i, d in enumerate(self.depth) if lo <= d <= hi)

    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.size - 1))

    def name(self) -> str:
        """`2x2x1` when each depth branches evenly, else the parent list."""
        b = self.branching()
        return "x".join(map(str, b)) if b else ",".join(map(str, self.parents))

    def branching(self) -> tuple[int, ...] | None:
        """The branching factor per depth when every node of a depth has as many children, else None."""
        out = []
        for d in range(self.max_depth):
            counts = {len(self.children(p)) for p in ((-1,) if d == 0 else self.at_depth(d, d))}
            if len(counts) != 1:
                return None
            out.append(counts.pop())
        return tuple(out)

    def ancestors(self, node: int) -> set[int]:
        """The node and its ancestors (the root, -1, included)."""
        out = {node}
        while node >= 0:
            node = self.parents[node]
            out.add(node)
        return out


@dataclass(frozen=True)
class Hybrid:
    """A tree of the MTP modules plus n-gram lookup's chain of `ngram` drafts as the root's last branch."""

    tree: Tree
    ngram: int

    def name(self) -> str:
        return f"{self.tree.name()}+ngram{self.ngram}"


@dataclass(frozen=True)
class Auto:
    """How much to draft is measured per request shape (decode.autodraft)."""


PLAIN = Tree(())  # no drafts: plain decoding is the loop verifying the empty tree
DraftSpec = Tree | Hybrid | Auto  # what a request drafts, parsed once from the user's spellings


def chain(num_draft: int) -> Tree:
    """The tree of a chain of num_draft drafts (each continues the one before it); 0: PLAIN."""
    return Tree(tuple(range(-1, num_draft - 1)))


def nodes(spec: Tree | Hybrid) -> int:
    """Drafts a round verifies."""
    return spec.tree.size + spec.ngram if isinstance(spec, Hybrid) else spec.size


def split_hybrid(spec: str) -> tuple[str, int]:
    """(the MTP tree's spec, the n-gram branch's length) of `2x2+ngram3` (no suffix: 0)."""
    base, plus, tail = spec.strip().partition("+")
    if not plus:
        return base, 0
    n = tail.strip().lower().removeprefix("ngram")
    if not n.isdigit() or not 0 < int(n) <= MAX_TREE_NODES:
        raise TreeError(f"tree {spec!r}: the hybrid branch is +ngramL with L in 1..{MAX_TREE_NODES} n-gram drafts, "
                        "e.g. 2x2+ngram3")
    return base, int(n)


def parse_tree(spec: str) -> Tree:
    """`2x2x1` (children per node at each depth) or a parent list `-1,-1,0,0`; TreeError otherwise."""
    spec = spec.strip()
    try:
        if "," in spec or spec.lstrip("-").isdigit() and spec.startswith("-"):
            parents = tuple(int(x) for x in spec.split(","))
            bad = [i for i, p in enumerate(parents) if not -1 <= p < i]
            if bad:
                raise TreeError(f"tree {spec!r}: node {bad[0]}'s parent {parents[bad[0]]} is not an earlier node or -1 "
                                "(the root); list each node's parent, parents first, e.g. -1,-1,0,0")
        else:
            parents = _branching_parents(spec, tuple(int(x) for x in spec.lower().split("x")))
    except ValueError as e:
        if isinstance(e, TreeError):
            raise
        raise TreeError(f"tree {spec!r} is not a shape; give children per depth as 2x2x1 (each >= 1) or each node's "
                        "parent as -1,-1,0,0") from None
    if not 0 < len(parents) <= MAX_TREE_NODES:
        raise _too_many(spec, len(parents))
    return Tree(parents)


def _branching_parents(spec: str, branching: tuple[int, ...]) -> tuple[int, ...]:
    """The parents of a tree giving every node of depth d branching[d] children."""
    if not branching or min(branching) < 1:
        raise ValueError
    widths = [math.prod(branching[: d + 1]) for d in range(len(branching))]
    if sum(widths) > MAX_TREE_NODES:  # counted before building: 999x999 must not build a million nodes
        raise _too_many(spec, sum(widths))
    built: list[int] = []
    frontier = [-1]
    for b in branching:
        nxt = []
        for p in frontier:
            for _ in range(b):
                nxt.append(len(built))
                built.append(p)
        frontier = nxt
    return tuple(built)


def _too_many(spec: str, nodes: int) -> TreeError:
    return TreeError(f"tree {spec!r} has {nodes} nodes; use 1..{MAX_TREE_NODES} (e.g. 2x2x1, 10 nodes)")


def parse_shape(spec: str) -> Tree | Hybrid:
    """A whole tree value such as `2x2` or `2x2+ngram3` (the `--tree` and `decode.tree` spelling)."""
    base, ngram = split_hybrid(spec)
    tree = parse_tree(base)
    return Hybrid(tree, ngram) if ngram else tree


def parse_num_draft(text: str | int) -> Tree | Auto:
    """`auto` or a number of drafts (the `--num-draft` spelling): Auto, or the chain; ValueError otherwise."""
    if text == "auto":
        return Auto()
    if isinstance(text, bool) or not (isinstance(text, int) or str(text).isdigit()) or int(text) < 0:
        raise ValueError(f"must be auto or an integer number of drafts >= 0, got {text!r}")
    return chain(int(text))


@dataclass(frozen=True)
class DecodeTree(Spec):
    """decode.tree: a static draft tree (or a hybrid with n-gram lookup), or none (empty: num_draft's chain)."""

    shape: Tree | Hybrid | None = None

    KEY: ClassVar[str] = "decode.tree"
    FORMS: ClassVar[str] = "empty (a chain of decode.num_draft) | 2x2x1 | -1,-1,0,0 | 2x2+ngram3"

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> DecodeTree:
        """The shape `text` writes (empty: none); ConfigError naming the key otherwise."""
        if not text.strip():
            return cls()
        try:
            return cls(parse_shape(text))
        except TreeError as e:
            raise fail(key or cls.KEY, text, f"{e} (empty: a chain)") from None

    def __str__(self) -> str:
        return "" if self.shape is None else self.shape.name()
