"""Runs in a subprocess with 8 simulated CPU devices: compiles the train and eval steps of a small model on fsdp 4 x
tensor 2 and writes what the test of tests/test_collectives.py bounds.

argv: <patch> <out.json>. patch: `none`, or `no_batch_rule` (the activation rule of the batch rows removed: no
activation is held split by rows) or `no_swap_in_head` (the head flattens its [M,B,C,D] states depth-first, so the
batch axes no longer split the flattened rows). Writes, per program, the largest collectives (parallel.hlo), the
largest parameter's bytes and the shape numbers the bound is made of.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtpjax.config import load_config  # noqa: E402
from mtpjax.nn import loss  # noqa: E402
from mtpjax.parallel import hlo, sharding  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402
from mtpjax.train.step import make_programs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Widths chosen apart (D 128, F 384, V 1024, 2·8·64 rows per chunk) and a batch of 16 x 128 tokens, so that the whole
# batch's activations outweigh every parameter: a collective of an activation that lost its rows' split stands out.
OVERRIDES = ["model.n_layers=2", "model.d_ff=384", "train.batch_size=16", "data.seq_len=128", "loss.chunk_size=64",
             "mesh.fsdp=4", "mesh.tensor=2"]


def _head_depth_first(model, h_MBCD):
    on = model.placement.constrain
    with jax.named_scope("head"):
        logits_MBCV = on(model.logits(h_MBCD), None, "batch", "length", "vocab")
        return jnp.swapaxes(logits_MBCV, 0, 1)


def main(patch: str, out: str) -> None:
    if patch == "no_batch_rule":
        sharding.ACTIVATION_RULES["batch"] = ()
    elif patch == "no_swap_in_head":
        loss._head = _head_depth_first
    cfg = load_config(ROOT / "configs" / "tiny.yaml", OVERRIDES)
    mesh = make_mesh(cfg.mesh)
    programs = make_programs(cfg, mesh)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=programs.batch_sharding)
    params = jax.tree.leaves(programs.target.params)
    result = {"largest_parameter_bytes": max(int(np.prod(p.shape)) * p.dtype.itemsize for p in params),
              "rows_per_device": B // sharding.data_parallelism(mesh), "T": T, "D": cfg.model.d_model,
              "F": cfg.model.resolved_d_ff, "V": cfg.model.vocab_size, "tensor": mesh.shape["tensor"],
              "M": 1 + cfg.model.mtp_depth, "C": cfg.loss.chunk_size, "programs": {}}
    compiled = (("train_step", programs.train_step), ("eval_step", programs.eval_step))
    for name, fn in compiled[:1 if patch != "none" else 2]:  # a companion needs the train step only
        stats = hlo.Program(fn.lower(programs.target, tok, tok).compile().as_text()).stats()
        result["programs"][name] = hlo.largest_collectives(stats, n=1000)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
