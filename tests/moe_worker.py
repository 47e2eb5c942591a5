"""Runs in a subprocess with 8 simulated CPU devices: an MoE model's loss and gradients on meshes with an expert axis
against one device, where the expert weights really live, and which collectives the compiled step holds.

argv: <in.json> <out.json>; in.json holds the config overrides; out.json the largest differences per mesh (and with
a dispatch that sends every slot one shard too far: "wrong-dispatch"), and per program ("expert-parallel", and
"gspmd": the same mesh with the MoE left to the partitioner) its all-to-alls and collectives moving expert weights.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import synthetic_batches  # noqa: E402

import mtpjax.nn.moe as moe  # noqa: E402
import mtpjax.train.step as step  # noqa: E402
from mtpjax.config import load_config, replace  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import loss_and_grads, make_programs, split_trainable  # noqa: E402

MESHES = {"data2-expert4": (2, 1, 4, 1), "fsdp2-expert2-tensor2": (1, 2, 2, 2)}


def programs(cfg, devices):
    """(compiled loss-and-gradients function, its arguments, spec of the first trunk MoE layer's w_gate)."""
    progs = make_programs(cfg, make_mesh(cfg.mesh, devices))
    state = progs.init()
    train, frozen = split_trainable(state.params)
    tok, seg = (jax.device_put(x, progs.batch_sharding) for x in synthetic_batches(1, 8, 32)[0])
    f = jax.jit(functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss,
                                  micro_batches=cfg.train.micro_batches, batch_sharding=progs.batch_sharding))
    spec = str(state.params["blocks"][1]["mlp"]["w_gate"][...].sharding.spec)
    return f, (train, frozen, tok, seg, state.step), spec


def loss_grads(cfg, devices):
    """(loss, flat gradients, spec of the first trunk MoE layer's w_gate) of one batch on cfg.mesh over devices."""
    f, args, spec = programs(cfg, devices)
    grads, met = f(*args)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
        jax.tree.map(lambda v: v.get_value(), grads, is_leaf=lambda x: hasattr(x, "get_value")))[0]}
    return float(met["loss/total"]), flat, spec


def collectives(cfg) -> dict:
    """Counts of all-to-alls and of collectives carrying more experts' weights ([n, D, F] or [n, F, D]) than one
    expert shard holds: the partitioner's way of bringing weights to tokens (a gradient's all-reduce over the data
    axis carries one shard's own, n = E / mesh.expert)."""
    f, args, _ = programs(cfg, jax.devices())
    hlo = f.lower(*args).compile().as_text()
    E, D, F = cfg.model.n_routed_experts, cfg.model.d_model, cfg.model.moe_d_ff
    ops = [h.groups() for h in re.finditer(r"= *(.*?) ([a-z][a-z-]*)\(", hlo)]  # (result shape, opcode)
    moves = lambda shape: any(int(n) > E // cfg.mesh.expert and (int(a), int(b)) in ((D, F), (F, D))
                              for n, a, b in re.findall(r"\[(\d+),(\d+),(\d+)\]", shape))
    return {"all_to_all": sum(code == "all-to-all" for _, code in ops),
            "expert_weight_moves": sum(code.startswith(("all-", "collective-", "reduce-scatter")) and moves(shape)
                                       for shape, code in ops)}


def wrong_dispatch(e_S, w_S, experts_per_shard, shards):
    """dispatch_positions with every slot sent to the next shard: its rows meet another shard's experts."""
    order, dest, pos = RIGHT_DISPATCH(e_S, w_S, experts_per_shard, shards)
    return order, (dest + 1) % shards, pos


RIGHT_DISPATCH = moe.dispatch_positions


def main() -> None:
    inp = json.loads(Path(sys.argv[1]).read_text())
    cfg = load_config(None, inp["overrides"])
    ref_loss, ref_g, _ = loss_grads(cfg, jax.devices()[:1])
    out = {}

    def compare(name, mcfg):
        loss, g, spec = loss_grads(mcfg, jax.devices())
        out[name] = {"loss": loss, "ref_loss": ref_loss, "spec": spec,
                     "grad_err": max(float(np.max(np.abs(g[k] - ref_g[k])) / (np.max(np.abs(ref_g[k])) + 1e-12))
                                     for k in ref_g)}

    meshes = {name: replace(cfg, [f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.expert={e}", f"mesh.tensor={t}"])
              for name, (d, f, e, t) in MESHES.items()}
    for name, mcfg in meshes.items():
        compare(name, mcfg)
    moe.dispatch_positions = wrong_dispatch
    compare("wrong-dispatch", meshes["data2-expert4"])
    moe.dispatch_positions = RIGHT_DISPATCH
    out["expert-parallel"] = collectives(meshes["data2-expert4"])
    right_placement = step.run_placement
    # the MoE left to GSPMD, as before expert parallelism: a placement without an expert axis
    step.run_placement = lambda *a: dataclasses.replace(right_placement(*a), expert_axis=None)
    out["gspmd"] = collectives(meshes["data2-expert4"])
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
