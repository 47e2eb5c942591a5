"""What checkpoint digests cost: saving and restoring ~1 GiB of float32 arrays with orbax as train/checkpoint.py does,
with and without the `digests` item (xxh3-128 of every shard on save; checked on restore).

    python -m bench.checksum_cost [--gib 1.0] [--rounds 5] [--dir /tmp/ckcost]

Interleaved rounds (each round runs both variants, in a shuffled order); medians and the median of the per-round
ratios. The save is timed until it is committed on disk (the asynchronous part included).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from bench.common import json_path, load, write_json
from mtpjax import checksum
from mtpjax.train import digests

ARRAY_MIB = 128


def state(gib: float) -> dict:
    """{"a<i>": float32 array of ARRAY_MIB MiB} making up `gib` GiB."""
    rng = np.random.default_rng(0)
    n = max(1, round(gib * 1024 / ARRAY_MIB))
    return {f"a{i}": jax.device_put(rng.standard_normal(ARRAY_MIB * 2**18, np.float32)) for i in range(n)}


def save(directory: Path, tree: dict, with_digests: bool) -> float:
    mngr = ocp.CheckpointManager(directory)
    items = {"model": ocp.args.StandardSave(tree)}
    if with_digests:
        items["digests"] = digests.DigestSave({"model": tree}, {})
    t0 = time.perf_counter()
    mngr.save(1, args=ocp.args.Composite(**items))
    mngr.wait_until_finished()
    dt = time.perf_counter() - t0
    mngr.close()
    return dt


def restore(directory: Path, target: dict, verify: bool) -> float:
    mngr = ocp.CheckpointManager(directory)
    items = {"model": ocp.args.StandardRestore(target)}
    if verify:
        items["digests"] = digests.DigestRestore()
    t0 = time.perf_counter()
    out = mngr.restore(1, args=ocp.args.Composite(**items))
    jax.block_until_ready(out["model"])
    if verify:
        assert digests.first_mismatch(out["digests"], {"model": out["model"]}, {}) is None
    dt = time.perf_counter() - t0
    mngr.close()
    return dt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.checksum_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mtpjax-checksum-cost"))
    ap.add_argument("--json", type=json_path)
    args = ap.parse_args(argv)
    tree = state(args.gib)
    gib = sum(x.nbytes for x in tree.values()) / 2**30
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    host = [np.asarray(x) for x in tree.values()]  # on CPU, views of the arrays (materialized once here)
    t0 = time.perf_counter()
    for x in host:
        checksum.of_array(x)
    hash_s = time.perf_counter() - t0
    rng, times = random.Random(0), {k: [] for k in ("save", "save+digests", "restore", "restore+verify")}
    load_before = load()
    for _ in range(args.rounds):
        for with_digests in rng.sample([False, True], 2):
            d = args.dir / f"ck-{with_digests}"
            shutil.rmtree(d, ignore_errors=True)
            times["save+digests" if with_digests else "save"].append(save(d, tree, with_digests))
        for verify in rng.sample([False, True], 2):
            times["restore+verify" if verify else "restore"].append(restore(args.dir / "ck-True", target, verify))
    shutil.rmtree(args.dir, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratio = lambda a, b: float(np.median([x / y for x, y in zip(times[a], times[b])]))
    out = {"gib": round(gib, 3), "hash": checksum.ALGORITHM, "hash_alone_s": round(hash_s, 3),
           "hash_gib_per_s": round(gib / hash_s, 2), "median_s": {k: round(v, 3) for k, v in med.items()},
           "save_ratio": round(ratio("save+digests", "save"), 3),
           "restore_ratio": round(ratio("restore+verify", "restore"), 3),
           "cost_s_per_gib": {"save": round((med["save+digests"] - med["save"]) / gib, 3),
                              "restore": round((med["restore+verify"] - med["restore"]) / gib, 3)},
           "rounds": args.rounds, "load": [load_before, load()]}
    print(json.dumps(out, indent=1))
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
