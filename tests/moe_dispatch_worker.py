"""Runs in a subprocess with 2 simulated CPU devices: the expert-parallel dispatch with buffers sized by
model.moe_buffer_factor against the dropless one and one device, and what it drops on routings built by hand.

argv: <out.json>. out.json holds, per check, the numbers the test asserts on (and the broken variants' numbers, the
companions): "layer" (an MoE layer's loss and gradients per factor), "overflow" (a hand-built routing's dropped
count and output per factor), "decode" (greedy tokens of a model that drops in training), "step" (the train
step's reported dropped fractions with every token forced onto one shard's experts), "scatters" (float row
scatters in the dispatch's compiled gradient program).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import mtpjax.nn.moe as moe  # noqa: E402
from mtpjax.config import load_config  # noqa: E402
from mtpjax.decode import generate, loop as decode_loop  # noqa: E402
from mtpjax.decode.mesh import on_mesh  # noqa: E402
from mtpjax.nn.model import build_model, moe_layers  # noqa: E402
from mtpjax.nn.placement import host_placement  # noqa: E402
from mtpjax.parallel.sharding import make_mesh, placement  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402

MOE = ["model.mlp_kind=moe", "model.n_routed_experts=8", "model.num_experts_per_tok=3", "model.n_group=4",
       "model.topk_group=2", "model.moe_d_ff=16", "model.n_shared_experts=1", "model.first_k_dense_replace=1",
       "model.routed_scaling_factor=2.0", "model.d_model=16", "model.init_std=0.5", "mesh.expert=2"]
SIZED = 1.75  # rows 32 per shard, k 3: a buffer of 84 rows per pair against the worst case's 96


def wrong_dispatch(e_S, w_S, experts_per_shard, shards):
    """Every slot sent to the next shard: its rows meet another shard's experts."""
    order, dest, pos = RIGHT(e_S, w_S, experts_per_shard, shards)
    return order, (dest + 1) % shards, pos


def lightest_first(e_S, w_S, experts_per_shard, shards):
    """The buffers filled lightest slot first: an overflow drops the heaviest."""
    return RIGHT(e_S, -w_S, experts_per_shard, shards)


RIGHT = moe.dispatch_positions


def layer_loss_grads(factor: float, where) -> dict:
    """An MoE layer's loss sum(y·r), its gradients (parameters and input) and dropped slots, built for `where`."""
    cfg = load_config(None, MOE + [f"model.moe_buffer_factor={factor}"]).model
    layer = moe.MoE(cfg, nnx.Rngs(params=1), where)
    layer.bias[...] = jnp.asarray(np.random.default_rng(2).normal(0, 0.3, 8), jnp.float32)
    rng = np.random.default_rng(3)
    x_BTD = jnp.asarray(rng.normal(size=(4, 16, 16)), jnp.float32)
    r_BTD = jnp.asarray(rng.normal(size=(4, 16, 16)), jnp.float32)
    seg_BT = jnp.ones((4, 16), jnp.int32).at[1, 12:].set(0)
    gdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        y, aux = nnx.merge(gdef, params, rest)(x, seg_BT)
        return (y.astype(jnp.float32) * r_BTD).sum(), aux["dropped"]

    (value, dropped), (g_p, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x_BTD)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(
        jax.tree.map(lambda v: v.get_value(), g_p, is_leaf=lambda v: hasattr(v, "get_value")))[0]}
    return {"loss": float(value), "grads": {**flat, "x": np.asarray(g_x)}, "dropped": int(dropped)}


def rel_err(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k])) / (np.max(np.abs(b[k])) + 1e-12)) for k in b)


