"""Mixed precision as accelerator users expect it: bf16 compute, float32 master weights, moments, logits and loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from train_helpers import TINY, synthetic_batches

from mtpjax.config import load_config
from mtpjax.nn.layers import attend
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.step import loss_and_grads, make_programs, split_trainable


def _setup(*overrides):
    cfg = load_config(None, TINY + ["data.paths=unused", "train.batch_size=2", *overrides])
    return cfg, make_programs(cfg, make_mesh(cfg.mesh))


def _float_dtypes(tree) -> set[str]:
    arrays = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return {jnp.dtype(x.dtype).name for x in arrays if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_compute_step_keeps_float32_params_moments_logits_and_loss():
    cfg, progs = _setup("model.dtype=bfloat16")
    tok, seg = (jnp.asarray(x) for x in synthetic_batches(1, 2, cfg.data.seq_len)[0])
    state = progs.init()
    before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    grads, _ = jax.eval_shape(functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss,
                                                micro_batches=1), *split_trainable(state.params), tok, seg, state.step)
    new, met = progs.train_step(state, tok, seg)
    params, opt = new.params, new.opt
    assert _float_dtypes(params) == {"float32"}  # master weights
    assert _float_dtypes(opt) == {"float32"}  # AdamW mu and nu
    assert _float_dtypes(grads) == {"float32"}
    assert met["loss/total"].dtype == jnp.float32 and np.isfinite(float(met["loss/total"]))
    # every parameter was updated: no update lost to rounding the weights to bf16
    assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(params)))
    model = nnx.merge(progs.graphdef, new.params)
    hidden = jax.eval_shape(lambda: model(tok, seg).hidden)
    assert hidden.dtype == jnp.bfloat16  # the computation runs in bf16
    assert jax.eval_shape(lambda: model.logits(model(tok, seg).hidden[0])).dtype == jnp.float32
    q, k, v = (jnp.ones(s, jnp.bfloat16) for s in ((1, 4, 1, 2, 8), (1, 4, 1, 8), (1, 4, 1, 8)))
    assert attend(q, k, v, jnp.zeros((1, 4, 4), jnp.float32)).dtype == jnp.float32  # softmax in float32


def test_companion_bf16_params_are_seen():
    """The dtype checks above can fail: with param_dtype=bfloat16 the master weights and moments are bf16."""
    abstract = _setup("model.dtype=bfloat16", "model.param_dtype=bfloat16")[1].target
    assert "bfloat16" in _float_dtypes(abstract.params) and "bfloat16" in _float_dtypes(abstract.opt)


def test_gpu_1b_is_one_accelerator_1b_bf16_seq_4096_mtp_1():
    from pathlib import Path

    from mtpjax.nn.model import build_model, param_counts

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu_1b.yaml")
    m = cfg.model
    assert (m.dtype, m.param_dtype, m.mtp_depth, cfg.data.seq_len) == ("bfloat16", "float32", 1, 4096)
    assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == 1
    total = param_counts(nnx.eval_shape(lambda: build_model(cfg)))["total"]
    assert 0.9e9 < total < 1.1e9
