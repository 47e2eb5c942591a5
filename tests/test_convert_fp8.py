"""DeepSeek-V3's FP8 checkpoints (float8 e4m3 weights, 128x128 block scales) in and out.

The fp8 checkpoints here are written the way DeepSeek's release is, independently of mtpjax's code: torch
quantizes a bf16 DeepSeek-V3 export block by block and safetensors.torch writes `torch.float8_e4m3fn` weights
with their `weight_scale_inv`; the "bf16 dequantization" is what DeepSeek's fp8_cast_bf16.py writes (each block
float32(w) * scale, rounded to bfloat16). Widths are not multiples of 128, so the edge blocks are partial.
"""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert import _assert_same_params, _bad, _edit_config, _header, _redeclare, cli
from test_convert_deepseek import _hf_deepseek, export, make_ds_run, state_of

from mtpjax.convert import fp8, importer
from mtpjax.train.checkpoint import load_model

# d_model 160, d_ff 200, q_lora 136: weights of 1x2 and 2x2 blocks of 128, the edge ones partial
WIDE = ["model.d_model=160", "model.d_ff=200", "model.q_lora_rank=136", "model.param_dtype=float32"]
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
LINEAR = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
          "down_proj")  # DeepSeek's fp8 linears; not the router (mlp.gate), eh_proj, embeddings, heads or norms


def _blocks(rows: int, cols: int):
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            yield i // 128, j // 128, slice(i, i + 128), slice(j, j + 128)


def _torch_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization, one 128x128 block at a time (amax / 448 per block)."""
    w = w.float()
    s = torch.ones((-(-w.shape[0] // 128), -(-w.shape[1] // 128)))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for bi, bj, r, c in _blocks(*w.shape):
        amax = w[r, c].abs().max()
        s[bi, bj] = amax / 448.0 if amax > 0 else 1.0
        q[r, c] = (w[r, c] / s[bi, bj]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _torch_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant (float32 product, edge blocks partial) as fp8_cast_bf16.py stores it."""
    y = torch.empty(q.shape, dtype=torch.float32)
    for bi, bj, r, c in _blocks(*q.shape):
        y[r, c] = q[r, c].float() * s[bi, bj]
    return y.to(torch.bfloat16)


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR


def _rewrite(src: Path, dst: Path, tensors: dict, **config) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((src / "config.json").read_text()) | {"torch_dtype": "bfloat16", "dtype": "bfloat16"} | config
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def deepseek_fp8(bf16: Path, out: Path) -> tuple[Path, Path]:
    """(fp8 directory in DeepSeek-V3's layout, its dequantization as fp8_cast_bf16.py writes it) of an export."""
    quant, deq = {}, {}
    for name, w in load_file(str(bf16 / "model.safetensors")).items():
        if _is_linear(name):
            q, s = _torch_quantize(w)
            quant[name], quant[name + "_scale_inv"], deq[name] = q, s, _torch_dequantize(q, s)
        else:
            quant[name] = deq[name] = w
    return (_rewrite(bf16, out / "fp8", quant, quantization_config=QUANT), _rewrite(bf16, out / "bf16", deq))


@pytest.fixture(scope="module")
def small_fp8(tmp_path_factory):
    """A transformers-written DeepSeek-V3 (no jax: cheap) quantized as DeepSeek ships it: for bad input."""
    tmp = tmp_path_factory.mktemp("small")
    return deepseek_fp8(_hf_deepseek(tmp)[0], tmp)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 directory, its bf16 dequantization, the float32 run they came from) with one MTP layer."""
    tmp = tmp_path_factory.mktemp("fp8")
    run = make_ds_run(tmp, "run", *WIDE)
    return *deepseek_fp8(export(run, tmp / "hf"), tmp), run


@pytest.mark.slow
def test_fp8_checkpoint_is_deepseek_layout(checkpoints):
    """The fixture is what DeepSeek ships: F8_E4M3 linears (MTP layer too), F32 scales of ceil(out/128) x
    ceil(in/128), the router, eh_proj, heads and norms unquantized."""
    from mtpjax.convert.safetensors_io import Reader

    entries = Reader(checkpoints[0]).entries
    kinds = {n: str(e.dtype) for n, e in entries.items()}
    assert kinds["model.layers.1.mlp.experts.3.down_proj.weight"] == "float8_e4m3fn"
    assert kinds["model.layers.2.self_attn.q_b_proj.weight"] == "float8_e4m3fn"  # the MTP layer's block
    for n in ("model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight", "lm_head.weight",
              "model.layers.2.shared_head.head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert kinds[n] == "float32", n
    assert entries["model.layers.0.mlp.gate_proj.weight"].shape == (200, 160)
    assert entries["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 2)
    assert entries["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (2, 2)  # 136 x 160


@pytest.mark.slow
def test_fp8_import_equals_its_bf16_dequantization(tmp_path, checkpoints):
    """The fp8 directory imports (MTP layer included) to exactly the run DeepSeek's fp8_cast_bf16 output imports
    to: the dequantization rounded to bfloat16, the run's dtype."""
    q, deq, _ = checkpoints
    assert cli("import", "--hf", q, "--out", tmp_path / "a") == 0
    assert cli("import", "--hf", deq, "--out", tmp_path / "b") == 0
    cfg, a, _ = load_model(tmp_path / "a")
    _, b, _ = load_model(tmp_path / "b")
    assert (cfg.model.param_dtype, cfg.model.mtp_depth) == ("bfloat16", 1)
    _assert_same_params(state_of(a), state_of(b))


