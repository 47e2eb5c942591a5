"""One process with 4 CPU devices: the reference for a 2-process run of launch/local.sh, then its resume.

argv: <in.json> <out.json>. Rebuilds the batches each of 2 processes read (process_index 0 and 1 of 2),
trains on their concatenation (the global batch) and, from step `first` on, on a 1-process iterator at
the same batch index; then resumes the 2-process run dir here with train(). Writes the first local
batches, the reference metrics per step, and the resumed history.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

from mtpjax import data  # noqa: E402
from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.sharding import make_mesh  # noqa: E402
from mtpjax.train_loop import train  # noqa: E402
from mtpjax.train_step import make_programs  # noqa: E402


def iterator(cfg, prepared, index: int, count: int):
    return data.make_iterator(prepared, split="train", seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                              seed=cfg.train.seed, shuffle=cfg.data.shuffle, process_index=index,
                              process_count=count)


def run_steps(progs, state, batches):
    mets = []
    for b in batches:
        put = lambda x: jax.device_put(np.asarray(x, np.int32), progs.batch_sharding)
        state, met = progs.train_step(state, put(b["tokens"]), put(b["segment_ids"]))
        mets.append({k: float(v) for k, v in jax.device_get(met).items()})
    return state, mets


def main_worker(inp: dict) -> dict:
    assert jax.device_count() == 4 and jax.process_count() == 1
    cfg = load_config(inp["config"], inp["overrides"])
    first, total = cfg.train.steps, inp["resume_steps"]
    prepared = data.prepare(cfg.data)
    it0, it1, solo = iterator(cfg, prepared, 0, 2), iterator(cfg, prepared, 1, 2), iterator(cfg, prepared, 0, 1)
    local = [(next(it0), next(it1)) for _ in range(first)]
    glob = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in local]
    for _ in range(first):
        next(solo)  # the resumed 1-process iterator continues at the same batch index of its own shard
    later = [next(solo) for _ in range(total - first)]

    mesh = make_mesh(cfg.mesh)
    progs = make_programs(cfg, mesh)
    state, ref = run_steps(progs, progs.init(), glob)
    longer = replace(cfg, [f"train.steps={total}"])  # the resumed run's LR schedule spans the new step count
    _, ref_later = run_steps(make_programs(longer, mesh), state, later)
    # The same model fed process 0's rows twice: what the run would show if both processes read one shard.
    same = [{k: np.concatenate([a[k], a[k]]) for k in a} for a, _ in local]
    _, ref_same = run_steps(progs, progs.init(), same)

    resumed = train(longer)
    return {"first_tokens": [np.asarray(local[0][0]["tokens"]).tolist(), np.asarray(local[0][1]["tokens"]).tolist()],
            "reference": ref + ref_later, "reference_same_shard": ref_same, "resumed": resumed["history"]}


if __name__ == "__main__":
    result = main_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
