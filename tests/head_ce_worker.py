"""Runs in a subprocess with 4 simulated CPU devices: the loss's metrics and gradients through the fused head
(interpret mode) on fsdp 2 x tensor 2 against one device's XLA head (tests/test_head_ce.py).

argv: <patch> <out.json>. patch: `none`, or `unscaled_merge` (`pmax` the identity: the shards' exp-sums are added
without rescaling them to the common maximum; each shard's logsumexp is right, their merge is not).
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtpjax.config import load_config  # noqa: E402
from mtpjax.nn import loss as L  # noqa: E402
from mtpjax.nn.model import build_model, placed  # noqa: E402
from mtpjax.parallel import sharding  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["loss.chunk_size=16", "model.vocab_size=300", "model.n_layers=1", "model.mtp_depth=2", "mesh.fsdp=2",
             "mesh.tensor=2"]


def metrics_and_grads(model, lc, tok):
    def f(model):
        return L.mtp_loss(model, L.forward(model, tok, None, lc), tok, None, step=0, cfg=lc)
    (_, metrics), grads = nnx.value_and_grad(f, has_aux=True)(model)
    return metrics, nnx.state(grads)


def main(patch: str, out: str) -> None:
    if patch == "unscaled_merge":  # the shards' maximum not shared: each exp-sum stays scaled to its own
        jax.lax.pmax = lambda x, axis_name: x
    cfg = load_config(ROOT / "configs" / "tiny.yaml", OVERRIDES)
    tok = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg.model.vocab_size)
    model = build_model(cfg.model, seed=0)
    m0, g0 = jax.jit(metrics_and_grads, static_argnums=1)(model, cfg.loss, tok)

    mesh = sharding.make_mesh(cfg.mesh)
    on_mesh = placed(model, sharding.placement(mesh))
    nnx.update(on_mesh, jax.device_put(nnx.state(on_mesh), NamedSharding(mesh, P())))
    os.environ[L.HEAD_INTERPRET_ENV] = "1"
    plan = L.head_plan(on_mesh, cfg.loss, tok.shape[0])
    tok_m = jax.device_put(tok, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
    m1, g1 = jax.jit(metrics_and_grads, static_argnums=1)(on_mesh, cfg.loss, tok_m)
    rel = lambda a, b: float(jnp.abs(a - b).max() / max(float(jnp.abs(b).max()), 1e-6))
    result = {
        "fused_ran": plan is not None,
        "sharded": [[a for a in plan.row_axes if mesh.shape[a] > 1], plan.vocab_axis] if plan else None,
        "metric_err": max(rel(m1[k], m0[k]) for k in m0),
        "grad_err": max(rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
