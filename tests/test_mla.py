"""Multi-head latent attention: an independent float64 forward, the absorbed decode form, the latent cache in the
decoder (cached == full, speculative == plain, the cache after rejections == a fresh prefill), and its settings."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float64_reference import reference_mla

from mtpjax.config import ConfigError, load_config
from mtpjax.decode import generate, make_loop, run, summarize
from mtpjax.decode.cache import layer, module_caches, stacked, trunk_cache
from mtpjax.decode.sampling import make_sampler
from mtpjax.nn import mla
from mtpjax.nn.model import build_model
from mtpjax.nn.placement import host_placement

MLA = dict(attention_kind="mla", kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6,
           v_head_dim=12)
YARN = dict(rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_len=16, rope_beta_fast=32.0,
            rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=0.8)


def _cfg(**kw):
    over = dict(vocab_size=32, d_model=64, n_layers=2, n_heads=4, mtp_depth=2, **MLA)
    over.update(kw)
    return load_config(None, [f"model.{k}={v}" for k, v in over.items()] + ["data.seq_len=32"])


def _randomized(attn, seed):
    """Every parameter random (norm scales around 1), so no term of the forward can hide."""
    st = nnx.state(attn, nnx.Param)
    leaves, tree = jax.tree.flatten(st)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [(1.0 if x.ndim == 1 else 0.0) + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(attn, jax.tree.unflatten(tree, new))
    return attn


# ---------------------------------------------------------------------------------------------- float64 reference

def _layer_and_input(cfg, T=24, seed=0):
    attn = _randomized(mla.MLAttention(cfg.model, nnx.Rngs(params=seed), host_placement()), seed)
    x = np.random.default_rng(seed).normal(size=(2, T, cfg.model.d_model))
    return attn, x


@pytest.mark.parametrize("rope", [{}, YARN], ids=["rope", "yarn"])
def test_mla_layer_equals_an_independent_float64_forward(rope):
    cfg = _cfg(**rope)
    attn, x = _layer_and_input(cfg)
    ours, _ = attn(jnp.asarray(x, jnp.float32), jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(attn, nnx.Param)))
    for b in range(2):
        np.testing.assert_allclose(np.asarray(ours[b]), reference_mla(p, x[b], cfg.model), atol=1e-5, rtol=1e-5)
        # Companions: each break of the reference is visible at this tolerance.
        for broken in ({"no_norm": True}, {"rope_on_nope": True}, *([{"wrong_scale": True}] if rope else [])):
            assert not np.allclose(np.asarray(ours[b]), reference_mla(p, x[b], cfg.model, **broken), atol=1e-5), broken


def test_yarn_changes_the_softmax_scale_and_the_frequencies():
    """The YaRN case above can fail on the scale alone: DeepSeek-V3's mscale² is not 1 here."""
    cfg = _cfg(**YARN).model
    assert mla.softmax_scale(cfg) == pytest.approx((0.1 * 0.8 * math.log(40) + 1) ** 2 / math.sqrt(14))
    plain = mla.rope_frequencies(6, cfg.rope_theta)
    assert not np.allclose(mla.yarn_frequencies(6, cfg.rope_theta, mla.yarn_rope(cfg)), plain)


# ---------------------------------------------------------------------------------------------- absorbed decode

@nnx.jit(static_argnums=(1, 3))
def _absorbed_vs_expanded(attn, cfg, x, fold=None):
    """The layer's output over x in chunks through the latent cache, and in one expanded forward."""
    B, T, _ = x.shape
    xs = jnp.asarray(x, jnp.float32)
    full, _ = attn(xs, jnp.broadcast_to(jnp.arange(T), (B, T)))
    cache, parts = mla.mla_cache(cfg, B, T + 4), []
    for s, e in ((0, 9), (9, 10), (10, T)):
        pos = jnp.broadcast_to(jnp.arange(s, e), (B, e - s))
        qn, qr, c, kr = attn.project(xs[:, s:e], pos)
        wk, wv = attn.up_projections()
        o = mla.attend_absorbed(qn, qr, c, kr, cache, pos[:, 0], wk, fold(wk, wv) if fold else wv)
        cache = mla.write_after(cache, c, kr, pos[:, 0], o)
        parts.append(attn.wo(o.reshape(B, e - s, -1)))
    return full, jnp.concatenate(parts, 1)


