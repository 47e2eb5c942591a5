"""The one draft type: a static tree whose nodes say who drafts them, and its one spelling.

Node i (0-based, parents before children) continues node parents[i]; -1 is the last committed token, the root. A
chain of γ drafts is the tree of width one. Each node says its source: the MTP modules, n-gram lookup, or a draft
model. Spelled (`decode.draft`, `generate(draft=...)`): `auto` (measured per request), `0` (plain), `3` (a chain),
`2x2x1` (children per node at each depth), `-1,-1,0,0` (each node's parent), and any tree `+ngramL`: n-gram
lookup's chain of L drafts as the root's last branch (`2x2+ngram3`). A spelling's nodes are the MTP modules'
(`drafted_by` gives them to the proposer a request names).
"""

from __future__ import annotations

import functools
import math
import operator
import typing
from dataclasses import dataclass
from typing import Literal

from mtpjax.errors import SpellingError

Source = Literal["mtp", "ngram", "model"]
SOURCES = typing.get_args(Source)
MAX_NODES = 64  # verifying more rows than this per round never pays; the drafting loop is unrolled per node
FORMS = "auto | 0 (plain) | 3 (a chain of 3) | 2x2x1 | -1,-1,0,0 | 2x2+ngram3"


class DraftError(SpellingError):
    """A draft that cannot be built: `value` the spelling, the message one line naming the problem and the fix."""


@dataclass(frozen=True)
class Tree:
    """A static draft tree: each node's parent (-1: the root) and source (who drafts it)."""

    parents: tuple[int, ...]
    sources: tuple[Source, ...]

    def __post_init__(self):
        """Parents as a tuple of earlier nodes or -1, one known source per node, at most MAX_NODES: DraftError."""
        parents, sources = tuple(map(_index, self.parents)), tuple(self.sources)
        object.__setattr__(self, "parents", parents)  # a list given is hashed as a tuple (jit's static arguments)
        object.__setattr__(self, "sources", sources)
        bad = [i for i, p in enumerate(parents) if p is None or not -1 <= p < i]
        if bad:
            raise DraftError(self.parents, f"Tree: node {bad[0]}'s parent {self.parents[bad[0]]!r} is not an "
                                           "earlier node or -1 (the root); list each node's parent, parents first, "
                                           "e.g. (-1, -1, 0, 0)")
        if len(sources) != len(parents) or not set(sources) <= set(SOURCES):
            raise DraftError(sources, f"Tree: sources {sources!r} must name one of {SOURCES} for each of the "
                                      f"{len(parents)} nodes")
        if len(parents) > MAX_NODES:
            raise DraftError(parents, f"Tree: {len(parents)} nodes; a draft has at most {MAX_NODES}")

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
        """Width one: node i continues node i-1."""
        return self.parents == tuple(range(-1, self.size - 1))

    def ancestors(self, node: int) -> set[int]:
        """The node and its ancestors (the root, -1, included)."""
        out = {node}
        while node >= 0:
            node = self.parents[node]
            out.add(node)
        return out

    def part(self, source: Source) -> Tree:
        """The nodes `source` drafts, as a tree of their own (they come first, parents before children)."""
        n = sum(s == source for s in self.sources)
        return Tree(self.parents[:n], self.sources[:n])

    def count(self, source: Source) -> int:
        """Nodes `source` drafts."""
        return sum(s == source for s in self.sources)

    def drafted_by(self, source: Source) -> Tree:
        """This tree with its MTP nodes drafted by `source` (a spelling's nodes are the MTP modules')."""
        return Tree(self.parents, tuple(source if s == "mtp" else s for s in self.sources))

    def name(self) -> str:
        """The spelling `parse` reads back: `3` for a chain, `2x2x1` where each depth branches evenly, else the
        parent list; `+ngramL` for an n-gram branch beside another source's nodes."""
        ngram = self.count("ngram")
        if ngram and ngram < self.size:
            return f"{self.part(self.sources[0]).name()}+ngram{ngram}"
        if self.is_chain():
            return str(self.size)
        b = self._branching()
        return "x".join(map(str, b)) if b and len(b) > 1 else ",".join(map(str, self.parents))

    def _branching(self) -> tuple[int, ...] | None:
        """The branching factor per depth when every node of a depth has as many children, else None."""
        out = []
        for d in range(self.max_depth):
            counts = {len(self.children(p)) for p in ((-1,) if d == 0 else self.at_depth(d, d))}
            if len(counts) != 1:
                return None
            out.append(counts.pop())
        return tuple(out)


