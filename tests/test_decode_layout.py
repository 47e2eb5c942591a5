"""The compiled decode loop re-lays no weight inside its loop: XLA does not hoist a weight's copy or transpose out of
a `while` body, so every one found there is paid every round (MLA's per-head up-projections, a tied output head).
Slow tier: each check compiles whole decode loops."""

import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from mtpjax.config import load_config
from mtpjax.decode import host, loop as decode_loop
from mtpjax.decode.cache import stacked, trunk_cache
from mtpjax.nn.layers import RMSNorm
from mtpjax.nn.model import MTPTransformer, build_model, for_decoding, unstack_layers

PROMPTS = [[1, 4, 13, 8, 25]]


def _cfg(**kw):
    return load_config(None, [f"model.{k}={v}" for k, v in kw.items()] + ["data.seq_len=32"]).model


def loop_body_moves(model, shape: str, draft: int = 0, ops=(" copy(", " transpose(")) -> int:
    """Copies and transposes (or `ops`) producing an array of `shape` (HLO's `f32[a,b,..]`) inside the compiled decode
    loop."""
    lp = host.make_loop(model, PROMPTS, max_new_tokens=4, draft=draft)
    (gt, pt), req = nnx.split(model), host.request(lp, PROMPTS)

    def fresh(loop, graphs, params, req):  # a new function each call: JAX reuses a function's trace
        return decode_loop.run_loop(loop, graphs, params, req)

    hlo = jax.jit(fresh, static_argnames=("loop", "graphs")).lower(lp, (gt, None), (pt, None), req).compile().as_text()
    return sum(1 for line in hlo.splitlines()
               if "while/body" in line and f"= {shape}" in line and any(op in line for op in ops))


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


def _bf16_model(**kw):
    """A bfloat16-compute model on float32 masters, its norm scales moved off 1 (not bfloat16 numbers)."""
    model = build_model(_cfg(dtype="bfloat16", param_dtype="float32", init_std=0.3, **kw), seed=0)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, RMSNorm):
            m.scale[...] = 1 + 0.01 * jax.random.normal(jax.random.key(1), m.scale.shape)
    return model


def _cast_everything(model):
    """for_decoding's cast, wrongly applied to every float parameter (norm scales too, which RMSNorm reads in f32)."""
    view = nnx.clone(model)
    for _, w in nnx.to_flat_state(nnx.state(view, nnx.Param)):
        w.set_value(w.get_value().astype(jnp.bfloat16))
    return view


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(attention_kind="mla", kv_lora_rank=16, mlp_kind="moe", moe_d_ff=16,
                                             n_routed_experts=4, scan_layers=True)])
def test_decoding_s_bfloat16_weights_give_the_same_numbers(kw):
    """for_decoding's copy (its matmul weights cast to bfloat16 once) computes the model's own hidden states and
    logits bit for bit; the companion, a cast of every parameter, does not; the model keeps its float32 masters."""
    model = _bf16_model(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mtp_depth=1, **kw)
    tok = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
    want = model(tok).hidden
    view = for_decoding(model)
    assert jnp.array_equal(view(tok).hidden, want)
    assert jnp.array_equal(view.logits(want[0]), model.logits(want[0]))
    assert view.embed[...].dtype == jnp.bfloat16 and model.embed[...].dtype == jnp.float32
    assert not jnp.array_equal(_cast_everything(model)(tok).hidden, want)


def loop_carried_f32_weights(model, num_draft: int) -> int:
    """Float32 arrays of a weight matrix's shape that the decode loop's `while` carries (in the lowered program,
    before XLA: XLA:CPU itself computes bfloat16 dots in float32), i.e. that every round reads."""
    lp = host.make_loop(model, PROMPTS, max_new_tokens=4, draft=num_draft)
    (gt, pt), req = nnx.split(model), host.request(lp, PROMPTS)

    def fresh(loop, graphs, params, req):
        return decode_loop.run_loop(loop, graphs, params, req)

    text = jax.jit(fresh, static_argnames=("loop", "graphs")).lower(lp, (gt, None), (pt, None), req).as_text()
    carried = [t for line in text.splitlines() if "stablehlo.while" in line for t in re.findall(r"tensor<[^>]*>", line)]
    weights = {"tensor<" + "x".join(map(str, w.shape)) + "xf32>"
               for _, w in nnx.to_flat_state(nnx.state(model, nnx.Param)) if w.ndim >= 2}
    return sum(t in weights for t in carried)


@pytest.mark.slow
def test_a_decode_round_reads_no_float32_weight():
    """A bfloat16 model's decode loop carries its matmul weights in bfloat16 (for_decoding cast them once, before
    it), plain or drafting; the companion, the loop on the float32 masters, carries them in float32 and casts them
    every round (4.5 GB of gpu_1b's 7.4 GB round on an H100, docs/accelerators.md)."""
    model = _bf16_model(vocab_size=96, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mtp_depth=1)
    assert loop_carried_f32_weights(model, 0) == loop_carried_f32_weights(model, 1) == 0
    with mock.patch.object(decode_loop, "for_decoding", lambda m: m):
        assert loop_carried_f32_weights(model, 0) > 0


@pytest.mark.slow
def test_a_decode_round_copies_no_layer_s_weights():
    """A scanned trunk's decode loop reads each layer's weights where they lie (unstack_layers sliced them once,
    before it), plain or drafting; the companion, the loop on the stacked blocks, slices every layer's MLP weight
    out of its [L, ...] stack every round (XLA's GPU compiler copies it: 2.4 GB of gpu_1b's 5.4 GB round)."""
    model = build_model(_cfg(vocab_size=64, d_model=32, d_ff=48, n_layers=2, n_heads=2, n_kv_heads=1, mtp_depth=1,
                             scan_layers=True), seed=0)
    sliced = (" dynamic-slice(", " fusion(", " copy(", " slice(")
    assert loop_body_moves(model, "f32[32,48]", ops=sliced) == loop_body_moves(model, "f32[32,48]", 1, sliced) == 0
    with mock.patch.object(decode_loop, "unstack_layers", lambda m: m):
        assert loop_body_moves(model, "f32[32,48]", ops=sliced) > 0


def _cached_trunk(model, tok_BT):
    """The trunk's hidden states and (stacked) cache, as the decode loop's prefill computes them."""
    h_BTD, cache = model.trunk(tok_BT, cache=trunk_cache(model.cfg, tok_BT.shape[0], 16))
    return h_BTD, stacked(cache)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(attention_kind="mla", kv_lora_rank=16, mlp_kind="moe", moe_d_ff=16,
                                             n_routed_experts=4)])
def test_unstacked_layers_compute_the_scan_s_numbers(kw):
    """unstack_layers' trunk, compiled (as the decode loop runs it), computes the scanned trunk's hidden states and
    cache bit for bit; the companion, its layers' outputs not stored between them (XLA then keeps some in float32,
    its excess precision, where the scan rounds them to bfloat16), does not."""
    model = for_decoding(_bf16_model(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, mtp_depth=1,
                                     scan_layers=True, **kw))
    tok = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
    want = nnx.jit(_cached_trunk)(model, tok)
    view = unstack_layers(nnx.clone(model))
    assert not view.cfg.scan_layers and len(view.blocks) == 3
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.jit(_cached_trunk)(view, tok)),
                                                   jax.tree.leaves(want)))
    view.unstacked = False
    assert not jnp.array_equal(nnx.jit(_cached_trunk)(view, tok)[0], want[0])
