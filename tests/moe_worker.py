"""Runs in a subprocess with 8 simulated CPU devices: an MoE model's loss and gradients on meshes with an expert axis
against one device, and where the expert weights really live.

argv: <in.json> <out.json>; in.json holds the config overrides; out.json the largest differences per mesh.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import synthetic_batches  # noqa: E402

from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import loss_and_grads, make_programs, split_trainable  # noqa: E402

MESHES = {"data2-expert4": (2, 1, 4, 1), "fsdp2-expert2-tensor2": (1, 2, 2, 2)}


def loss_grads(cfg, devices):
    """(loss, flat gradients, spec of the first trunk MoE layer's w_gate) of one batch on cfg.mesh over devices."""
    progs = make_programs(cfg, make_mesh(cfg.mesh, devices))
    state = progs.init()
    train, frozen = split_trainable(state.params)
    tok, seg = (jax.device_put(x, progs.batch_sharding) for x in synthetic_batches(1, 8, 32)[0])
    f = jax.jit(functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss,
                                  micro_batches=cfg.train.micro_batches, batch_sharding=progs.batch_sharding))
    grads, met = f(train, frozen, tok, seg, state.step)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
        jax.tree.map(lambda v: v.get_value(), grads, is_leaf=lambda x: hasattr(x, "get_value")))[0]}
    spec = str(state.params["blocks"][1]["mlp"]["w_gate"][...].sharding.spec)
    return float(met["loss/total"]), flat, spec


def main() -> None:
    inp = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(None, inp["overrides"])
    ref_loss, ref_g, _ = loss_grads(cfg, jax.devices()[:1])
    out = {}
    for name, (d, f, e, t) in MESHES.items():
        mcfg = replace(cfg, [f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.expert={e}", f"mesh.tensor={t}"])
        loss, g, spec = loss_grads(mcfg, jax.devices())
        out[name] = {"loss": loss, "ref_loss": ref_loss, "spec": spec,
                     "grad_err": max(float(np.max(np.abs(g[k] - ref_g[k])) / (np.max(np.abs(ref_g[k])) + 1e-12))
                                     for k in ref_g)}
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
