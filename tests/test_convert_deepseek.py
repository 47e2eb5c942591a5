"""The DeepSeek-V3 layout (MLA + MoE + MTP layers) out and in, checked against transformers' DeepseekV3ForCausalLM
and a torch re-implementation of the engines' DeepSeek MTP forward (tests/deepseek_reference.py).

Runs are model-only checkpoints of a perturbed random init with random routing biases (so the
e_score_correction_bias matters); every comparison is float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek_reference import DeepSeekReference
from flax import nnx
from test_convert import (
    TOL,
    _assert_same_params,
    _bad,
    _edit_config,
    _header,
    _redeclare,
    _module1_with_engine_inputs,
    _tokenizer_json,
    batch,
    cli,
    make_run,
    our_logits,
)
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from mtpjax.config import load_config
from mtpjax.convert import layout
from mtpjax.train.checkpoint import load_model

DS = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4",
      "model.d_ff=64", "model.init_std=0.2", "data.seq_len=32", "model.attention_kind=mla", "model.q_lora_rank=16",
      "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
      "model.mlp_kind=moe", "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_group=2",
      "model.topk_group=1", "model.moe_d_ff=16", "model.first_k_dense_replace=1", "model.routed_scaling_factor=1.5",
      "model.mtp_depth=1", "model.mtp_hidden=normed", "model.tie_embeddings=false"]


def state_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model))


def make_ds_run(tmp: Path, name: str, *overrides: str, seed: int = 0) -> Path:
    """A model-only run of a DeepSeek-shaped model: every leaf perturbed, the routing biases random."""
    return make_run(tmp, name, *DS, *overrides, seed=seed)


def export(run: Path, out: Path, *argv) -> Path:
    assert cli("export", "--run-dir", run, "--out", out, "--format", "deepseek_v3", *argv) == 0
    return out


def transformers_logits(directory: Path, tokens) -> tuple[np.ndarray, str]:
    hf = DeepseekV3ForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy(), type(hf).__name__


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(run, exported directory, model) of the MLA + MoE config with one MTP module."""
    tmp = tmp_path_factory.mktemp("ds")
    run = make_ds_run(tmp, "run")
    return run, export(run, tmp / "hf"), load_model(run)[1]


# ----------------------------------------------------------------------------- the RoPE rows (default tier)


def _rotate_halves(x, ang):  # mtpjax's convention: pairs (i, i + r/2)
    h = x.shape[-1] // 2
    return np.concatenate([x[:h] * np.cos(ang) - x[h:] * np.sin(ang), x[h:] * np.cos(ang) + x[:h] * np.sin(ang)])


def _rotate_pairs(x, ang):  # DeepSeek's and the engines': pairs (2i, 2i+1), written back interleaved
    out = np.empty_like(x)
    out[0::2] = x[0::2] * np.cos(ang) - x[1::2] * np.sin(ang)
    out[1::2] = x[1::2] * np.cos(ang) + x[0::2] * np.sin(ang)
    return out