def layer_checks(mesh) -> dict:
    """Loss and gradients of the layer with a sized buffer that drops nothing against the dropless one and one
    device; the companion: the sized buffer with a wrong dispatch."""
    on_mesh = placement(mesh)
    ref, dropless, sized = (layer_loss_grads(0.0, host_placement()), layer_loss_grads(0.0, on_mesh),
                            layer_loss_grads(SIZED, on_mesh))
    with mock.patch.object(moe, "dispatch_positions", wrong_dispatch):
        wrong = layer_loss_grads(SIZED, on_mesh)
    out = {"capacity": moe.capacity(32, 3, 4, 2, SIZED), "worst": moe.capacity(32, 3, 4, 2, 0.0)}
    for name, r in (("dropless", dropless), ("sized", sized), ("wrong-dispatch", wrong)):
        out[name] = {"loss": r["loss"], "dropped": r["dropped"],
                     "grad_err_vs_dropless": rel_err(r["grads"], dropless["grads"]),
                     "grad_err_vs_one_device": rel_err(r["grads"], ref["grads"])}
    out["ref_loss"] = ref["loss"]
    return out


# A routing built by hand: 12 tokens, 6 per shard, k = 2 of 4 experts (2 per shard). Shard 0's tokens all choose
# experts 0 and 1 (12 slots for shard 0), shard 1's choose 0 and 2 (6 and 6). Token 5 is padding and weighs least.
IDX = np.array([[0, 1]] * 6 + [[0, 2]] * 6, np.int32)
W = np.random.default_rng(4).uniform(0.1, 1.0, (12, 2)).astype(np.float32)
W[5] = (0.01, 0.02)
REAL = np.arange(12) != 5


def expected_drops(cap: int) -> np.ndarray:
    """bool[12, 2]: the slots a buffer of `cap` rows per pair of shards drops, by the documented rule (per sending
    shard and destination, the heaviest `cap` slots kept, ties in slot order)."""
    drop = np.zeros((12, 2), bool)
    for src in range(2):
        for dest in range(2):
            slots = [(t, j) for t in range(6 * src, 6 * src + 6) for j in range(2) if IDX[t, j] // 2 == dest]
            for t, j in sorted(slots, key=lambda s: -W[s])[cap:]:
                drop[t, j] = True
    return drop


def overflow_checks(mesh) -> dict:
    """The dropped count and output of the hand-built routing per factor, against the rule's drops (the output: the
    dropless one with the dropped slots' weights zeroed); companions: a dispatch that ignores the factor and one that
    drops the heaviest slots."""
    ep = moe.expert_parallel(placement(mesh))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(12, 8)), jnp.float32)
    ws = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((4, 8, 8), (4, 8, 8), (4, 8, 8)))

    def run(factor, w=W):
        f = jax.jit(lambda *a: moe.expert_parallel_routed(*a, ep, "blocks", factor))
        y, dropped = f(x, jnp.asarray(IDX), jnp.asarray(w), jnp.asarray(REAL), *ws)
        return np.asarray(y), int(dropped)

    out = {}
    for factor in (1.0, 0.5):
        cap = moe.capacity(6, 2, 2, 2, factor)
        drop = expected_drops(cap)
        want, _ = run(0.0, np.where(drop, 0.0, W).astype(np.float32))
        y, dropped = run(factor)
        with mock.patch.object(moe, "capacity", lambda rows, k, e, s, f: rows * min(k, e)):
            y_ignored, dropped_ignored = run(factor)
        with mock.patch.object(moe, "dispatch_positions", lightest_first):
            y_heaviest, _ = run(factor)
        err = lambda a, want=want: float(np.max(np.abs(a - want)) / np.max(np.abs(want)))
        out[str(factor)] = {"cap": cap, "dropped": dropped, "want_dropped": int((drop & REAL[:, None]).sum()),
                            "slots_dropped": int(drop.sum()), "err": err(y),
                            "ignored": {"dropped": dropped_ignored, "err": err(y_ignored)},
                            "heaviest_dropped": {"err": err(y_heaviest)}}
    return out


