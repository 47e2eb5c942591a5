"""Tokenize a text-like source into train/val token files, in this process or in worker processes.

Measured (bench/data_bench.py, docs/benchmarks.md): with a BPE the `tokenizers` batch encoder, which already uses every
core, dominates (reading is under 1%) and preparation runs at ~0.9x its speed; with bytes, per-document Python work
(hashes, decoding) and writing dominate. `data.prepare_workers=N` has N spawned processes each read, split
and encode whole units (files, row groups, record batches) with a single-threaded encoder, so reading
overlaps encoding; it did not pay on 2 shared cores, hence the default 0.
Both paths read the same units in the same order and encode each document on its own (EOS after each),
so they write identical arrays; the content hash is a sha256 over per-unit digests for the same reason.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from mtpjax.data import sources
from mtpjax.data.errors import DataError
from mtpjax.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_dir

SPLITS = ("train", "val")
BATCH_BYTES = 4 << 20  # text per batch-encoder call in this process
TASK_BYTES = 8 << 20  # units grouped into one worker task


def tokenize_batch(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Documents → one id array with EOS after each."""
    if isinstance(tok, ByteTokenizer):
        sep = bytes([tok.eos_id])
        return np.frombuffer(sep.join(tok.encode_bytes(t) for t in texts) + sep, dtype=np.uint8)
    ids = tok.encode_batch(texts)
    return np.concatenate([np.asarray(x + [tok.eos_id], dtype=np.int64) for x in ids])


class Progress:
    """A tqdm bar over the source's bytes (hence an ETA) that also shows tokens/s."""

    def __init__(self, enabled: bool, total: int, desc: str):
        from mtpjax.parallel import console

        self.bar = console.bar(total, desc=desc, unit="B", unit_scale=True, enabled=enabled)
        self.tokens, self.t0 = 0, time.perf_counter()

    def advance(self, nbytes: int, tokens: int = 0) -> None:
        self.tokens += tokens
        if tokens:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tok/s", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()


def _split_of(key: str, val_fraction: float) -> str:
    return "val" if sources.is_val(key, val_fraction) else "train"


def _unit_docs(u: sources.Unit, field: str, val_fraction: float, utf8) -> tuple[bytes, list[tuple[str, str]]]:
    """A unit's digest and its (split, text) documents."""
    d, docs = hashlib.sha256(), []
    for key, text in sources.read_unit(u, field, utf8):
        d.update(key.encode() + b"\0" + text.encode("utf-8", errors="replace") + b"\0")
        docs.append((_split_of(key, val_fraction), text))
    return d.digest(), docs


def encode_here(units, field: str, tok: Tokenizer, val_fraction: float, sinks: dict, bar: Progress) -> tuple[str, list]:
    """Tokenize in this process (batches of ~BATCH_BYTES per encoder call); (content hash, non-UTF-8 files)."""
    h, utf8 = hashlib.sha256(), sources.Utf8Tracker()
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}
    size = dict.fromkeys(SPLITS, 0)

    def flush(split) -> int:
        if not pending[split]:
            return 0
        ids = tokenize_batch(tok, pending[split])
        sinks[split].add(ids, len(pending[split]))
        pending[split], size[split] = [], 0
        return len(ids)

    for u in units:
        digest, docs = _unit_docs(u, field, val_fraction, utf8)
        h.update(digest)
        done = 0
        for split, text in docs:
            pending[split].append(text)
            size[split] += len(text)
            if size[split] >= BATCH_BYTES:
                done += flush(split)
        bar.advance(u.size, done)
    bar.advance(0, flush("train") + flush("val"))
    return h.hexdigest(), list(utf8.bad)


# ----------------------------------------------------------------------------- worker processes

_WORKER_TOK: Tokenizer | None = None


def _init_worker(tok_dir: str) -> None:
    global _WORKER_TOK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent answers it
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism
    _WORKER_TOK = tokenizer_from_dir(tok_dir)


def _work(units, field: str, val_fraction: float) -> dict:
    """One task: read, split and encode some units; returns arrays, counts, digests (in unit order)."""
    utf8, digests = sources.Utf8Tracker(), []
    texts: dict[str, list[str]] = {s: [] for s in SPLITS}
    for u in units:
        digest, docs = _unit_docs(u, field, val_fraction, utf8)
        digests.append(digest)
        for split, text in docs:
            texts[split].append(text)
    ids = {s: tokenize_batch(_WORKER_TOK, texts[s]) if texts[s] else np.zeros(0, np.uint8) for s in SPLITS}
    return {"digests": digests, "ids": ids, "docs": {s: len(texts[s]) for s in SPLITS}, "bad": list(utf8.bad),
            "bytes": sum(u.size for u in units)}


def tasks_of(units) -> list[list]:
    """Consecutive units grouped until each group holds about TASK_BYTES (a unit is never split)."""
    out, cur, size = [], [], 0
    for u in units:
        cur.append(u)
        size += u.size
        if size >= TASK_BYTES:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


@contextmanager
def _workers_deaf_to_ctrl_c() -> Iterator[None]:
    """Processes started here ignore SIGINT from their first instruction (an ignored signal stays ignored across exec,
    and Python keeps it so): Ctrl-C reaches the whole process group, and the parent alone answers it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def encode_workers(units, field: str, tok_dir, val_fraction: float, sinks: dict, bar: Progress,
                   workers: int) -> tuple[str, list]:
    """Tokenize in `workers` spawned processes; results are written in unit order (identical to encode_here)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    tasks = tasks_of(units)
    h, bad = hashlib.sha256(), {}

    def consume(res: dict) -> None:
        for d in res["digests"]:
            h.update(d)
        for s in SPLITS:
            if res["docs"][s]:
                sinks[s].add(res["ids"][s], res["docs"][s])
        bad.update(dict.fromkeys(res["bad"]))
        bar.advance(res["bytes"], len(res["ids"]["train"]) + len(res["ids"]["val"]))

    # spawn, not fork: the parent may already run JAX's threads. A worker that dies breaks the pool (an
    # error), where multiprocessing.Pool would start new workers forever.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx, initializer=_init_worker,
                             initargs=(str(tok_dir),)) as pool:
        inflight: deque = deque()
        try:
            with _workers_deaf_to_ctrl_c():  # the first submissions start the workers
                inflight.extend(pool.submit(_work, t, field, val_fraction) for t in tasks[:workers])
            for t in tasks[workers:]:  # a bounded window of tasks in flight keeps memory flat and the output in order
                inflight.append(pool.submit(_work, t, field, val_fraction))
                if len(inflight) >= 2 * workers:
                    consume(inflight.popleft().result())
            while inflight:
                consume(inflight.popleft().result())
        except BrokenProcessPool:
            raise DataError("a data.prepare_workers process died (killed, out of memory, or started from a script "
                            "it cannot re-import); lower data.prepare_workers or set it to 0") from None
        finally:
            for f in inflight:
                f.cancel()
    return h.hexdigest(), list(bad)
