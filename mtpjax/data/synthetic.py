"""Synthetic task corpora (`data.source: induction | algorithmic`): instances generated from a seed, scored by a
task metric on the held-out ones (mtpjax.eval.task_metrics).

Instance i is drawn from a generator seeded with (`data.synthetic_seed`, i) alone, so the corpus does not depend on
how many instances are asked for, and any instance can be regenerated without the others. An instance is a few
segments of text; the marked ones are what the task metric scores:
- induction (after Gloeckle et al. 2024, §4.1): a short story of sentences "<Name> <verb> the <noun>." about
  `data.synthetic_difficulty` invented names (a capital and three lower-case letters, distinct capitals);
  every occurrence of a name after its first is a repeat, and its letters after the capital are marked: given
  the capital they can only be copied from earlier in the context;
- algorithmic: "a+b=c" with `data.synthetic_difficulty`-digit operands (zero-padded); the answer c and the
  end of document after it are marked (greedy decoding of the answer is exact iff every marked token is the
  argmax after the true prefix).
Split: an instance goes to validation by the hash of its key (the whole story; the question "a+b=" of a sum),
so an instance that is generated twice lands on the same side: held-out instances never occur in training.
Prepared like any corpus (documents joined with EOS after each, cached), so it streams and resumes like the others.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mtpjax.data import sources
from mtpjax.data.errors import DataError

KINDS = ("induction", "algorithmic")
VERSION = 1  # part of the cache key: bump when an instance's text changes
NAME_LETTERS = 3  # lower-case letters after a name's capital
SENTENCES = 8  # sentences per induction story
MAX_DIGITS = 18  # an algorithmic operand below 10**digits is drawn as an int64
VERBS = ("saw", "took", "found", "lost", "liked", "held", "gave", "made")
NOUNS = ("cat", "dog", "ball", "book", "cake", "tree", "boat", "hat", "cup", "bird", "key", "box")


@dataclass(frozen=True)
class Instance:
    """One generated document: its text in segments (text, marked) and the key that decides its split."""

    segments: tuple[tuple[str, bool], ...]
    key: str

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)


def _names(rng: np.random.Generator, n: int) -> list[str]:
    caps = rng.choice(list(string.ascii_uppercase), n, replace=False)
    low = rng.choice(list(string.ascii_lowercase), (n, NAME_LETTERS))
    return [c + "".join(r) for c, r in zip(caps, low)]


def induction(rng: np.random.Generator, names: int) -> Instance:
    """A story whose names' repeats are marked after their first letter."""
    who = _names(rng, names)
    order = list(range(names)) + rng.integers(0, names, SENTENCES - names).tolist()  # each introduced once first
    seen: set[int] = set()
    segs: list[tuple[str, bool]] = []
    for i, n in enumerate(order):
        name = who[n]
        segs += [(" " if i else "", False), (name[0], False), (name[1:], n in seen),
                 (f" {VERBS[rng.integers(len(VERBS))]} the {NOUNS[rng.integers(len(NOUNS))]}.", False)]
        seen.add(n)
    inst = tuple((t, m) for t, m in segs if t)
    return Instance(inst, "".join(t for t, _ in inst))


def algorithmic(rng: np.random.Generator, digits: int) -> Instance:
    """'a+b=' then the answer (marked)."""
    a, b = (int(x) for x in rng.integers(0, 10**digits, 2))
    q = f"{a:0{digits}d}+{b:0{digits}d}="
    return Instance(((q, False), (str(a + b), True)), q)


def instance(kind: str, seed: int, i: int, difficulty: int) -> Instance:
    """Instance i of a corpus (a pure function of its arguments)."""
    rng = np.random.default_rng([seed % 2**63, i])
    if kind == "induction":
        if not 1 <= difficulty <= SENTENCES:
            raise DataError(f"data.synthetic_difficulty={difficulty}: induction stories have 1..{SENTENCES} names")
        return induction(rng, difficulty)
    if kind == "algorithmic":
        if not 1 <= difficulty <= MAX_DIGITS:
            raise DataError(f"data.synthetic_difficulty={difficulty}: algorithmic operands have 1..{MAX_DIGITS} digits")
        return algorithmic(rng, difficulty)
    raise DataError(f"unknown synthetic source '{kind}'; use {' or '.join(KINDS)}")