def step_checks() -> dict:
    """The train step's dropped fractions (per layer and overall) with every token's k = 2 slots forced onto shard 0's
    experts: each shard sends 2N slots where its buffer holds N (factor 1), so exactly half are dropped; factor 0
    drops none."""
    out = {}
    for factor in (1.0, 0.0):
        cfg = load_config(None, MOE + [
            "model.num_experts_per_tok=2", "model.vocab_size=64", "model.n_layers=2", "model.n_heads=2",
            "model.n_kv_heads=1", "model.mtp_depth=1", "data.seq_len=16", "train.batch_size=4",
            f"model.moe_buffer_factor={factor}"])
        progs = make_programs(cfg, make_mesh(cfg.mesh))
        state = progs.init()
        model = nnx.merge(progs.graphdef, state.params)
        for layer in moe_layers(model).values():  # experts 0 and 1 (group 0), both on shard 0
            layer.bias[...] = jnp.asarray([10.0, 10.0] + [-10.0] * 6, jnp.float32)
        state = jax.device_put(state.replace(params=nnx.state(model)), progs.shardings)
        tok = jnp.asarray(np.random.default_rng(6).integers(1, 64, (4, 16)), jnp.int32)
        _, met = progs.train_step(state, tok, jnp.ones_like(tok))
        out[str(factor)] = {k: float(v) for k, v in met.items() if k.endswith("dropped_fraction")}
    return out


def row_scatters(mesh) -> dict:
    """Scatters of float rows in the optimized program of the dispatch's loss and gradients (ragged_dot grouping, so
    only the dispatch moves rows): the dispatch's gathers, and the companion where `move` is a plain gather, whose
    gradient autodiff writes as a scatter-add."""
    ep = moe.expert_parallel(placement(mesh))
    rng = np.random.default_rng(5)
    args = (jnp.asarray(rng.normal(size=(12, 8)), jnp.float32), jnp.asarray(IDX), jnp.asarray(W), jnp.asarray(REAL),
            *(jnp.asarray(rng.normal(size=(4, 8, 8)), jnp.float32) for _ in range(3)))

    def count() -> int:
        loss = lambda x, *ws: moe.expert_parallel_routed(x, *args[1:4], *ws, ep, "ragged", 1.0)[0].sum()
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(args[0], *args[4:]).compile().as_text()
        return len(re.findall(r"= f32\[\d+,\d+\]\S* scatter\(", text))

    plain = lambda x, to, readers, fill=True: x.at[to].get(mode="fill", fill_value=0)
    out = {"move": count()}
    with mock.patch.object(moe, "move", plain):
        out["plain_gather"] = count()
    return out


def decode_checks() -> dict:
    """Greedy tokens of a model whose buffer factor (0.1) drops most slots in training: speculative on the 2-device
    expert mesh and plain on one device (decoding runs dropless), and the companion: the mesh's loop on the model as
    built, its buffers sized by the factor."""
    cfg = load_config(None, MOE + ["model.num_experts_per_tok=2", "model.vocab_size=64", "model.n_layers=2",
                                   "model.n_heads=2", "model.n_kv_heads=1", "model.mtp_depth=1", "data.seq_len=32",
                                   "model.moe_buffer_factor=0.1"])
    model = build_model(cfg, seed=0)
    prompts = [[3, 9, 27, 17, 51], [5, 8, 13, 21]]
    sharded = on_mesh(model, make_mesh(cfg.mesh))
    out = {"one_plain": generate(model, prompts, max_new_tokens=8).tokens,
           "mesh_speculative": generate(sharded, prompts, max_new_tokens=8, draft=1).tokens}
    jax.clear_caches()  # the loop is compiled again, without for_decoding
    with mock.patch.object(decode_loop, "for_decoding", lambda m: m):
        out["mesh_as_built"] = generate(sharded, prompts, max_new_tokens=8, draft=1).tokens
    return out


def main() -> None:
    mesh = make_mesh(load_config(None, MOE).mesh)
    out = {"decode": decode_checks(), "layer": layer_checks(mesh), "overflow": overflow_checks(mesh),
           "step": step_checks(), "scatters": row_scatters(mesh)}
    Path(sys.argv[1]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