@pytest.mark.parametrize("order, equal", [(None, True), (lambda rows, rope: np.arange(rows), False)])
def test_rope_rows_make_interleaved_rotation_ours(order, equal, monkeypatch):
    """Keys and queries exported through the permuted rows, rotated as the engines rotate, give our rotated
    dot products; the companion without the permutation does not. The import inverts it exactly."""
    if order is not None:
        monkeypatch.setattr(layout, "interleaved", order)
    rng = np.random.default_rng(0)
    nope, rope, d = 4, 8, 5
    t = layout.Tensor("q", (2 * (nope + rope), d), ("q",), None, "rope", rope=(nope + rope, rope))
    w_ours = rng.standard_normal((d, 2 * (nope + rope)))  # our kernel [in, out], two heads
    x, ang_q, ang_k = rng.standard_normal(d), rng.uniform(0, 3, rope // 2), rng.uniform(0, 3, rope // 2)
    ours, theirs = (x @ w_ours).reshape(2, -1), (layout.to_hf(t, w_ours) @ x).reshape(2, -1)
    for h in range(2):
        a = ours[h, nope:]
        b = theirs[h, nope:]
        assert np.allclose(ours[h, :nope], theirs[h, :nope])
        same = np.isclose(_rotate_halves(a, ang_q) @ _rotate_halves(a, ang_k),
                          _rotate_pairs(b, ang_q) @ _rotate_pairs(b, ang_k))
        assert same == equal
    assert np.array_equal(layout.from_hf(t, layout.to_hf(t, w_ours)), w_ours)


@pytest.mark.parametrize("fmt", ["qwen2", "deepseek_v3"])
def test_a_gqa_moe_run_is_told_it_has_no_export_layout(fmt):
    """GQA with a mixture of experts fits no layout: one line that says so, whatever --format (the messages did send
    each format to the other)."""
    from types import SimpleNamespace

    from mtpjax.convert.errors import ConvertError
    from mtpjax.convert.export import _check

    gqa_moe = load_config("configs/moe_tiny.yaml")
    assert (gqa_moe.model.attention_kind, gqa_moe.model.mlp_kind) == ("gqa", "moe")
    with pytest.raises(ConvertError, match="^no export layout holds grouped-query attention with a mixture of "
                                           "experts .*; train with model.attention_kind=mla to export an MoE run$"):
        _check(gqa_moe, fmt, None, SimpleNamespace(kind="byte", vocab_size=256))


def test_export_refuses_raw_module_input_for_deepseek_engines():
    """DeepSeek's engines feed the normed trunk state: a raw-trained module is refused (and a normed one for MiMo)."""
    from types import SimpleNamespace

    from mtpjax.convert.errors import ConvertError
    from mtpjax.convert.export import _check

    tok = SimpleNamespace(kind="byte", vocab_size=256)
    with pytest.raises(ConvertError, match="model.mtp_hidden=normed") as e:
        _check(load_config(None, [*DS, "model.mtp_hidden=raw"]), "deepseek_v3", None, tok)
    assert "\n" not in str(e.value)
    assert _check(load_config(None, [*DS, "model.mtp_hidden=raw"]), "deepseek_v3", 0, tok) == 0
    assert _check(load_config(None, DS), "deepseek_v3", None, tok) == 1
    gqa = [*DS, "model.attention_kind=gqa", "model.mlp_kind=dense", "model.n_kv_heads=2"]
    with pytest.raises(ConvertError, match="MiMo's engines feed"):
        _check(load_config(None, gqa), "qwen2", None, tok)


# ----------------------------------------------------------------------------- export -> transformers, engines


@pytest.mark.slow
def test_export_config_and_names(exported):
    _, out, model = exported
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["model_type"] == "deepseek_v3"
    assert (c["num_nextn_predict_layers"], c["topk_method"], c["scoring_func"], c["norm_topk_prob"]) == (
        1, "noaux_tc", "sigmoid", True)
    assert (c["first_k_dense_replace"], c["moe_layer_freq"], c["n_group"], c["rope_interleave"]) == (1, 1, 2, True)
    names = set(_header(out / "model.safetensors"))
    for n in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
              "model.layers.1.self_attn.q_a_layernorm.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
              "model.layers.2.eh_proj.weight", "model.layers.2.embed_tokens.weight",
              "model.layers.2.shared_head.head.weight", "model.layers.2.mlp.experts.0.gate_proj.weight"):
        assert n in names, n
    assert not any(n.startswith("model.layers.3.") for n in names)


@pytest.mark.slow
def test_export_logits_equal_transformers(exported):
    """transformers' DeepseekV3ForCausalLM (rope_interleave, its own router) computes our trunk from the files."""
    _, out, model = exported
    toks = batch()
    theirs, name = transformers_logits(out, toks)
    assert name == "DeepseekV3ForCausalLM"
    assert np.abs(our_logits(model, toks)[0] - theirs).max() <= TOL


@pytest.mark.slow
def test_yarn_export_equals_transformers_and_imports_back(tmp_path):
    """YaRN's keys (factor, original context, betas, both mscales) reach transformers' DeepSeek-V3 and come back."""
    run = make_ds_run(tmp_path, "run", "model.rope_scaling=yarn", "model.rope_scaling_factor=4.0",
                      "model.rope_original_max_len=8", "model.rope_mscale=0.707", "model.rope_mscale_all_dim=0.707",
                      "model.rope_beta_fast=8")
    out = export(run, tmp_path / "hf")
    _, model, _ = load_model(run)
    toks = batch()  # 24 positions, past the original 8
    assert np.abs(our_logits(model, toks)[0] - transformers_logits(out, toks)[0]).max() <= TOL
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    assert load_model(tmp_path / "back")[0].model == model.cfg


@pytest.mark.slow
def test_engine_deepseek_mtp_forward_equals_module_1(exported):
    """The engines' DeepSeek MTP layer (interleaved RoPE, normed trunk state), loaded from the exported files only,
    computes our module 1; against our own convention only the engines' position-0 mask differs."""
    _, out, model = exported
    ref, toks = DeepSeekReference(out), batch()
    engine = ref.depth1_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    assert np.abs(engine - _module1_with_engine_inputs(model, toks, True)).max() <= TOL
    ours = our_logits(model, toks)
    assert np.abs(ours[1][:, :-1] - _module1_with_engine_inputs(model, toks, False)).max() <= TOL
    assert np.abs(ref.main_logits(torch.tensor(toks, dtype=torch.long)).numpy() - ours[0]).max() <= TOL


