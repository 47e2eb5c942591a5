"""Runs in a subprocess with 4 simulated CPU devices: one batch's gradient and metrics, and 20 train steps, with
pipeline stages (mesh.stage) and without, in float32.

argv: <corpus> <tmp dir> <out.json>. For each case it writes the largest relative gradient difference per
parameter (difference / the parameter gradient's largest magnitude) and the metrics of both runs.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import step_losses, synthetic_batches, tiny_cfg  # noqa: E402

from mtpjax.config import replace  # noqa: E402
from mtpjax.eval import validation  # noqa: E402
from mtpjax.nn import model as model_lib  # noqa: E402
from mtpjax.parallel import hlo, pipeline  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import backward, make_programs, split_trainable  # noqa: E402

DENSE = ["model.n_layers=4", "model.scan_layers=true"]
MLA_MOE = DENSE + [
    "model.n_kv_heads=4", "model.attention_kind=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.mlp_kind=moe",
    "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_group=2", "model.topk_group=1",
    "model.moe_d_ff=16", "loss.moe_seq_aux_loss=0.01", "model.tie_embeddings=false"]
DENSE5 = ["model.n_layers=5", "model.scan_layers=true"]
S2, S4, R2 = ["mesh.stage=2", "mesh.data=2"], ["mesh.stage=4"], ["mesh.stage_repeats=2"]
# (name, trunk, mtp depth, micro-batches, the staged mesh); expert 2: the MoE's own shard_map inside the stages'
CASES = [("dense_d1_s2", DENSE, 1, 4, S2), ("dense_d2_s2", DENSE, 2, 4, S2), ("dense_d2_s4", DENSE, 2, 8, S4),
         ("dense_d1_s4", DENSE, 1, 8, S4), ("moe_d2_s2", MLA_MOE, 2, 4, S2), ("moe_d1_s4", MLA_MOE, 1, 8, S4),
         ("moe_d2_s2_e2", MLA_MOE, 2, 4, ["mesh.stage=2", "mesh.expert=2"]),
         # uneven splits (mesh.stage_layers): 5 blocks as 3 + 2 (the stack, 5 long, held whole on each stage) and
         # the MoE trunk's 4 as 1 + 3 (held 2 + 2, each stage gathering its own)
         ("dense_d1_s2_uneven", DENSE5, 1, 4, [*S2, "mesh.stage_layers=[3,2]"]),
         ("moe_d2_s2_uneven", MLA_MOE, 2, 4, [*S2, "mesh.stage_layers=[1,3]"]),
         # circular (mesh.stage_repeats=2): stage s runs blocks s and s + 2 in turn; with 2 micro-batches on 2 stages
         # a micro-batch's second pass starts the tick the last stage sends it
         ("dense_d2_s2_r2", DENSE, 2, 4, [*S2, *R2]), ("dense_d1_s2_r2_m2", DENSE, 1, 2, ["mesh.stage=2", *R2]),
         ("moe_d1_s2_r2", MLA_MOE, 1, 4, [*S2, *R2])]


BATCH: list = []  # the one batch every case's gradient is taken on (set by main)
_STATES: dict = {}  # the model config's repr -> its initial state on the host: each model initialized once


def _step(cfg):
    """cfg's jitted backward and its arguments on cfg.mesh, from the model's initial state (computed on the first
    mesh that asks, then placed on each)."""
    m = cfg.mesh
    progs = make_programs(cfg, make_mesh(m, jax.devices()[:m.stage * m.data * m.fsdp * m.expert * m.tensor]))
    if repr(cfg.model) not in _STATES:
        _STATES[repr(cfg.model)] = jax.device_get(progs.init())
    state = jax.device_put(_STATES[repr(cfg.model)], progs.shardings)
    train, frozen = split_trainable(state.params)
    f = jax.jit(functools.partial(backward, graphdef=progs.graphdef, loss_cfg=cfg.loss,
                                  micro_batches=cfg.train.micro_batches, batch_sharding=progs.batch_sharding))
    put = lambda x: jax.device_put(x, progs.batch_sharding)
    return f, (train, frozen, put(BATCH[0][0]), put(BATCH[0][1]), state.step)


def one_batch(cfg) -> tuple[dict, dict]:
    """(gradient as a pure dict of arrays, metrics and expert loads as floats) of one batch on cfg.mesh."""
    f, args = _step(cfg)
    out = f(*args)
    mets = {k: float(v) for k, v in out.metrics.items()}
    mets |= {f"load/{k}": np.asarray(v).tolist() for k, v in out.loads.items()}
    return jax.tree.map(np.asarray, nnx.to_pure_dict(out.grads)), mets


_UNSTAGED: dict = {}


def unstaged(base, trunk: list, depth: int, A: int) -> tuple[dict, dict]:
    """one_batch on one device (no stages), once per configuration: the cases and the companion share it."""
    key = (tuple(trunk), depth, A)
    if key not in _UNSTAGED:
        _UNSTAGED[key] = one_batch(replace(base, [*trunk, f"model.mtp_depth={depth}", f"train.micro_batches={A}"]))
    return _UNSTAGED[key]


def rel_diff(a: dict, b: dict) -> dict:
    """Per leaf (path joined by '/'): max |a − b| / max |a|."""
    pairs = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    return {"/".join(str(getattr(k, "key", k)) for k in path): float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
            for (path, x), y in zip(pairs, flat_b)}


def compare(base, name, trunk, depth, A, staged) -> dict:
    """One case: stage=1 on one device against the staged mesh."""
    g1, m1 = unstaged(base, trunk, depth, A)
    g2, m2 = one_batch(replace(base, [*trunk, f"model.mtp_depth={depth}", f"train.micro_batches={A}", *staged]))
    return {"grad_rel": rel_diff(g1, g2), "single": m1, "staged": m2}


def dropped_embedding_tail(base) -> dict:
    """The companion: a schedule whose last stage reads the embedding without its gradient (the MTP modules' and
    the tied head's uses lost): the embedding's gradient must differ."""
    real = pipeline.forward

    def forward(model, *a, **k):
        model = nnx.clone(model)  # its own variables, which this trace may set
        model.embed.set_value(jax.lax.stop_gradient(model.embed.get_value()))
        return real(model, *a, **k)

    g1, _ = unstaged(base, DENSE, 2, 4)
    pipeline.forward = forward
    try:
        g2, _ = one_batch(replace(base, [*DENSE, "model.mtp_depth=2", "train.micro_batches=4", *S2]))
    finally:
        pipeline.forward = real
    return rel_diff(g1, g2)


def unmasked_padding(base) -> dict:
    """The companion of the uneven cases: a stage's padding applied as a block (its output kept): the loss moves."""
    real = pipeline.stage_state

    def stage_state(model):
        st, keep_L, layout = real(model)
        return st, jnp.ones_like(keep_L), layout

    pipeline.stage_state = stage_state
    try:
        return compare(base, "", DENSE5, 1, 4, [*S2, "mesh.stage_layers=[3,2]"])
    finally:
        pipeline.stage_state = real


def circular_out_of_order(base) -> dict:
    """The companion of the circular cases: each stage's contiguous blocks cut into its chunks (stage s running
    blocks 2s, 2s + 1 as its passes 1 and 2), so the blocks run out of order: the gradient moves."""
    real = pipeline.stage_blocks
    pipeline.stage_blocks = lambda pl, n_layers: None
    try:
        return compare(base, "", DENSE, 2, 4, [*S2, *R2])
    finally:
        pipeline.stage_blocks = real


def circular_flops(base) -> dict:
    """The trunk's MLP FLOPs per device (mtp_depth 0: no other MLP) on 2 stages × data 2 with 4 micro-batches:
    GPipe, then circular with 2 repeats."""
    cfg = replace(base, [*DENSE, "model.mtp_depth=0", "train.micro_batches=4", *S2])
    flops = lambda cfg: hlo.Program(_compiled_text(cfg), "mlp").stats().scoped_flops
    return {"gpipe": flops(cfg), "circular": flops(replace(cfg, R2))}


def circular_memory(base) -> dict:
    """Temporaries of the backward (remat full) on 2 stages × data 2 with 4 micro-batches: GPipe, circular with 2
    repeats, and the companion, circular with each tick's block read outside its remat (a copy kept per tick); with
    one block's parameter bytes and the circular schedule's ticks."""
    cfg = replace(base, [*DENSE, "model.mtp_depth=0", "train.micro_batches=4", *S2, "model.remat=full"])
    temps = lambda cfg: _compiled(cfg).memory_analysis().temp_size_in_bytes
    out = {"gpipe": temps(cfg), "circular": temps(replace(cfg, R2)), "ticks": 2 * 4 + 2 - 1}
    real = model_lib._run_block

    def read_outside(gdef, st, x, pos, seg, kv, remat, layer=None):
        if layer is not None:
            st = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, layer, 0, False), st)
        return real(gdef, st, x, pos, seg, kv, remat)

    model_lib._run_block = read_outside
    try:
        out["copied"] = temps(replace(cfg, R2))
    finally:
        model_lib._run_block = real
    blocks = nnx.to_pure_dict(_STATES[repr(cfg.model)].params)["blocks"]
    out["block_bytes"] = sum(v.nbytes for v in jax.tree.leaves(blocks)) // cfg.model.n_layers
    return out


