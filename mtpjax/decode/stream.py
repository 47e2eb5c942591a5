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
_IDS = itertools.count()
_LOCK = threading.Lock()
NONE = -1  # the id of no callback: the loop's emissions go nowhere


def emit(stream_id, toks_BY, counts_B) -> None:
    """Host side of the loop's emission: hand the committed tokens to the callback registered under the id."""
    fn = _CALLBACKS.get(int(stream_id))
    if fn is not None:
        fn(np.asarray(toks_BY), np.asarray(counts_B))


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
        _CALLBACKS[sid] = fn
    try:
        yield sid
        jax.effects_barrier()
    finally:
        _CALLBACKS.pop(sid, None)
