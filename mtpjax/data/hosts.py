"""Data on several processes: one prepares while the others wait, and each reads its rows of the global batch.

Every process reads rows of the global batch from anywhere in the corpus, so every host needs the whole
prepared corpus. Process 0 builds it into `data.cache_dir`; the others wait on an event (a key process 0
sets in JAX's coordination service when the cache's meta.json is in place, or the error that stopped it,
which every process then reports as its own) and load it. Whether the cache is shared is checked first:
process 0 writes a probe file there and each process looks for it; a process that cannot see it (a cache
on a host-local disk) prepares its own copy at once, alongside process 0. Preparation is deterministic,
so the copies hold the same arrays; their content hashes are compared and a difference (hosts seeing
different files) is an error.
"""

from __future__ import annotations

import itertools
import json
import sys
import uuid
from pathlib import Path

import numpy as np

from mtpjax.data.errors import DataError, cache_unwritable

_WAIT_MS = 10 * 60 * 1000  # one wait on the coordination service; waits repeat until the event
_calls = itertools.count()  # every process numbers its calls alike: the keys of one call meet


def local_rows(sharding, batch_size: int) -> np.ndarray:
    """The global batch rows this process feeds, in the order jax.make_array_from_process_local_data reads them.

    That function maps the sorted distinct row blocks of this process's devices, in order, onto the
    process-local array; a process holding every block feeds the whole batch.
    """
    starts, size = set(), 0
    for index in sharding.addressable_devices_indices_map((batch_size, 1)).values():
        start, stop, _ = index[0].indices(batch_size)
        starts.add(start)
        size = stop - start
    return np.concatenate([np.arange(s, s + size) for s in sorted(starts)])


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _get(client, key: str) -> str:
    """Block until `key` is set, however long preparation takes (bounded waits, repeated)."""
    while True:
        try:
            return client.blocking_key_value_get(key, _WAIT_MS)
        except Exception as e:  # JaxRuntimeError; only "DEADLINE_EXCEEDED: GetKeyValue() timed out" is retried
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def _probe_visible(path: str) -> bool:
    try:
        return Path(path).is_file()
    except OSError:
        return False


def prepare_on_hosts(data_cfg, *, progress: bool, index: int | None = None, count: int | None = None, client=None,
                     namespace: str | None = None):
    """prepare(data_cfg) on every process, building it once when data.cache_dir is shared; DataError everywhere on
    failure.

    index/count/client/namespace default to this JAX process's (tests pass their own).
    """
    import jax

    from mtpjax.data.corpus import prepare

    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if count == 1:
        return prepare(data_cfg, progress=progress)
    client = client or _client()
    ns = namespace or f"mtpjax/data/{next(_calls)}"
    if index == 0:
        return _lead(data_cfg, progress, client, ns, count, prepare)
    return _follow(data_cfg, client, ns, index, prepare)


def _lead(data_cfg, progress, client, ns, count, prepare):
    cache = Path(data_cfg.cache_dir).expanduser()
    probe = cache / f".probe-{uuid.uuid4().hex}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
    except OSError as e:
        msg = str(cache_unwritable(cache, e))
        client.key_value_set(f"{ns}/probe", "")
        client.key_value_set(f"{ns}/result", json.dumps({"error": msg}))
        raise DataError(msg) from None
    client.key_value_set(f"{ns}/probe", str(probe))
    try:
        prepared = prepare(data_cfg, progress=progress)
    except DataError as e:
        client.key_value_set(f"{ns}/result", json.dumps({"error": str(e)}))
        probe.unlink(missing_ok=True)
        raise
    for p in range(1, count):  # every process has looked for the probe before it goes
        _get(client, f"{ns}/looked/{p}")
    probe.unlink(missing_ok=True)
    client.key_value_set(f"{ns}/result", json.dumps({"hash": prepared.content_hash}))
    return prepared


def _follow(data_cfg, client, ns, index, prepare):
    probe = _get(client, f"{ns}/probe")
    shared = bool(probe) and _probe_visible(probe)
    client.key_value_set(f"{ns}/looked/{index}", "1")
    prepared, own_error = None, None
    if not shared and probe:
        print(f"process {index}: data.cache_dir is not shared with process 0; preparing a copy on this host",
              file=sys.stderr, flush=True)
        try:
            prepared = prepare(data_cfg)
        except DataError as e:
            own_error = e  # process 0's error, if it has one too, is the one every process reports
    result = json.loads(_get(client, f"{ns}/result"))
    if "error" in result:
        raise DataError(result["error"])
    if own_error is not None:
        raise own_error
    prepared = prepared or prepare(data_cfg)  # shared: process 0's cache entry is in place
    if prepared.content_hash != result["hash"]:
        raise DataError(f"process {index} prepared a different corpus than process 0 (content hash "
                        f"{prepared.content_hash[:12]} vs {result['hash'][:12]}); every host must see the same "
                        "data files")
    return prepared
