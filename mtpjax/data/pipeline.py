"""The global window stream: sources → shuffled windows → weighted interleave → global batches → this process's rows.

Windows: a source's split (documents joined, EOS after each) is cut into `seq_len`-token windows; the final
partial window is dropped, so there is no padding. `segment_ids` number the documents inside a window 1, 2,
3, ... and the EOS token belongs to the document it ends (the loss masks cross-document targets). Each
source's windows are visited in grain's seeded index-shuffle order, reshuffled every epoch (grain reseeds
with seed + epoch), forever unless `num_epochs` is given; batches may straddle epochs.

Global batch s holds positions n = s*B .. s*B+B-1 of one global stream:
- one source: position n is its n-th window (in shuffled order), seeded with `seed`;
- a mixture: position n takes the next window of the source k with the largest w_k*(n+1) - c_k (c_k: windows
  taken from k so far; ties go to the first source), the greedy of Megatron's blended datasets, so after any
  n positions source k has given floor or ceil of w_k*n windows. A generator seeded with (seed, s) then
  permutes the batch's positions onto its rows, so no row is tied to one source. Source k's windows are
  shuffled with a seed derived from (seed, name): adding a source does not reorder the others.
Every process computes the same plan and reads only `rows`, the global rows its devices hold (hosts.local_rows),
so 1 and N processes train on the same examples, and a run resumes on another process count exactly.

Iterator state (`get_state()`): `{"batch": s, "taken": [c_k, ...]}` plus the settings it is only meaningful
for, JSON-serializable (orbax `args.JsonSave`). `num_workers` prefetch threads read batches ahead; they
change neither the batches nor the state.
"""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grain
import numpy as np

from mtpjax.data.errors import DataError

_CHECKED = ("split", "seq_len", "batch_size", "seed", "shuffle", "sources")


def segment_ids(tokens_BT: np.ndarray, eos_id: int) -> np.ndarray:
    """Document number (from 1) of each token in each window; EOS closes its own document."""
    is_eos = tokens_BT == eos_id
    return (1 + np.cumsum(is_eos, axis=-1) - is_eos).astype(np.int32)


def source_seed(seed: int, name: str) -> int:
    """The window-order seed of a source: `seed` alone for a single (unnamed) source, else hashed with its name."""
    if not name:
        return seed % 2**32
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "big")


class _Windows:
    """One source's windows in stream order: window(j) is the index of its j-th window."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool, num_epochs: int | None):
        self.tokens, self.count = tokens, len(tokens) // seq_len
        ds = grain.MapDataset.range(self.count)
        self.order = (ds.shuffle(seed=seed) if shuffle else ds).repeat(num_epochs)
        self.limit = None if num_epochs is None else num_epochs * self.count

    def window(self, j: int) -> int:
        return int(self.order[j])


def interleave(weights: np.ndarray, taken: np.ndarray, n: int) -> np.ndarray:
    """The source of each of the next n positions (greedy on w_k*(n+1) - c_k); updates `taken` in place."""
    first = int(taken.sum())
    out = np.empty(n, np.int64)
    for i in range(n):
        k = int(np.argmax(weights * (first + i + 1) - taken))
        out[i] = k
        taken[k] += 1
    return out


class BatchIterator:
    """Iterator of {"tokens", "segment_ids"} int32 [len(rows), T] numpy batches with get_state/set_state."""

    def __init__(self, parts, info: dict, rows: np.ndarray, num_workers: int):
        self.info, self.rows = info, rows
        self._parts = parts  # [(weight, _Windows)]
        self._weights = np.array([w for w, _ in parts], np.float64)
        self._batch, self._taken = 0, np.zeros(len(parts), np.int64)
        self._pool = ThreadPoolExecutor(num_workers) if num_workers > 0 else None
        self._ahead = max(2, 2 * num_workers)
        self._queue: deque = deque()  # (future or batch, state after it)

    def __iter__(self):
        return self

    def plan(self, s: int, taken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw number within that source) of every global row of batch s; updates `taken` (drawn before)."""
        B = self.info["batch_size"]
        if len(self._parts) == 1:
            src, j = np.zeros(B, np.int64), taken[0] + np.arange(B)
            taken[0] += B
        else:
            before = taken.copy()
            src = interleave(self._weights, taken, B)
            j = np.empty(B, np.int64)
            for k in range(len(self._parts)):
                j[src == k] = before[k] + np.arange(int((src == k).sum()))
            perm = np.random.default_rng([self.info["seed"] % 2**63, s]).permutation(B)
            src, j = src[perm], j[perm]
        for k, (_, w) in enumerate(self._parts):
            if w.limit is not None and (j[src == k] >= w.limit).any():
                raise StopIteration
        return src, j

    def window(self, k: int, j: int) -> int:
        """The window index of source k's j-th draw."""
        return self._parts[k][1].window(j)

    def _read(self, src: np.ndarray, j: np.ndarray) -> dict[str, np.ndarray]:
        T = self.info["seq_len"]
        src = src[self.rows]  # only this process's rows are looked up and read
        win = np.array([self.window(k, i) for k, i in zip(src, j[self.rows])], np.int64)
        tokens_BT = np.empty((len(self.rows), T), np.int32)
        for k in np.unique(src):
            sel = src == k
            tokens_BT[sel] = self._parts[k][1].tokens[win[sel, None] * T + np.arange(T)]
        return {"tokens": tokens_BT, "segment_ids": segment_ids(tokens_BT, self.info["eos_id"])}

    def _fill(self) -> None:
        while len(self._queue) < (self._ahead if self._pool else 1):
            s = self._batch + len(self._queue)
            taken = (self._queue[-1][1]["taken"] if self._queue else self._taken).copy()
            try:
                src, j = self.plan(s, taken)
            except StopIteration:
                return
            job = self._pool.submit(self._read, src, j) if self._pool else self._read(src, j)
            self._queue.append((job, {"batch": s + 1, "taken": taken}))

    def __next__(self) -> dict[str, np.ndarray]:
        self._fill()
        if not self._queue:
            raise StopIteration
        job, after = self._queue.popleft()
        self._batch, self._taken = after["batch"], after["taken"]
        return job.result() if self._pool else job

    def get_state(self) -> dict:
        """JSON-serializable position (plus the settings it belongs to)."""
        return {"batch": self._batch, "taken": self._taken.tolist(), **{k: self.info[k] for k in _CHECKED}}

    def set_state(self, state: dict) -> None:
        """Continue from a state returned by get_state; DataError if it belongs to other settings."""
        if "taken" not in state:
            raise DataError("data iterator state was saved by an older mtpjax (one shard per process); resume it "
                            "with that version, or start afresh with --fresh")
        diff = [_differs(k, state.get(k), self.info[k]) for k in _CHECKED if state.get(k) != self.info[k]]
        if diff:
            raise DataError(f"data iterator state was saved with {', '.join(diff)}; resume with the same "
                            "data and batch settings, or pass --fresh (or set another train.run_dir) to start over")
        self._queue.clear()  # prefetched batches belong to the old position
        self._batch, self._taken = int(state["batch"]), np.array(state["taken"], np.int64)