@pytest.mark.slow
def test_companion_scales_broadcast_as_if_blocks_divided_evenly(tmp_path, checkpoints, monkeypatch):
    """Dequantized with the block size inferred from the grid (out / rows of scales, as transformers' CPU fallback
    does), the partial edge blocks take the wrong scales and the import no longer equals the bf16 one."""
    def even(w, s, block):
        rows, cols = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
        return np.asarray(w, np.float32) * np.repeat(np.repeat(s, rows, 0), cols, 1)[:w.shape[0], :w.shape[1]]

    monkeypatch.setattr(fp8, "dequantize", even)
    q, deq, _ = checkpoints
    assert cli("import", "--hf", q, "--out", tmp_path / "a") == 0
    assert cli("import", "--hf", deq, "--out", tmp_path / "b") == 0
    with pytest.raises(AssertionError):
        _assert_same_params(state_of(load_model(tmp_path / "a")[1]), state_of(load_model(tmp_path / "b")[1]))


def _drop(name: str):
    def edit(d: Path):
        t = load_file(str(d / "model.safetensors"))
        del t[name]
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _flattened(name: str):
    """The float8 weight `name` declared 1-D (the same bytes)."""
    def edit(d: Path):
        rows, cols = _header(d / "model.safetensors")[name]["shape"]
        _redeclare(d, name, shape=[rows * cols])
    return edit


def _config(**changes):
    return lambda d: _edit_config(d, **changes)


@pytest.mark.parametrize("edit, needle", [
    (_drop("model.layers.1.self_attn.o_proj.weight_scale_inv"), "lacks its block scales "
     "model.layers.1.self_attn.o_proj.weight_scale_inv"),
    (_config(quantization_config=QUANT | {"weight_block_size": [16, 16]}), "weight_block_size [16, 16] over"),
    (_config(quantization_config=QUANT | {"weight_block_size": [128]}), "must be two positive integers"),
    (_config(quantization_config=None), "float8 but config.json has no quantization_config"),
    (_config(quantization_config={"quant_method": "awq", "bits": 4}), "quantized as awq"),
    (_drop("model.layers.1.self_attn.o_proj.weight"), "not float8"),
    (_flattened("model.layers.1.self_attn.o_proj.weight"), "is float8 of shape [1024]; only 2-D block-scaled weights"),
])
def test_import_bad_fp8_input(tmp_path, capsys, small_fp8, edit, needle):
    d = tmp_path / "in"
    shutil.copytree(small_fp8, d)
    edit(d)
    assert needle in _bad(capsys, tmp_path / "run", "import", "--hf", d, "--out", tmp_path / "run")


def _count_live(monkeypatch) -> dict:
    """Wraps fp8.dequantize: how many dequantized tensors are alive at most, and how many were made."""
    seen, real = {"peak": 0, "made": 0, "live": []}, fp8.dequantize

    def dequantize(*args):
        out = real(*args)
        owner = out if out.base is None else out.base  # what holds the memory (a view of it may outlive `out`)
        seen["live"] = [r for r in seen["live"] if r() is not None] + [weakref.ref(owner)]
        seen["made"] += 1
        seen["peak"] = max(seen["peak"], len(seen["live"]))
        return out

    monkeypatch.setattr(fp8, "dequantize", dequantize)
    return seen


