"""Streaming without recompiling: the loop emits each commit with a traced stream id, the host looks the callback up.

The callback itself is never part of anything jit hashes, so a new callback reuses the compiled loop.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager

import jax
import numpy as np

_CALLBACKS: dict[int, object] = {}
_NEXT: dict[int, int] = {}  # per stream id: the sequence number the callback hears next
_WAITING: dict[int, dict] = {}  # per stream id: emissions that arrived before an earlier one, by sequence number
_IDS = itertools.count()
_LOCK = threading.Lock()
NONE = -1  # the id of no callback: the loop's emissions go nowhere


def emit(stream_id, seq, toks_BY, counts_B) -> None:
    """Host side of the loop's emission number `seq` (0, 1, ...): hand the committed tokens to the callback registered
    under the id, in the order of `seq` whatever order they arrive in."""
    sid = int(stream_id)
    fn = _CALLBACKS.get(sid)
    if fn is None:
        return
    with _LOCK:
        waiting = _WAITING[sid]
        waiting[int(seq)] = (np.asarray(toks_BY), np.asarray(counts_B))
        while _NEXT[sid] in waiting:
            fn(*waiting.pop(_NEXT[sid]))
            _NEXT[sid] += 1


@contextmanager
def registered(fn):
    """The stream id under which `fn` receives commits while the block runs (NONE for no callback).

    On leaving, the block waits for the callbacks still in flight, so none arrives after it.
    """
    if fn is None:
        yield NONE
        return
    with _LOCK:
        sid = next(_IDS) % (2**31 - 1)
        _CALLBACKS[sid], _NEXT[sid], _WAITING[sid] = fn, 0, {}
    try:
        yield sid
        jax.effects_barrier()
    finally:
        _CALLBACKS.pop(sid, None)
        _NEXT.pop(sid, None)
        _WAITING.pop(sid, None)