def _key_fold(wk, wv):
    return jnp.swapaxes(wk, -1, -2)  # the key part's weights in the value part's layout


def test_absorbed_decode_equals_the_expanded_form():
    cfg = _cfg(v_head_dim=8)  # v as wide as the key part, so a wrong fold has the right shape
    attn, x = _layer_and_input(cfg)
    full, absorbed = _absorbed_vs_expanded(attn, cfg.model, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(absorbed, full, atol=2e-5, rtol=1e-5)
    # Companion: absorbing the key part but not the value part's own weights (the key's used for both) differs.
    _, wrong = _absorbed_vs_expanded(attn, cfg.model, jnp.asarray(x, jnp.float32), _key_fold)
    assert not np.allclose(wrong, full, atol=1e-3)


def test_the_cache_holds_the_latent_and_the_rope_key_only():
    cfg = _cfg().model
    c = trunk_cache(cfg, 3, 10)
    assert [type(x) for x in c] == [mla.MLACache] * cfg.n_layers
    assert sum(a.size for a in c[0]) == 3 * 10 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


# ---------------------------------------------------------------------------------------------- in the decoder

@pytest.fixture(scope="module")
def model():
    """A few steps' noise is enough: random MTP drafts are accepted sometimes and rejected often."""
    cfg = _cfg()
    m = build_model(cfg, seed=0)
    _randomized(m, 5)
    return m


@nnx.jit
def _cached_vs_full(model, toks):
    full = model.logits(model(toks).hidden)
    trunk, hs = trunk_cache(model.cfg, 2, 32), []
    for s, e in ((0, 7), (7, 8), (8, 12), (12, 20)):
        h, trunk = model.trunk(toks[:, s:e], jnp.broadcast_to(jnp.arange(s, e), (2, e - s)), cache=trunk)
        hs.append(h)
    h0 = jnp.concatenate(hs, axis=1)
    nxt = jnp.concatenate([toks[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)
    kv, parts = layer(module_caches(model.cfg, 2, 32), 0), []
    for s, e in ((0, 11), (11, 20)):
        h1, kv = model.mtp_forward(1, h0[:, s:e], nxt[:, s:e], jnp.broadcast_to(jnp.arange(s, e), (2, e - s)),
                                   cache=kv)
        parts.append(h1)
    h1 = jnp.concatenate(parts, axis=1)
    return full, model.logits(model.final_norm(h0)), model.logits(model.head_norm(1, h1))


def test_cached_decoding_equals_full_forward(model):
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 32, (2, 20)), jnp.int32)
    full, cached0, cached1 = _cached_vs_full(model, toks)
    np.testing.assert_allclose(cached0, full[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(cached1, full[1], atol=2e-5, rtol=1e-5)
    # Companion: a latent cache that misses one chunk's entries no longer matches.
    assert not np.allclose(_missing_chunk(model, toks), full[0][:, 8:12], atol=1e-3)


@nnx.jit
def _missing_chunk(model, toks):
    _, trunk = model.trunk(toks[:, :7], jnp.broadcast_to(jnp.arange(7), (2, 7)), cache=trunk_cache(model.cfg, 2, 32))
    h, _ = model.trunk(toks[:, 8:12], jnp.broadcast_to(jnp.arange(8, 12), (2, 4)), cache=trunk)
    return model.logits(model.final_norm(h))


PROMPTS = [[1, 4, 13, 8, 25], [7, 22, 3], [2, 7, 22, 3, 10, 31, 30, 27, 18, 23, 6], [5, 16]]


def _check_greedy_equal(model, proposer, drafts):
    base = generate(model, PROMPTS, max_new_tokens=16)
    for g in drafts:
        out = generate(model, PROMPTS, max_new_tokens=16, draft=g, proposer=proposer)
        assert out.tokens == base.tokens, (proposer, g)
        assert 0 < sum(out.stats["accepted"]) < sum(out.stats["reached"])  # both outcomes exercised


def test_greedy_speculative_equals_plain_with_an_mla_trunk(model):
    _check_greedy_equal(model, "ngram", (2,))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["mtp", "mtp1", "ngram"])
def test_greedy_speculative_equals_plain_with_an_mla_trunk_full_matrix(model, proposer):
    _check_greedy_equal(model, proposer, (1, 2, 3))


@pytest.mark.slow
def test_an_mla_draft_model_for_an_mla_target_keeps_greedy_output(model):
    """proposer="model": the draft model's own cache is an MLA latent cache too."""
    draft = _randomized(build_model(_cfg(n_layers=1, mtp_depth=0), seed=3), 7)
    base = generate(model, PROMPTS, max_new_tokens=16)
    out = generate(model, PROMPTS, max_new_tokens=16, draft=2, proposer="model", draft_model=draft)
    assert out.tokens == base.tokens and sum(out.stats["reached"]) > 0


@pytest.mark.slow
def test_scanned_mla_trunk_decodes_exactly():
    cfg = _cfg(scan_layers=True, **YARN)
    m = _randomized(build_model(cfg, seed=1), 6)
    base = generate(m, PROMPTS, max_new_tokens=12)
    assert generate(m, PROMPTS, max_new_tokens=12, draft=2, proposer="ngram").tokens == base.tokens


@nnx.jit(static_argnums=2)
def _fresh_trunk_cache(model, seq_1S, n):
    return model.trunk(seq_1S[:, :n], jnp.arange(n)[None], cache=trunk_cache(model.cfg, 1, n + 4))[1]


def test_latent_cache_after_rejections_equals_a_fresh_prefill(model):
    loop = make_loop(model, PROMPTS, max_new_tokens=20, draft=2, proposer="ngram", sampler=make_sampler())
    st = run(model, PROMPTS, loop)
    res = summarize(st, loop.tree)
    assert 0 < sum(res.stats["accepted"]) < sum(res.stats["reached"])
    seq, n_B = np.asarray(st.seq_BS), np.asarray(st.n_B)
    got = stacked(st.trunk)
    for b in range(len(PROMPTS)):
        n = int(n_B[b])
        want = stacked(_fresh_trunk_cache(model, jnp.asarray(seq[b:b + 1]), n))
        np.testing.assert_allclose(got.c_BSZ[:, b, :n - 1], want.c_BSZ[:, 0, :n - 1], atol=2e-5)
        np.testing.assert_allclose(got.kr_BSH[:, b, :n - 1], want.kr_BSH[:, 0, :n - 1], atol=2e-5)


# ---------------------------------------------------------------------------------------------- settings

@pytest.mark.parametrize("over,needle", [
    (["model.kv_lora_rank=65"], "model.kv_lora_rank"),
    (["model.q_lora_rank=100"], "model.q_lora_rank"),
    (["model.qk_rope_head_dim=5"], "model.qk_rope_head_dim"),
    (["model.attention_kind=gqa", "model.rope_scaling=yarn"], "model.rope_scaling"),
    (["model.rope_scaling=yarn", "model.rope_beta_fast=1", "model.rope_beta_slow=2"], "model.rope_beta_fast"),
    (["model.qkv_bias=true"], "model.qkv_bias"),  # MLA has no q/k/v projections: it was accepted, and ignored
])
def test_bad_mla_settings_are_refused_in_one_line(over, needle):
    base = ["model.d_model=64"] + [f"model.{k}={v}" for k, v in MLA.items()]
    with pytest.raises(ConfigError) as e:
        load_config(None, base + over)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_gqa_kv_head_rule_on_the_tensor_axis_does_not_apply_to_mla():
    base = ["model.d_model=64", "model.head_dim=8", "model.n_heads=6", "model.n_kv_heads=3", "mesh.tensor=2"]
    with pytest.raises(ConfigError, match="mesh.tensor"):
        load_config(None, base)  # GQA: 2 neither divides 3 KV heads nor is a multiple of them
    assert load_config(None, base + ["model.attention_kind=mla"]).mesh.tensor == 2


def test_a_bad_mla_setting_exits_2_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "mtpjax", "plan", "--config", "configs/tiny.yaml",
                        "model.attention_kind=mla", "model.kv_lora_rank=100000"], capture_output=True, text=True)
    assert r.returncode == 2 and "model.kv_lora_rank" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- accounting

