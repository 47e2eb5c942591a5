"""The `digests` item of a checkpoint: an xxh3-128 digest of every stored array shard, of the data position and
of the config, written with the checkpoint and checked when it is restored.

Saving: each process hashes its own addressable shards (replica 0 of each, so every stored byte is hashed once)
in the save call, where the arrays are still the step's (the next step takes their buffers over); the record is
written to `digests/process_<i>.json` in the background with the rest of the checkpoint and committed with it.
On CPU the hash reads the arrays in place (no copy); elsewhere it reads a host copy. orbax-checkpoint 0.12.8
and its tensorstore spec store no checksum of the chunks themselves, hence this item.

Restoring: each saved shard is checked by a process that holds it whole under the restore's sharding (any
mesh or process count); a shard no process holds whole is gathered once (a layout that splits finer across
processes than the save did). All processes agree on the first mismatch, so all fall back together.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import future

from mtpjax import checksum

ITEM = "digests"


def _slices(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


def _key(region) -> str:
    return ",".join(f"{a}:{b}" for a, b in region)


def _region(key: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(map(int, p.split(":"))) for p in key.split(",")) if key else ()


def _name(k) -> str:
    for attr in ("key", "idx", "name"):  # a dict key, a sequence index, a named-tuple field
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaves(tree) -> list[tuple[str, object]]:
    """(dotted path, leaf); a list index and its string form (as orbax may return it) name the same leaf."""
    return [(".".join(map(_name, p)), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def local_digests(tree) -> dict[str, dict[str, str]]:
    """{array path: {region "a:b,c:d": digest}} of this process's shards with replica id 0."""
    parts = []  # (path, region key, host array)
    for path, x in _leaves(tree):
        if isinstance(x, jax.Array):
            parts += [(path, _key(_slices(s.index, x.shape)), np.asarray(s.data))
                      for s in x.addressable_shards if s.replica_id == 0]
        elif jax.process_index() == 0:  # a host value: process 0 stores it whole
            parts.append((path, _key(_slices((slice(None),) * np.ndim(x), np.shape(x))), np.asarray(x)))
    out: dict = {path: {} for path, _ in _leaves(tree)}
    for (path, key, _), d in zip(parts, checksum.of_arrays([a for *_, a in parts])):
        out[path][key] = d
    return {k: v for k, v in out.items() if v}


# ----------------------------------------------------------------------------- the orbax item


def _record(args: DigestSave) -> dict:
    return {"algorithm": checksum.ALGORITHM,
            "arrays": {item: local_digests(tree) for item, tree in args.arrays.items()},
            # only process 0 writes the JSON items (its own data position and goodput are the stored ones)
            "json": {k: checksum.of_json(v) for k, v in args.json.items()} if jax.process_index() == 0 else {}}


class DigestHandler(ocp.handlers.AsyncCheckpointHandler):
    """Writes this process's digests to `process_<i>.json`; restores the merged record of all processes."""

    async def async_save(self, directory, args: DigestSave):
        record, name = _record(args), f"process_{jax.process_index()}.json"

        async def write():
            (directory / name).write_text(json.dumps(record))

        return [future.CommitFutureAwaitingContractedSignals(write(), name="mtpjax_digests")]

    def save(self, directory, args: DigestSave):
        (directory / f"process_{jax.process_index()}.json").write_text(json.dumps(_record(args)))

    def restore(self, directory, args: DigestRestore | None = None) -> dict:
        merged: dict = {"arrays": {}, "json": {}}
        for f in sorted(directory.glob("process_*.json")):
            rec = json.loads(f.read_text())
            for item, arrays in rec["arrays"].items():
                for path, regions in arrays.items():
                    merged["arrays"].setdefault(item, {}).setdefault(path, {}).update(regions)
            merged["json"].update(rec["json"])
        return merged


@ocp.args.register_with_handler(DigestHandler, for_save=True)
@dataclasses.dataclass
class DigestSave(ocp.args.CheckpointArgs):
    """The arrays (item name -> pytree) and JSON values (item name -> value) to record digests of."""

    arrays: dict
    json: dict


@ocp.args.register_with_handler(DigestHandler, for_restore=True)
@dataclasses.dataclass
class DigestRestore(ocp.args.CheckpointArgs):
    """Read a checkpoint's digest record."""


# ----------------------------------------------------------------------------- checking


def _holder(x: jax.Array, region) -> int | None:
    """The lowest process whose devices hold `region` of `x` whole (None if none does)."""
    best = None
    for dev, idx in x.sharding.devices_indices_map(x.shape).items():
        r = _slices(idx, x.shape)
        if all(a <= s and e <= b for (a, b), (s, e) in zip(r, region)):
            best = dev.process_index if best is None else min(best, dev.process_index)
    return best


def _check_local(x: jax.Array, region) -> np.ndarray:
    for s in x.addressable_shards:
        r = _slices(s.index, x.shape)
        if all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(r, region)):
            return np.asarray(s.data)[tuple(slice(lo - a, hi - a) for (a, _), (lo, hi) in zip(r, region))]
    raise AssertionError("no local shard holds the region")


def _parts(x, regions: dict[str, str]) -> list[tuple[np.ndarray, str]] | None:
    """(part, recorded digest) of each region of one array this process checks; None if the regions do not fit the
    array. Collective when a region must be gathered (every process reaches the same answer)."""
    if not isinstance(x, jax.Array):
        whole = np.asarray(x)
        if any(len(_region(k)) != whole.ndim for k in regions):
            return None
        return [(whole[tuple(slice(a, b) for a, b in _region(k))], d) for k, d in regions.items()]
    me, gathered, out = jax.process_index(), None, []
    for k, d in sorted(regions.items()):
        region = _region(k)
        if len(region) != x.ndim:
            return None
        who = _holder(x, region)
        if who is None:
            if gathered is None:
                from jax.experimental import multihost_utils

                gathered = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            out.append((gathered[tuple(slice(a, b) for a, b in region)], d))
        elif who == me:
            out.append((_check_local(x, region), d))
    return out


def first_mismatch(record: dict, arrays: dict, values: dict) -> str | None:
    """The name of the first array or JSON item that does not match `record`, agreed by every process; None if all do.

    `arrays`: item name -> restored pytree; `values`: item name -> restored JSON value.
    """
    names, bad, checks = [], [], []  # checks: (leaf number, part, recorded digest)
    for item, tree in arrays.items():
        saved = record["arrays"].get(item, {})
        for path, x in _leaves(tree):
            names.append(f"array {item}.{path}")
            parts = _parts(x, saved[path]) if path in saved else None
            if parts is None:
                bad.append(len(names) - 1)
            checks += [(len(names) - 1, p, d) for p, d in parts or ()]
    got = checksum.of_arrays([p for _, p, _ in checks])
    bad += [i for (i, _, d), g in zip(checks, got) if g != d]
    for item, v in values.items():
        names.append({"data": "the data position", "meta": "the config and metrics"}.get(item, item) + f" ({item})")
        if item in record["json"] and checksum.of_json(v) != record["json"][item]:
            bad.append(len(names) - 1)
    first = min(bad, default=len(names))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        first = int(np.min(multihost_utils.process_allgather(np.int32(first))))
    return names[first] if first < len(names) else None