@pytest.mark.slow
def test_fp8_import_streams(tmp_path, checkpoints, monkeypatch):
    """At most one layer's experts (4) of dequantized weights are alive at once, out of the 48 quantized ones."""
    seen = _count_live(monkeypatch)
    assert cli("import", "--hf", checkpoints[0], "--out", tmp_path / "a") == 0
    assert seen["made"] == 48 and seen["peak"] <= 4, seen


@pytest.mark.slow
def test_companion_an_eager_import_holds_every_tensor(tmp_path, checkpoints, monkeypatch):
    """Leaves produced when the tree is built (all of the model before the first write) make the count see the
    dequantized tensors alive at once: all but the 6 RoPE-permuted ones (q_b_proj, kv_a_proj_with_mqa of 3 layers),
    which are held as their permuted copies."""
    seen, real = _count_live(monkeypatch), importer.Lazy.__init__

    def eager(self, shape, dtype, produce, parts=None):
        held = produce()
        real(self, shape, dtype, lambda: held, parts)

    monkeypatch.setattr(importer.Lazy, "__init__", eager)
    assert cli("import", "--hf", checkpoints[0], "--out", tmp_path / "a") == 0
    assert seen["peak"] == seen["made"] - 6 == 42


# ----------------------------------------------------------------------------- export --quantize fp8


@pytest.fixture(scope="module")
def exported_fp8(tmp_path_factory, checkpoints):
    """The run exported with --quantize fp8 (its MTP layer included)."""
    return export(checkpoints[2], tmp_path_factory.mktemp("out") / "hf", "--quantize", "fp8")


@pytest.mark.slow
def test_fp8_export_is_deepseeks_quantization(tmp_path, checkpoints, exported_fp8):
    """--quantize fp8 writes what DeepSeek's block quantization makes of the bf16 export, tensor for tensor (names,
    dtypes, bytes: the linears float8 with their scales, the rest as they were) and its quantization_config."""
    run = checkpoints[2]
    ours = load_file(str(exported_fp8 / "model.safetensors"))
    (tmp_path / "ds").mkdir()
    theirs = load_file(str(deepseek_fp8(export(run, tmp_path / "hf"), tmp_path / "ds")[0] / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name].view(torch.uint8), t.view(torch.uint8)), name
    assert json.loads((exported_fp8 / "config.json").read_text())["quantization_config"] == QUANT


@pytest.mark.slow
def test_fp8_export_import_roundtrip(tmp_path, checkpoints, exported_fp8):
    """Imported back (MTP module included): the unquantized leaves bitwise, the linears within float8's rounding
    (3 mantissa bits: 1/16 of the block's largest magnitude) and no longer equal."""
    run = checkpoints[2]
    assert cli("import", "--hf", exported_fp8, "--out", tmp_path / "back") == 0
    cfg, back, _ = load_model(tmp_path / "back")
    assert cfg.model.mtp_depth == 1
    a, b = state_of(load_model(run)[1]), state_of(back)
    quantized = {"q_a", "q_b", "kv_a", "kv_b", "wo", "gate", "up", "down", "w_gate", "w_up", "w_down"}
    seen = set()
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        x, y = np.asarray(x), np.asarray(y)
        if quantized & set(map(str, keys)) and "router" not in keys:
            seen.add(keys[0])
            assert np.abs(x - y).max() <= np.abs(x).max() / 16 and not np.array_equal(x, y), keys
        else:
            assert x.tobytes() == y.tobytes(), keys
    assert seen == {"blocks", "mtp"}


@pytest.mark.slow
def test_transformers_loads_the_fp8_export_on_cpu(tmp_path, exported_fp8):
    """transformers' fine-grained fp8 integration (on CPU: its dequantizing fallback) computes the logits of the
    fp8 export imported back at toy widths under 128 (every weight one block). Its fallback infers the block from
    the scale grid, which partial edge blocks get wrong: the wide export's logits differ (docs/export-import.md)."""
    from test_convert import TOL, batch, our_logits
    from test_convert_deepseek import transformers_logits

    out = export(make_ds_run(tmp_path, "run"), tmp_path / "hf", "--quantize", "fp8")
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    toks = batch()
    theirs, name = transformers_logits(out, toks)
    assert name == "DeepseekV3ForCausalLM"
    assert np.abs(our_logits(load_model(tmp_path / "back")[1], toks)[0] - theirs).max() <= TOL
    assert cli("import", "--hf", exported_fp8, "--out", tmp_path / "wide") == 0
    gap = np.abs(our_logits(load_model(tmp_path / "wide")[1], toks)[0] - transformers_logits(exported_fp8, toks)[0])
    print(f"widths 160 / 200: transformers' CPU fallback differs by {gap.max():.4g}")
    assert gap.max() > 1


