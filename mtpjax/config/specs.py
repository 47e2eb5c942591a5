"""The draft tree: its type (a chain is a tree of width one), its hybrid with n-gram lookup, and its one parser."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mtpjax.errors import MtpjaxError

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
