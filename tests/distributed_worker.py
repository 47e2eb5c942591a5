"""One process with 4 CPU devices: the single-process twin of a 2-process run of launch/local.sh, then resumes.

argv: <in.json> <out.json>. Trains the same config and mesh here (run dir `solo`) for train.steps, then resumes
both that run and the 2-process run dir here with `resume_steps` steps. Also trains on global batches whose
second half repeats the first (what the run would see if both processes fed the same rows). Writes the
TensorBoard losses of `solo`, the resumed histories, and that companion's losses.
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
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.loop import train  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402


def scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def same_rows_losses(cfg) -> list[float]:
    """loss/main per step when both halves of every global batch are its first half."""
    it = data.make_iterator(data.prepare(cfg.data), split="train", seq_len=cfg.data.seq_len,
                            batch_size=cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state, out, half = progs.init(), [], cfg.train.batch_size // 2
    for _ in range(cfg.train.steps):
        b = next(it)
        put = lambda x: jax.device_put(np.concatenate([x[:half], x[:half]]).astype(np.int32), progs.batch_sharding)
        state, met = progs.train_step(state, put(b["tokens"]), put(b["segment_ids"]))
        out.append(float(met["loss/main"]))
    return out


def main_worker(inp: dict) -> dict:
    assert jax.device_count() == 4 and jax.process_count() == 1
    cfg = load_config(inp["config"], inp["overrides"])
    two_run = Path(cfg.train.run_dir)
    solo = replace(cfg, [f"train.run_dir={two_run.parent / 'solo'}"])
    train(solo)
    tb = Path(solo.train.run_dir) / "tensorboard"
    logged = {k: scalars(tb, f"loss/{k}") for k in ("main", "mtp_1", "mtp_2")}
    longer = [f"train.steps={inp['resume_steps']}"]
    resumed_solo = train(replace(solo, longer))["history"]
    resumed_two = train(replace(cfg, longer))["history"]
    return {"solo": logged, "resumed_solo": resumed_solo, "resumed_two": resumed_two,
            "same_rows": same_rows_losses(cfg)}


if __name__ == "__main__":
    result = main_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