def test_export_fp8_needs_deepseek_layout(tmp_path, capsys):
    out = tmp_path / "hf"
    err = _bad(capsys, out, "export", "--run-dir", tmp_path, "--out", out, "--format", "qwen2", "--quantize", "fp8")
    assert "pass --format deepseek_v3 --quantize fp8" in err


def test_fp8_quantizes_deepseeks_linears_only_and_rounds_within_float8():
    """The names DeepSeek stores in float8 (the MTP layer's linears too) and the ones it leaves alone (eh_proj,
    embeddings, heads, norms, router); a block's values come back within float8's rounding of its own scale."""
    for layer in (0, 2):  # a trunk layer and, with 2 layers, the MTP one
        p = f"model.layers.{layer}."
        for n in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa",
                  "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.experts.7.down_proj",
                  "mlp.shared_experts.up_proj"):
            assert fp8.quantized(p + n + ".weight"), n
        for n in ("eh_proj.weight", "enorm.weight", "embed_tokens.weight", "shared_head.head.weight",
                  "shared_head.norm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                  "input_layernorm.weight", "self_attn.kv_a_layernorm.weight"):
            assert not fp8.quantized(p + n), n
    assert not fp8.quantized("lm_head.weight") and not fp8.quantized("model.embed_tokens.weight")
    w = np.random.default_rng(0).standard_normal((200, 160)).astype(np.float32)
    w[128:, 128:] *= 1e-3  # the partial corner block: its own, much smaller scale
    q, s = fp8.quantize(w, fp8.BLOCK)
    assert q.dtype == fp8.DTYPE and s.shape == (2, 2) and s[1, 1] == np.abs(w[128:, 128:]).max() / 448
    back = fp8.dequantize(q, s, fp8.BLOCK)
    for i, j in np.ndindex(2, 2):
        blk = np.s_[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
        assert np.abs(back[blk] - w[blk]).max() <= np.abs(w[blk]).max() / 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run, its fp8 export, held-out token sequences) of a trained tiny DeepSeek-shaped run (MLA + MoE + one MTP
    module reading the normed state), 60 steps on byte text."""
    import sysconfig

    from test_convert_deepseek import DS
    from train_helpers import tiny_cfg

    from mtpjax.train.loop import train

    tmp = tmp_path_factory.mktemp("trained")
    keep = [o for o in DS if not o.startswith(("model.vocab_size", "data.seq_len", "model.init_std"))]
    cfg = tiny_cfg(tmp, *keep, "train.steps=60", "checkpoint.every=60", "train.eval_every=60")
    train(cfg)
    run = Path(cfg.train.run_dir)
    tok = load_model(run)[2]
    text = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text()  # not in the training corpus
    seqs = [tok.encode(text[i * 400:(i + 1) * 400])[:96] for i in range(8)]
    return run, export(run, tmp / "hf", "--quantize", "fp8"), seqs


def _acceptance(run: Path, seqs) -> float:
    from mtpjax.eval.evaluate import forced_acceptance

    return forced_acceptance(load_model(run)[1], seqs, 32, 1)[0]


@pytest.mark.slow
def test_fp8_export_keeps_mtp_acceptance_of_a_trained_run(tmp_path, trained):
    """The fp8 export, imported back, accepts the MTP module's drafts (teacher-forced, held-out text) within 2
    points of the run itself."""
    run, out, seqs = trained
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    a, b = _acceptance(run, seqs), _acceptance(tmp_path / "back", seqs)
    print(f"teacher-forced acceptance: run {a:.4f}, fp8 export {b:.4f}")
    assert a > 0.2 and abs(a - b) <= 0.02


@pytest.mark.slow
def test_companion_fp8_read_without_its_scales_loses_the_acceptance(tmp_path, trained, monkeypatch):
    """The float8 values read without their block scales (scale 1): the acceptance is no longer within 2 points."""
    run, out, seqs = trained
    monkeypatch.setattr(fp8, "dequantize", lambda w, s, block: np.asarray(w, np.float32))
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    assert abs(_acceptance(run, seqs) - _acceptance(tmp_path / "back", seqs)) > 0.02
