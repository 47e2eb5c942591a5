"""The DeepSeek-V3 trunk whole (issue 25): an MLA + MoE block against an independent float64 forward, and
speculative decoding on an MLA + MoE model (greedy == plain for every proposer, the sampled distribution kept)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float64_reference import reference_block
from test_mla import MLA
from test_moe import MOE
from test_speculative import PROMPTS, _check_greedy_equal, _check_target_distribution, _sharpen, _train
from test_trees import _check_tree_equal

from mtpjax.config import load_config
from mtpjax.nn import mla
from mtpjax.nn.model import build_model, make_block, moe_layers
from mtpjax.nn.placement import host_placement


def _cfg(*extra, **kw):
    """Block 0 dense, block 1 and the MTP modules MoE (first_k_dense_replace=1), every attention latent."""
    over = dict(vocab_size=32, d_model=64, n_layers=2, n_heads=4, mtp_depth=2, **MLA)
    over.update(kw)
    return load_config(None, [f"model.{k}={v}" for k, v in over.items()] + MOE + ["data.seq_len=32", *extra])


def _with_biases(model, std, seed):
    """Every MoE layer's balance bias random: decoding chooses experts with the selection-only bias too."""
    rng = np.random.default_rng(seed)
    for layer in moe_layers(model).values():
        layer.bias[...] = jnp.asarray(rng.normal(0, std, layer.bias.shape), jnp.float32)
    return model


# ----------------------------------------------------------------------------- one block against float64 numpy

def _random_block(m, seed, std):
    """An MoE block, every parameter normal (norm scales around 1) from numpy: no random programs to compile."""
    blk = nnx.eval_shape(lambda: make_block(m, nnx.Rngs(params=0), moe=True, placement=host_placement()))
    leaves, tree = jax.tree.flatten(nnx.state(blk, nnx.Param))
    rng = np.random.default_rng(seed)
    nnx.update(blk, jax.tree.unflatten(tree, [jnp.asarray((x.ndim == 1) + std * rng.normal(size=x.shape), jnp.float32)
                                              for x in leaves]))
    blk.mlp.bias.set_value(jnp.asarray(rng.normal(0, std, m.n_routed_experts), jnp.float32))  # it changes choices
    return blk


@pytest.fixture(scope="module")
def block():
    """A random MLA + MoE block with a bias that changes choices: config, float64 parameters, input, output, loads."""
    m = _cfg("model.num_experts_per_tok=3").model  # 3 of 8 experts from the best 2 of 4 groups: the limit binds
    # std 0.1: at test_mla's 0.3 the outputs grow to ~16, whose float32 rounding alone reaches the 1e-5 tolerance
    blk = _random_block(m, 2, std=0.1)
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(nnx.state(blk)))
    x_BTD = np.random.default_rng(3).normal(size=(2, 24, m.d_model))
    y_BTD, _, aux = nnx.jit(lambda blk, x_BTD: blk(x_BTD, jnp.broadcast_to(jnp.arange(24), (2, 24))))(
        blk, jnp.asarray(x_BTD, jnp.float32))
    return m, p, x_BTD, np.asarray(y_BTD, np.float64), np.asarray(aux["load"])


def test_mla_moe_block_equals_an_independent_float64_forward(block):
    """Norms, residuals, MLA, routing (selection-only bias, groups, top-k normalized), shared expert: within 1e-5."""
    m, p, x_BTD, ours_BTD, load_E = block
    chosen = []
    for b in range(2):
        ref_TD, chosen_TX = reference_block(p, x_BTD[b], m)
        np.testing.assert_allclose(ours_BTD[b], ref_TD, atol=1e-5, rtol=1e-5)
        chosen.append(chosen_TX)
    np.testing.assert_array_equal(load_E, np.bincount(np.concatenate(chosen).ravel(), minlength=m.n_routed_experts))
    # The bias matters here: left out of the choice, a quarter of the tokens or more reach other experts.
    unbiased = [reference_block(p, x_BTD[b], m, bias_in_choice=False)[1] for b in range(2)]
    moved = sum(set(c) != set(u) for cs, us in zip(chosen, unbiased) for c, u in zip(cs, us))
    assert moved >= x_BTD.shape[0] * x_BTD.shape[1] // 4, moved