@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_matmul_flops_are_twice_the_block_kernels(q_lora_rank):
    """flops.py's MLA projections count every kernel a token multiplies once (2 FLOPs a weight)."""
    from mtpjax.nn.flops import flops_per_token
    from mtpjax.nn.model import make_block

    cfg = _cfg(q_lora_rank=q_lora_rank).model
    st = nnx.state(make_block(cfg, nnx.Rngs(params=0), moe=False, placement=host_placement()), nnx.Param)
    kernels = sum(int(x.size) for path, x in jax.tree.leaves_with_path(st) if "kernel" in jax.tree_util.keystr(path))
    assert flops_per_token(cfg, 16)["block_matmul"] == 2 * kernels


def test_plan_reports_the_latent_cache_per_token():
    from mtpjax.eval.plan import build_plan, format_plan

    cfg = _cfg()
    plan = build_plan(cfg)
    m = cfg.model
    assert plan["cache_bytes_per_token"] == (m.kv_lora_rank + m.qk_rope_head_dim) * (m.n_layers + m.mtp_depth) * 4
    assert "decode cache per token (mla" in format_plan(plan, cfg)


# ---------------------------------------------------------------------------------------------- tensor parallel

SHARDED_WORKER = r'''
import jax
jax.config.update("jax_num_cpu_devices", 8)
import json, sys
import jax.numpy as jnp, numpy as np
from flax import nnx
from mtpjax.config import MeshConfig, load_config
from mtpjax.nn.loss import mtp_loss
from mtpjax.nn.model import build_model
from mtpjax.parallel.sharding import batch_sharding, make_mesh, state_shardings

over = json.loads(sys.argv[1])
cfg = load_config(None, [f"model.{k}={v}" for k, v in over.items()] + ["data.seq_len=16"])
gdef, params, rest = nnx.split(build_model(cfg, seed=0), nnx.Param, ...)
toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (8, 16)), jnp.int32)

def loss(params, toks):
    m = nnx.merge(gdef, params, rest)
    return mtp_loss(m, m(toks), toks, step=0, cfg=cfg.loss)[0]

vg = jax.jit(jax.value_and_grad(loss))
ref_l, ref_g = vg(params, toks)
out = {}
for shape in ((2, 1, 4), (1, 4, 2)):
    mesh = make_mesh(MeshConfig(*shape))
    p = jax.device_put(params, state_shardings(params, mesh))
    l, g = vg(p, jax.device_put(toks, batch_sharding(mesh)))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)))
    kv_b = p["blocks"][0]["attn"]["kv_b"]["kernel"]
    out[str(shape)] = {"loss": float(l), "ref": float(ref_l), "grad_diff": diff,
                       "kv_b_shard": list(kv_b.sharding.shard_shape(kv_b.shape))}
print(json.dumps(out))
'''


