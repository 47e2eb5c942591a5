"""Runs in a subprocess with 8 simulated CPU devices (the pytest process stays single-device).

argv: <in.json> <out.json>. Writes step losses on three meshes (and on (2,2,2) with a wrong batch split), the
shardings parameters really got, the histories of a run saved on (2,2,2) and resumed on (8,1,1), and main()'s
answer to a batch that data parallelism does not divide.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import cli_args, step_losses, synthetic_batches, tiny_cfg  # noqa: E402

from jax.sharding import PartitionSpec as P  # noqa: E402

from mtpjax.train.checkpoint import Checkpointer  # noqa: E402
from mtpjax.config import replace  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402
from mtpjax.cli.train import main  # noqa: E402
from mtpjax.train.loop import train  # noqa: E402

MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]


def shardings(state) -> dict:
    """Spec and per-device shard shape of a few parameters and their Adam moments."""
    model = state.params
    mu = state.opt.inner_state[1][0].mu  # injected chain(clip, adamw): adamw's ScaleByAdamState
    picks = {"embed": (model["embed"], mu["embed"]),
             "wq": (model["blocks"][0]["attn"]["wq"]["kernel"], mu["blocks"][0]["attn"]["wq"]["kernel"]),
             "down": (model["blocks"][0]["mlp"]["down"]["kernel"], mu["blocks"][0]["mlp"]["down"]["kernel"])}
    out = {}
    for name, (p, m) in picks.items():
        arr, marr = p[...], m[...]
        out[name] = {"spec": str(arr.sharding.spec), "mu_spec": str(marr.sharding.spec), "global": arr.shape,
                     "shard": arr.addressable_shards[0].data.shape}
    return out


def save_and_restore(cfg, state, tmp: Path) -> bool:
    """Checkpoint a (2,2,2) state, dump its values, restore onto (1,4,2): equal values, target layout?"""
    ck = Checkpointer(tmp / "ck222", cfg.checkpoint)
    ck.save(1, state, {}, {"config": cfg.to_dict()}, force=True)
    ck.close()
    np.savez(tmp / "ck222.npz", *[np.asarray(x) for x in jax.tree.leaves(state)])
    c142 = replace(cfg, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"])
    target = make_programs(c142, make_mesh(c142.mesh)).target
    restored, _, _ = Checkpointer(tmp / "ck222", cfg.checkpoint).restore(1, target)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding == t.sharding
               for a, b, t in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target)))
    return same and str(restored.params["embed"][...].sharding.spec) == str(P("tensor", "fsdp"))


def main_worker(inp: dict) -> dict:
    assert jax.device_count() == 8
    tmp, corpus, n = Path(inp["tmp"]), Path(inp["corpus"]), inp["steps"]
    cfg = tiny_cfg(tmp, f"train.steps={n}", corpus=corpus, run="mesh-run")
    batches = synthetic_batches(1, cfg.train.batch_size, cfg.data.seq_len) * 3
    out = {"losses": {}, "shardings": {}}
    for shape in MESHES:
        mcfg = replace(cfg, [f"mesh.data={shape[0]}", f"mesh.fsdp={shape[1]}", f"mesh.tensor={shape[2]}"])
        losses, state = step_losses(mcfg, batches)
        out["losses"][str(shape)] = losses
        out["shardings"][str(shape)] = shardings(state)
        if shape == (2, 2, 2):
            out["restored_on_142"] = save_and_restore(mcfg, state, tmp)

    # Save on (2,2,2) at n/2, keep a copy for a single-device resume, resume here on (8,1,1).
    c222 = replace(cfg, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    # Companion: on (2,2,2), data shard 1 given shard 0's rows (a batch split that reads the wrong rows).
    half = cfg.train.batch_size // 2
    wrong = [tuple(np.concatenate([x[:half], x[:half]]) for x in b) for b in batches]
    out["losses_wrong_split"] = step_losses(c222, wrong)[0]
    first = train(c222, max_steps=n // 2)
    shutil.copytree(c222.train.run_dir, tmp / "mesh-run-copy")
    second = train(replace(cfg, ["mesh.data=8"]))
    out["history"] = first["history"] + second["history"]

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        bad = replace(cfg, ["mesh.data=8", "train.batch_size=12", "train.run_dir=" + str(tmp / "bad-run")])
        out["bad_batch"] = {"rc": main(cli_args(bad)), "stderr": err.getvalue()}
    return out


if __name__ == "__main__":
    result = main_worker(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result, default=lambda x: list(x) if isinstance(x, tuple) else str(x)))
