"""Two CPU devices in one process: digests saved under one layout are checked under another (a shard held whole
by no device is gathered), and a changed element is still caught. argv: <checkpoint dir>; prints one JSON line."""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import shutil  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtpjax.train import digests  # noqa: E402


def save_and_restore(d: str, x, target):
    """Save {"w": x} with its digests at step 1 of `d`, restore it onto `target`: (arrays, digest record)."""
    shutil.rmtree(d, ignore_errors=True)
    m = ocp.CheckpointManager(d)
    m.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave({"w": x}),
                                      digests=digests.DigestSave({"model": {"w": x}}, {})))
    m.wait_until_finished()
    out = m.restore(1, args=ocp.args.Composite(model=ocp.args.StandardRestore({"w": target}),
                                               digests=digests.DigestRestore()))
    m.close()
    return out["model"], out["digests"]


def main(d: str) -> dict:
    res, halves = {}, NamedSharding(jax.make_mesh((2,), ("d",)), P("d"))
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    arrays, record = save_and_restore(d, jax.device_put(w, SingleDeviceSharding(jax.devices()[0])),
                                      jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=halves))
    res["holder"] = digests._holder(arrays["w"], ((0, 8), (0, 8)))  # no device holds the saved whole
    res["whole_to_halves"] = digests.first_mismatch(record, {"model": arrays}, {})
    changed = np.asarray(arrays["w"]).copy()
    changed[7, 7] = 0.5
    res["changed"] = digests.first_mismatch(record, {"model": {"w": jax.device_put(changed, halves)}}, {})
    arrays, record = save_and_restore(d, jax.device_put(w, halves), jax.ShapeDtypeStruct(
        w.shape, w.dtype, sharding=SingleDeviceSharding(jax.devices()[1])))
    res["regions"] = sorted(record["arrays"]["model"]["w"])  # saved in halves: one digest each
    res["halves_to_whole"] = digests.first_mismatch(record, {"model": arrays}, {})
    return res


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