@pytest.mark.slow
def test_companion_rope_not_interleaved_breaks_engines_and_transformers(tmp_path, exported, monkeypatch):
    """Written without the RoPE row permutation (our halves as they are), both the engines' forward and
    transformers compute something else."""
    run, _, model = exported
    monkeypatch.setattr(layout, "interleaved", lambda rows, rope: np.arange(rows))
    out = export(run, tmp_path / "plain")
    toks = batch()
    engine = DeepSeekReference(out).depth1_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    assert np.abs(engine - _module1_with_engine_inputs(model, toks, True)).max() > 1e-2
    assert np.abs(our_logits(model, toks)[0] - transformers_logits(out, toks)[0]).max() > 1e-2


@pytest.mark.slow
def test_export_streams_each_leaf_once(tmp_path, exported, monkeypatch):
    """A leaf is read once, whatever it holds (all of a layer's experts): memory holds one leaf, not the model."""
    from mtpjax.train.checkpoint import SavedRun

    run, _, _ = exported
    reads, real = [], SavedRun.leaf
    monkeypatch.setattr(SavedRun, "leaf", lambda self, step, path: reads.append(path) or real(self, step, path))
    export(run, tmp_path / "again")
    twice = sorted({p for p in reads if reads.count(p) > 1})
    assert twice == [("embed",), ("head",)]  # read again only for the MTP layer's own copies
    assert reads.count(("blocks", 1, "mlp", "w_down")) == 1


# ----------------------------------------------------------------------------- round trip, import from transformers


@pytest.mark.slow
def test_export_import_roundtrip_is_bitwise_scanned_bf16_two_modules(tmp_path):
    """A scanned trunk (stacked layers and experts), bfloat16, no query compression, two MTP modules."""
    run = make_ds_run(tmp_path, "run", "model.scan_layers=true", "model.first_k_dense_replace=0",
                      "model.param_dtype=bfloat16", "model.q_lora_rank=0", "model.mtp_depth=2")
    depth = load_model(run)[0].model.mtp_depth
    export(run, tmp_path / "hf", "--mtp-modules", str(depth))
    assert cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back", "model.scan_layers=true") == 0
    cfg_a, a, _ = load_model(run)
    cfg_b, b, _ = load_model(tmp_path / "back")
    assert cfg_b.model == cfg_a.model
    _assert_same_params(state_of(a), state_of(b))  # the routing biases included


@pytest.mark.slow
def test_export_import_roundtrip_default(tmp_path, exported):
    run, out, a = exported
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    cfg_b, b, _ = load_model(tmp_path / "back")
    assert cfg_b.model == a.cfg
    _assert_same_params(state_of(a), state_of(b))  # the routing biases included


def _hf_deepseek(tmp: Path, seed=0, **kw) -> tuple[Path, DeepseekV3ForCausalLM]:
    """A transformers-written random DeepSeek-V3 directory (norms, routing biases perturbed) with a tokenizer."""
    torch.manual_seed(seed)
    c = dict(vocab_size=320, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
             qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
             num_nextn_predict_layers=1, initializer_range=0.1, max_position_embeddings=256)
    c.update(kw)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**c))
    with torch.no_grad():
        for name, b in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                b.add_(0.1 * torch.randn_like(b))
    d = tmp / "hf_ds"
    model.eval().save_pretrained(str(d))
    _tokenizer_json(d)
    return d, model


@pytest.mark.slow
def test_import_transformers_deepseek(tmp_path, capsys):
    """A DeepSeek-V3 directory written by transformers imports (MoE + MLA; its declared MTP layer has no tensors,
    so the module starts fresh, said in one line) and gives transformers' logits."""
    d, hf = _hf_deepseek(tmp_path)
    capsys.readouterr()
    assert cli("import", "--hf", d, "--out", tmp_path / "run") == 0
    err = capsys.readouterr().err
    assert "declares 1 MTP layers but the checkpoint holds 0" in err and "model.mtp_init=random" in err
    cfg, model, _ = load_model(tmp_path / "run")
    m = cfg.model
    assert (m.attention_kind, m.mlp_kind, m.mtp_depth, m.mtp_hidden, m.first_k_dense_replace) == (
        "mla", "moe", 1, "normed", 1)
    toks = batch(vocab=320, T=20)
    with torch.no_grad():
        theirs = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    assert np.abs(our_logits(model, toks)[0] - theirs).max() <= TOL


# ----------------------------------------------------------------------------- bad input


def _fp8(d: Path) -> None:
    """One tensor re-declared as float8_e4m3 (same bytes), as DeepSeek's FP8 releases store weights."""
    name = "model.layers.0.self_attn.o_proj.weight"
    begin, end = _header(d / "model.safetensors")[name]["data_offsets"]
    _redeclare(d, name, dtype="F8_E4M3", shape=[end - begin])