def _compiled(cfg):
    f, args = _step(cfg)
    return f.lower(*args).compile()


def _compiled_text(cfg) -> str:
    return _compiled(cfg).as_text()


def compiled(cfg) -> hlo.Program:
    """cfg's compiled backward, its head's FLOPs scoped (`head`)."""
    return hlo.Program(_compiled_text(cfg), "head")


def oversized(prog: hlo.Program, cfg) -> list[str]:
    """Collectives moving an array larger than the largest parameter or one device's rows of the float32 residual
    stream (B / (data x fsdp x expert) rows: the stages split no input rows): an activation moved whole-batch."""
    m, (B, T) = cfg.mesh, BATCH[0][0].shape
    bound = max(max(int(np.prod(v.shape)) * 4 for v in jax.tree.leaves(_STATES[repr(cfg.model)].params)),
                B // (m.data * m.fsdp * m.expert) * T * cfg.model.d_model * 4)
    return [f"{c['kind']} {c['shape']} {c['op_name']}" for c in hlo.largest_collectives(prog.stats(), n=1000)
            if c["largest_array_bytes"] > bound]


def evaluation(base) -> dict:
    """The eval step's metrics and per-device FLOPs: one device, 2 stages × data 2 (pipelined), and the companion,
    the same mesh evaluated unpipelined (every device gathering and running every stage's blocks); then 4 stages
    whose micro-batches (2 rows) do not split over them, against one device."""
    cfg = replace(base, [*DENSE, "model.mtp_depth=2", "train.micro_batches=4"])
    cfg8 = replace(cfg, ["train.micro_batches=8"])

    def run(cfg):
        progs = make_programs(cfg, make_mesh(cfg.mesh, jax.devices()[:cfg.mesh.stage * cfg.mesh.data]))
        state = jax.device_put(_STATES.setdefault(repr(cfg.model), jax.device_get(progs.init())), progs.shardings)
        args = (state, *(jax.device_put(x, progs.batch_sharding) for x in BATCH[0]))
        mets = {k: float(v) for k, v in progs.eval_step(*args).items() if k != validation.COUNTS}
        return mets, hlo.Program(progs.eval_step.lower(*args).compile().as_text()).stats().flops

    out = {"single": run(cfg), "staged": run(replace(cfg, S2))}
    out |= {"single_8": run(cfg8), "staged_s4": run(replace(cfg8, S4))}
    real = pipeline.stage_count
    pipeline.stage_count = lambda model: 1
    try:
        out["unpipelined"] = run(replace(cfg, S2))
    finally:
        pipeline.stage_count = real
    return out


def psum_drain(last, axis, layout):
    """The companion's drain: psum_scatter / psum over the stages (XLA gathers the batch shards first)."""
    return (jax.lax.psum_scatter(last, axis, scatter_dimension=2, tiled=True) if layout == "rows"
            else jax.lax.psum(last, axis))


def tail_split(base) -> dict:
    """The head's FLOPs per device: one device; 2 stages × data 2 (the tail's rows split over all 4); and the
    companion, the same mesh with a tail every stage repeats (split over data alone). Then 4 stages, whose micro-
    batches (2 rows) do not split over them: one device, the stages taking every 4th micro-batch, and the companion
    repeating the tail on every stage. With them, the staged program's collectives larger than a device's rows
    (issue 49's boundary), and those of a psum drain."""
    cfg = replace(base, [*DENSE, "model.mtp_depth=2", "train.micro_batches=4"])
    cfg4 = replace(base, [*DENSE, "model.mtp_depth=2", "train.micro_batches=8"])
    staged = compiled(replace(cfg, S2))
    out = {"single": compiled(cfg).stats().scoped_flops, "staged": staged.stats().scoped_flops,
           "oversized": oversized(staged, replace(cfg, S2)), "single_s4": compiled(cfg4).stats().scoped_flops,
           "staged_s4": compiled(replace(cfg4, S4)).stats().scoped_flops}
    real, real_drain = pipeline.tail_layout, pipeline.drain
    pipeline.tail_layout = lambda model, rows, micro_batches: ""
    try:
        out["repeated"] = compiled(replace(cfg, S2)).stats().scoped_flops
        out["repeated_s4"] = compiled(replace(cfg4, S4)).stats().scoped_flops
    finally:
        pipeline.tail_layout = real
    pipeline.drain = psum_drain
    try:
        out["oversized_psum_drain"] = oversized(compiled(replace(cfg, S2)), replace(cfg, S2))
    finally:
        pipeline.drain = real_drain
    return out


def training(base, batches) -> dict:
    """20 steps with stage=1 (one device) and stage=2 × data=2: final parameters' largest relative difference."""
    # optim.eps 1e-3: Adam divides by sqrt(v) + eps, and at 1e-8 it lifts the float32 rounding of near-zero
    # gradients to whole steps (tests/test_sharding.py sees ~1e-4 of one); at 1e-3 such noise stays noise.
    # micro-batches 2: 4 rows each, so the tail splits over stage × data (tail_split)
    cfg = replace(base, [*DENSE, "model.mtp_depth=2", "train.micro_batches=2", "train.steps=20", "optim.eps=1e-3"])
    l1, s1 = step_losses(cfg, batches, jax.devices()[:1])
    l2, s2 = step_losses(replace(cfg, S2), batches)
    p1, p2 = (jax.tree.map(np.asarray, nnx.to_pure_dict(s.params)) for s in (s1, s2))
    a, b = (np.concatenate([x.ravel() for x in jax.tree.leaves(p)]) for p in (p1, p2))
    return {"losses": [l1, l2], "param_rel": rel_diff(p1, p2),
            "param_norm_rel": float(np.linalg.norm(a - b) / np.linalg.norm(a))}


def main() -> None:
    corpus, tmp, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    base = tiny_cfg(tmp, corpus=corpus)
    batches = synthetic_batches(20, 8, 32)
    # 16 rows: with 4 micro-batches, the 2-stage cases' tails split over stage × data (or expert); the 4-stage
    # cases' micro-batches (2 rows) do not split over 4: each stage runs the tail of every 4th micro-batch
    BATCH.append(synthetic_batches(1, 16, 32, seed=1)[0])
    res = {name: compare(base, name, *rest) for name, *rest in CASES}
    res["dropped_embedding_tail"] = dropped_embedding_tail(base)
    res["unmasked_padding"] = unmasked_padding(base)
    res["circular_out_of_order"] = circular_out_of_order(base)
    res["circular_flops"] = circular_flops(base)
    res["circular_memory"] = circular_memory(base)
    res["tail_split"] = tail_split(base)
    res["evaluation"] = evaluation(base)
    res["training"] = training(base, batches)
    out.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