def instances(cfg, split: str | None = None) -> Iterator[Instance]:
    """The corpus of a DataConfig in generation order (only `split`'s instances if given)."""
    for i in range(cfg.synthetic_instances):
        x = instance(cfg.source, cfg.synthetic_seed, i, cfg.synthetic_difficulty)
        if split is None or split_of(x, cfg.val_fraction) == split:
            yield x


def split_of(x: Instance, val_fraction: float) -> str:
    """'val' or 'train', by the hash of the instance's key (equal instances share a side)."""
    return "val" if sources.is_val(x.key, val_fraction) else "train"


def spec(cfg) -> dict:
    """What the prepared arrays depend on (joins the cache key and meta.json)."""
    return {"kind": cfg.source, "seed": cfg.synthetic_seed, "instances": cfg.synthetic_instances,
            "difficulty": cfg.synthetic_difficulty, "version": VERSION}


def write(cfg, tok, sinks: dict, chunk: int = 4096) -> str:
    """Generate, split and tokenize the corpus into the train/val sinks; the content hash."""
    from mtpjax.data.encode import tokenize_batch

    h = hashlib.sha256()
    pending: dict[str, list[str]] = {"train": [], "val": []}

    def flush(split: str) -> None:
        if pending[split]:
            sinks[split].add(tokenize_batch(tok, pending[split]), len(pending[split]))
            pending[split] = []

    for x in instances(cfg):
        s = split_of(x, cfg.val_fraction)
        h.update(s.encode() + b"\0" + x.text.encode() + b"\0")
        pending[s].append(x.text)
        if len(pending[s]) >= chunk:
            flush(s)
    for s in pending:
        flush(s)
    return h.hexdigest()


@dataclass(frozen=True)
class TaskBatch:
    """Held-out instances as one padded batch: tokens, the marked (scored) positions, the task they belong to."""

    kind: str
    tokens_BT: np.ndarray  # int32, each row one instance from position 0, padded with EOS
    mask_BT: np.ndarray  # bool: the token at this position is scored (predicted from the positions before it)


def encode_instance(x: Instance, tok, kind: str) -> tuple[list[int], list[bool]]:
    """Token ids and marks of an instance (segments encoded one by one: marks stay on token boundaries)."""
    ids, marks = [], []
    for text, marked in x.segments:
        t = tok.encode(text)
        ids += t
        marks += [marked] * len(t)
    # the end of document closes the answer: exact match needs the model to stop there
    return ids + [tok.eos_id], marks + [kind == "algorithmic"]


def task_batch(cfg, tok, n: int, seq_len: int) -> TaskBatch | None:
    """The first n distinct held-out instances of a synthetic DataConfig (None for other sources)."""
    if cfg.source not in KINDS or n == 0:
        return None
    rows, seen = [], set()
    for x in instances(cfg, "val"):
        if x.key not in seen:
            seen.add(x.key)
            rows.append(encode_instance(x, tok, cfg.source))
            if len(rows) == n:
                break
    if not rows:
        raise DataError(f"the {cfg.source} corpus holds no held-out instance; raise data.synthetic_instances or "
                        "data.val_fraction")
    tokens_BT = np.full((len(rows), seq_len), tok.eos_id, np.int32)
    mask_BT = np.zeros((len(rows), seq_len), bool)
    for r, (ids, marks) in enumerate(rows):
        k = min(len(ids), seq_len)  # a row longer than a window is cut: its later marks are not scored
        tokens_BT[r, :k], mask_BT[r, :k] = ids[:k], marks[:k]
    mask_BT[:, 0] = False  # nothing predicts position 0
    return TaskBatch(cfg.source, tokens_BT, mask_BT)
