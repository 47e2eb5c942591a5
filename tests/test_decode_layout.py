"""The compiled decode loop re-lays no weight inside its loop: XLA does not hoist a weight's copy or transpose out of
a `while` body, so every one found there is paid every round (MLA's per-head up-projections, a tied output head).
Slow tier: each check compiles whole decode loops."""

from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from mtpjax.config import load_config
from mtpjax.decode import host, loop as decode_loop
from mtpjax.nn.model import MTPTransformer, build_model

PROMPTS = [[1, 4, 13, 8, 25]]


def _cfg(**kw):
    return load_config(None, [f"model.{k}={v}" for k, v in kw.items()] + ["data.seq_len=32"]).model


def loop_body_moves(model, shape: str, num_draft: int = 0) -> int:
    """Copies and transposes producing an array of `shape` (HLO's `f32[a,b,..]`) inside the compiled decode loop."""
    lp = host.make_loop(model, PROMPTS, max_new_tokens=4, draft=num_draft)
    (gt, pt), req = nnx.split(model), host.request(lp, PROMPTS)

    def fresh(loop, graphs, params, req):  # a new function each call: JAX reuses a function's trace
        return decode_loop.run_loop(loop, graphs, params, req)

    hlo = jax.jit(fresh, static_argnames=("loop", "graphs")).lower(lp, (gt, None), (pt, None), req).compile().as_text()
    return sum(1 for line in hlo.splitlines()
               if "while/body" in line and f"= {shape}" in line and (" copy(" in line or " transpose(" in line))


@pytest.mark.slow
def test_mla_up_projections_are_laid_out_before_the_loop():
    """MLA's kv_b per head ([N, Z, nope]) is read as decode_view laid it out once; the companion, the loop
    on the model itself, re-lays it every round."""
    cfg = _cfg(vocab_size=32, d_model=64, n_layers=2, n_heads=4, mtp_depth=1, attention_kind="mla", kv_lora_rank=16,
               q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=12)
    model, shape = build_model(cfg, seed=0), "f32[4,16,8]"
    assert loop_body_moves(model, shape) == 0 and loop_body_moves(model, shape, draft=1) == 0
    with mock.patch.object(decode_loop, "decode_view", lambda m: m):
        assert loop_body_moves(model, shape) > 0


def _transposed_head_logits(self, h_ID):
    """The head as it was: the tied embedding transposed, then a plain dot (XLA copies it to [d, V] each call)."""
    h2 = h_ID.reshape(-1, h_ID.shape[-1])
    out = jnp.dot(h2, self.embed[...].T.astype(h2.dtype), preferred_element_type=jnp.float32)
    return out.reshape(*h_ID.shape[:-1], out.shape[-1])


@pytest.mark.slow
@pytest.mark.parametrize("num_draft", [0, 1])
def test_a_tied_head_is_read_in_the_embedding_s_own_layout(num_draft):
    """logits contracts the embedding's model axis: no [d, V] copy of it in the loop, plain or drafting; the
    companion, the transposed form, has one."""
    model = build_model(_cfg(vocab_size=96, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mtp_depth=1), seed=0)
    assert model.cfg.tie_embeddings
    assert loop_body_moves(model, "f32[32,96]", num_draft) == 0
    with mock.patch.object(MTPTransformer, "logits", _transposed_head_logits):
        assert loop_body_moves(model, "f32[32,96]", num_draft) > 0