@dataclass(frozen=True)
class Auto:
    """What to draft is measured per request shape (decode.autodraft)."""

    def name(self) -> str:
        return "auto"


def _index(x) -> int | None:
    """x as an int if it is an integer (a numpy one included, not a bool), else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def chain(n: int, source: Source = "mtp") -> Tree:
    """The chain of n drafts (each continues the one before it); 0: PLAIN."""
    k = _index(n)  # a numpy integer too, as Tree takes them
    if k is None or k < 0:
        raise DraftError(n, f"chain({n!r}): a chain's length is a count of drafts, an int >= 0 (0: plain)")
    return Tree(tuple(range(-1, k - 1)), (source,) * k)


PLAIN = chain(0)  # no drafts: plain decoding is the loop verifying the empty tree


def parse(text: str | int) -> Tree | Auto:
    """The draft `text` spells (FORMS); DraftError naming the forms otherwise."""
    spec = str(text).strip().lower()
    if spec == "auto":
        return Auto()
    base, plus, tail = spec.partition("+")
    tree = _shape(base.strip(), spec)
    if not plus:
        return tree
    n = tail.strip().removeprefix("ngram")
    if not n.isdigit() or not 0 < int(n) <= MAX_NODES - tree.size:
        raise DraftError(spec, f"draft {spec!r}: the n-gram branch is +ngramL with L in 1..{MAX_NODES - tree.size} "
                               "n-gram drafts, e.g. 2x2+ngram3")
    if not tree.size:
        raise DraftError(spec, f"draft {spec!r}: an n-gram branch goes beside the MTP tree; for n-gram drafts alone "
                               f"give their count ({n}) with proposer ngram")
    G, L = tree.size, int(n)
    return Tree(tree.parents + tuple(-1 if i == 0 else G + i - 1 for i in range(L)), tree.sources + ("ngram",) * L)


def _shape(spec: str, whole: str) -> Tree:
    """A chain's length, `2x2x1` or a parent list `-1,-1,0,0` (the part before any `+ngramL`)."""
    try:
        if spec.isdigit():
            if int(spec) > MAX_NODES:
                raise _too_many(whole, int(spec))
            return chain(int(spec))
        if "," in spec or spec.startswith("-"):
            parents = tuple(int(x) for x in spec.split(","))
            bad = [i for i, p in enumerate(parents) if not -1 <= p < i]
            if bad:
                raise DraftError(whole, f"draft {whole!r}: node {bad[0]}'s parent {parents[bad[0]]} is not an earlier "
                                        "node or -1 (the root); list each node's parent, parents first, e.g. -1,-1,0,0")
        else:
            parents = _branching_parents(whole, tuple(int(x) for x in spec.split("x")))
    except ValueError as e:
        if isinstance(e, DraftError):
            raise
        raise DraftError(whole, f"draft {whole!r} is not one of {FORMS}") from None
    if not 0 < len(parents) <= MAX_NODES:
        raise _too_many(whole, len(parents))
    return Tree(parents, ("mtp",) * len(parents))


def _branching_parents(spec: str, branching: tuple[int, ...]) -> tuple[int, ...]:
    """The parents of a tree giving every node of depth d branching[d] children."""
    if not branching or min(branching) < 1:
        raise ValueError
    widths = [math.prod(branching[: d + 1]) for d in range(len(branching))]
    if sum(widths) > MAX_NODES:  # counted before building: 999x999 must not build a million nodes
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


def _too_many(spec: str, nodes: int) -> DraftError:
    return DraftError(spec, f"draft {spec!r} has {nodes} nodes; use 0..{MAX_NODES} (e.g. 2x2x1, 6 nodes)")