@pytest.mark.slow
def test_sharded_mla_equals_one_device():
    """Heads over `tensor`, latents replicated: loss and gradients on 8 emulated devices equal one device's."""
    import json

    over = dict(vocab_size=32, d_model=64, n_layers=2, n_heads=4, mtp_depth=1, **MLA)
    r = subprocess.run([sys.executable, "-c", SHARDED_WORKER, json.dumps(over)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for shape, o in out.items():
        np.testing.assert_allclose(o["loss"], o["ref"], rtol=2e-6, err_msg=shape)
        assert o["grad_diff"] < 1e-6, (shape, o["grad_diff"])
    # kv_b [16, 4 heads * 20] splits its heads over tensor (4, then 2); its latent rows stay whole.
    assert out["(2, 1, 4)"]["kv_b_shard"] == [16, 20] and out["(1, 4, 2)"]["kv_b_shard"] == [16, 40]


def test_export_refuses_an_mla_run_in_one_line():
    """No exported layout (Llama, Qwen2, MiMo) has latent attention: export says so instead of writing GQA tensors."""
    from types import SimpleNamespace

    from mtpjax.convert.errors import ConvertError
    from mtpjax.convert.export import _check

    with pytest.raises(ConvertError, match="attention_kind=mla") as e:
        _check(_cfg(), "qwen2", None, SimpleNamespace(kind="byte", vocab_size=32))
    assert "\n" not in str(e.value)
    assert _check(_cfg(attention_kind="gqa"), "qwen2", None, SimpleNamespace(kind="byte", vocab_size=32)) == 1