@pytest.mark.parametrize("broken", [dict(bias_in_choice=False), dict(normalize=False), dict(bias_in_weights=True),
                                    dict(group_limit=False)],
                         ids=["bias-left-out-of-the-choice", "no-top-k-normalization", "bias-in-the-weights",
                              "no-group-limit"])
def test_mla_moe_block_companions_fail(block, broken):
    """Each routing rule broken in the reference puts it far outside the tolerance the block meets."""
    m, p, x_BTD, ours_BTD, _ = block
    diff = max(np.abs(ours_BTD[b] - reference_block(p, x_BTD[b], m, **broken)[0]).max() for b in range(2))
    assert diff > 1e-2, diff  # 0.16 or more here: ten thousand times the tolerance


@nnx.jit(static_argnums=1)
def _cached_round(blk, m, x_BTD, sees_BTT):
    """One cached call of the block from position 0, with a tree mask in the segment slot and without one."""
    B, T, _ = x_BTD.shape
    pos_BT, cache = jnp.broadcast_to(jnp.arange(T), (B, T)), mla.mla_cache(m, B, T + 2)
    return blk(x_BTD, pos_BT, sees_BTT, cache), blk(x_BTD, pos_BT, None, cache)


def test_a_cached_moe_block_takes_a_draft_trees_mask():
    """A tree round passes its [B,T,T] mask where segment ids go; the MoE counts every token (it has no padding)."""
    m = _cfg().model
    blk = _random_block(m, 2, std=0.1)
    x_BTD = jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, m.d_model)), jnp.float32)
    sees_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5))
    (tree_BTD, _, aux), (causal_BTD, _, _) = _cached_round(blk, m, x_BTD, sees_BTT)
    np.testing.assert_allclose(tree_BTD, causal_BTD, atol=1e-6)  # the causal mask given is the default one
    assert int(aux["load"].sum()) == 2 * 5 * m.num_experts_per_tok


# ----------------------------------------------------------------------------- speculative decoding

@pytest.fixture(scope="module")
def trunk():
    """MLA + MoE a few steps in: drafts accepted sometimes and rejected often, at every position."""
    cfg = _cfg()
    model = build_model(cfg, seed=0)
    _train(model, cfg, steps=4)
    return _with_biases(model, 0.03, seed=4)


@pytest.fixture(scope="module")
def draft():
    """A smaller MLA + MoE model trained a little on the same task: its drafts are accepted sometimes."""
    cfg = _cfg(d_model=32, n_heads=2, mtp_depth=0)
    model = build_model(cfg, seed=5)
    _train(model, cfg, steps=10)
    return _with_biases(model, 0.03, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize("proposer, drafts", [("mtp", (1, 3)), ("mtp1", (2, 3)), ("ngram", (2,))])
def test_greedy_speculative_equals_plain_on_an_mla_moe_trunk(trunk, proposer, drafts):
    """Within and beyond the modules' depth; ragged prompts at batch 4."""
    _check_greedy_equal(trunk, proposer, drafts, (PROMPTS,))


@pytest.mark.slow
def test_an_mla_moe_draft_model_keeps_greedy_output(trunk, draft):
    _check_greedy_equal(trunk, "model", (2,), (PROMPTS,), draft_model=draft)


@pytest.mark.slow
def test_greedy_tree_equals_plain_on_an_mla_moe_trunk(trunk):
    _check_tree_equal(trunk, ["2x2"], [PROMPTS])


@pytest.mark.slow
def test_sampled_speculative_on_an_mla_moe_trunk_preserves_the_target_distribution():
    """Exact enumeration of 3-token continuations, plain and MTP drafting (the companions: plain vs wrong filters)."""
    model = build_model(_cfg(vocab_size=6), seed=2)
    _sharpen(model, 5.0)  # a random model: drafts disagree with the target often, so rejections are exercised
    _check_target_distribution(_with_biases(model, 0.1, seed=3), dict(temperature=1.0, top_k=2),
                               ((0, "mtp"), (2, "mtp")))