@pytest.mark.parametrize("edit, needle", [
    (lambda d: _edit_config(d, scoring_func="softmax"), "scoring_func='softmax'"),
    (lambda d: _edit_config(d, topk_method="greedy"), "topk_method='greedy'"),
    (lambda d: _edit_config(d, norm_topk_prob=False), "norm_topk_prob=False"),
    (lambda d: _edit_config(d, moe_layer_freq=2), "moe_layer_freq=2"),
    (lambda d: _edit_config(d, moe_intermediate_size=8), "does not match its config.json"),
    (lambda d: _edit_config(d, kv_lora_rank=8), "does not match its config.json"),
    (lambda d: _edit_config(d, first_k_dense_replace=2),
     "MTP layers are MoE (first_k_dense_replace=2) but its trunk is"),
    # keys whose default differs between readers (transformers: 8 groups, 2.5, 3 dense blocks) are required
    (lambda d: _edit_config(d, n_group=None), "config.json lacks or mistypes a required field (KeyError: 'n_group')"),
    (lambda d: _edit_config(d, routed_scaling_factor=None), "(KeyError: 'routed_scaling_factor')"),
    (lambda d: _edit_config(d, first_k_dense_replace=None), "(KeyError: 'first_k_dense_replace')"),
    # issue 50: DeepSeek-V3's fp8 block-scaled checkpoints import now (tests/test_convert_fp8.py), so an fp8
    # quantization_config is accepted; other quantizations, and float8 tensors without block scales, are refused
    (lambda d: _edit_config(d, quantization_config={"quant_method": "gptq", "bits": 4}), "dequantize it to bfloat16"),
    (_fp8, "float8 but config.json has no quantization_config"),
])
def test_import_bad_deepseek_input(tmp_path, capsys, edit, needle):
    d, _ = _hf_deepseek(tmp_path)
    edit(d)
    assert needle in _bad(capsys, tmp_path / "run", "import", "--hf", d, "--out", tmp_path / "run")


def test_export_failing_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A leaf that cannot be read after some tensors were written: one line, exit 2, no output, no temporary."""
    from mtpjax.train.checkpoint import CheckpointError, SavedRun

    run, out, real, seen = make_ds_run(tmp_path, "run"), tmp_path / "hf", SavedRun.leaf, []

    def leaf(self, step, path):
        seen.append(sorted(q.name for q in tmp_path.glob(".hf.tmp-*/*")))
        if len(seen) == 12:
            raise CheckpointError(f"parameter {'.'.join(map(str, path))} of checkpoint {step} is unreadable (injected)")
        return real(self, step, path)

    monkeypatch.setattr(SavedRun, "leaf", leaf)
    assert "unreadable (injected)" in _bad(capsys, out, "export", "--run-dir", run, "--out", out, "--format",
                                           "deepseek_v3")
    assert seen[-1], seen  # the failure came while the export was writing its files


@pytest.mark.slow
def test_export_bad_deepseek_input(tmp_path, capsys):
    raw = make_ds_run(tmp_path, "raw", "model.mtp_hidden=raw")
    normed_gqa = make_ds_run(tmp_path, "gqa", "model.attention_kind=gqa", "model.n_kv_heads=2", "model.mlp_kind=dense")
    mla = make_ds_run(tmp_path, "mla", "model.mlp_kind=dense")
    out = tmp_path / "hf"
    for args, needle in [((raw, "--format", "deepseek_v3"), "model.mtp_hidden=normed"),
                         ((normed_gqa, "--format", "deepseek_v3"), "needs model.attention_kind=mla"),
                         ((mla, "--format", "qwen2", "--mtp-modules", "0"), "use --format deepseek_v3"),
                         ((normed_gqa, "--format", "qwen2"), "MiMo's engines feed")]:
        assert needle in _bad(capsys, out, "export", "--run-dir", *args, "--out", out)
    export(raw, tmp_path / "trunk", "--mtp-modules", "0")  # the trunk alone is what the engines compute
    export(mla, tmp_path / "dense")  # a dense MLA model: every layer (the MTP one too) before the first MoE one
    assert json.loads((tmp_path / "dense" / "config.json").read_text())["first_k_dense_replace"] == 3
    assert cli("import", "--hf", tmp_path / "dense", "--out", tmp_path / "back") == 0  # and reads back dense
    cfg, back, _ = load_model(tmp_path / "back")
    assert (cfg.model.mlp_kind, cfg.model.attention_kind) == ("dense", "mla")
    _assert_same_params(state_of(load_model(mla)[1]), state_of(back))