def _differs(key: str, saved, now) -> str:
    """What changed in a checked setting: sources that differ only in their tokens are named as changed data, not as
    their content hashes."""
    if key == "sources" and isinstance(saved, list) and [s[:2] for s in saved] == [s[:2] for s in now]:
        changed = [f"'{n}'" if n else "the corpus" for (n, _, h), (_, _, h2) in zip(saved, now) if h != h2]
        return f"other tokens in {', '.join(changed)} (files or the tokenizer changed since)"
    return f"{key}={saved!r} (now {now!r})"


def _check_rows(rows, batch_size: int) -> np.ndarray:
    rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
    if (rows.ndim != 1 or not len(rows) or rows.min() < 0 or rows.max() >= batch_size
            or len(set(rows.tolist())) != len(rows)):
        raise DataError(f"rows {rows.tolist()} are not distinct rows of a batch of {batch_size}")
    return rows


def make_iterator(prepared, *, split: str, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                  rows=None, num_epochs: int | None = None, num_workers: int = 0) -> BatchIterator:
    """Global batches of `split` (rows: the global rows this process reads, default all); infinite by default.

    `prepared` is a PreparedData or a PreparedMixture (anything with `.sources()` and `.tokenizer`).
    """
    parts, sources = [], []
    for name, weight, p in prepared.sources():
        tokens = p.tokens(split)
        w = _Windows(tokens, seq_len, source_seed(seed, name), shuffle, num_epochs)
        if not name and w.count < batch_size:
            more = ", raise data.val_fraction (or skip evals: train.eval_batches=0)" if split == "val" else ""
            raise DataError(f"the {split} split has {len(tokens)} tokens but one batch needs {batch_size} x {seq_len}"
                            f" = {batch_size * seq_len}; lower train.batch_size or data.seq_len{more}, or add data")
        if name and w.count < 1:
            raise DataError(f"the {split} split of data.mixture source '{name}' has {len(tokens)} tokens, less than "
                            f"one window of data.seq_len={seq_len}; lower data.seq_len or add data to it")
        parts.append((weight, w))
        sources.append([name, weight, p.content_hash])
    info = {"split": split, "seq_len": seq_len, "batch_size": batch_size, "seed": seed, "shuffle": shuffle,
            "sources": sources, "eos_id": prepared.tokenizer.eos_id}
    return BatchIterator(parts, info, _check_rows(rows, batch_size), num_workers)
