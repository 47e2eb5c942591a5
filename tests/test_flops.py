"""FLOP accounting: a hand count, the real parameter tree, and the cost of each added depth."""

import pytest
from flax import nnx

from mtpjax.nn.flops import flops_per_token, train_flops_per_token
from mtpjax.nn.model import build_model


def test_hand_count(model_cfg):
    # vocab 32, d 32, 2 layers, 4 heads x 8, 2 kv heads, d_ff 64, depth 2, T 12
    f = flops_per_token(model_cfg(), 12)
    proj = 2 * 32 * 32 + 2 * 32 * 16 + 2 * 32 * 16 + 2 * 32 * 32  # 6144
    mlp = 3 * 2 * 32 * 64  # 12288
    attn = 2 * 12 * 8 * 4 * 2  # QK^T and PV over all 12 keys: 1536
    assert f["block"] == proj + mlp + attn == 19968
    assert f["trunk"] == 2 * 19968
    assert f["mtp_module"] == 2 * 64 * 32 + 19968 == 24064
    assert f["head"] == 2 * 32 * 32 and f["head_applications"] == 3
    assert f["forward"] == 39936 + 3 * 2048 + 2 * 24064 == 94208
    assert f["train"] == train_flops_per_token(model_cfg(), 12) == 3 * 94208
    assert flops_per_token(model_cfg(mtp_kind="parallel"), 12)["mtp_module"] == 19968  # no eh_proj


def kernels(node) -> int:
    """Weights used by matmuls: parameters with two logical axes (norm scales have one; 'layers' is unnamed)."""
    return sum(v.size for _, v in nnx.to_flat_state(nnx.state(node, nnx.Param))
               if len(v.get_metadata()["logical_axes"]) == 2)


@pytest.mark.parametrize("kw", [
    {}, {"mtp_kind": "parallel"}, {"tie_embeddings": False, "d_ff": 0, "head_dim": 16, "vocab_size": 100},
    {"scan_layers": True, "n_layers": 3, "mtp_depth": 1},
])
def test_matmul_flops_are_twice_the_real_weights(model_cfg, kw):
    cfg = model_cfg(**kw)
    T = 16
    model = nnx.eval_shape(lambda: build_model(cfg))
    f = flops_per_token(cfg, T)
    attn = 2 * 2 * T * cfg.resolved_head_dim * cfg.n_heads
    assert f["block_attention"] == attn
    assert f["trunk"] - cfg.n_layers * attn == 2 * kernels(model.blocks)
    for mod in model.mtp:
        assert f["mtp_module"] - attn == 2 * kernels(mod)
    head = model.embed if cfg.tie_embeddings else model.head
    assert f["head"] == 2 * head.size
    assert f["forward"] == f["trunk"] + sum(f["mtp"]) + (cfg.mtp_depth + 1) * f["head"]


def test_each_depth_adds_one_module_and_one_head(model_cfg):
    fs = [flops_per_token(model_cfg(mtp_depth=k), 64) for k in range(4)]
    for k in range(1, 4):
        assert fs[k]["forward"] - fs[k - 1]["forward"] == fs[k]["mtp_module"] + fs[k]["head"]
        assert fs[k]["train"] - fs[k - 1]["train"] == 3 * (fs[k]["mtp_module"] + fs[k]["head"])
    assert fs[3]["forward_by_depth"] == [f["forward"] for f in fs]


def test_attention_grows_with_seq_len(model_cfg):
    a, b = flops_per_token(model_cfg(), 10), flops_per_token(model_cfg(), 20)
    assert b["block"] - a["block"] == a["block_attention"]  # linear in T per token (full TxT counted)


def test_each_unrolled_application_costs_one_more_depth(model_cfg):
    for frozen in (False, True):
        base = [train_flops_per_token(model_cfg(mtp_depth=d), 16, frozen) for d in (1, 2, 3)]
        unrolled = [train_flops_per_token(model_cfg(mtp_depth=1), 16, frozen, unroll=u) for u in (0, 1, 2)]
        assert unrolled == base
    plain = model_cfg(mtp_depth=0)
    assert train_flops_per_token(plain, 16, unroll=2) == train_flops_per_token(plain, 16)  # nothing to unroll


def test_the_compile_plan_counts_every_mtp_application_in_the_eval_and_the_share():
    """compile's plan: loss.mtp_unroll's applications run in the eval step too, and are MTP work in the share."""
    from mtpjax.config import load_config
    from mtpjax.train.aot import analytic

    plain, unrolled = (load_config("configs/tiny.yaml", [f"loss.mtp_unroll={u}"]) for u in (0, 2))
    f, tokens = flops_per_token(plain.model, plain.data.seq_len), plain.train.batch_size * plain.data.seq_len
    a, b = analytic(plain, 1), analytic(unrolled, 1)
    assert b["eval_step"] - a["eval_step"] == pytest.approx(2 * (f["mtp_module"] + f["head"]) * tokens, rel=1e-12)
    apps = plain.model.mtp_depth + 2
    assert b["mtp_share"] == pytest.approx(3 * apps * f["mtp_module"] * tokens / b["train_step"], rel=1e-12)
    assert b["mtp_share"] > a["mtp_share"]  # three applications of the module weigh more than one
