"""Hugging Face export and import, checked against transformers and a torch re-implementation of the engines' MiMo.

Runs are written directly (a model-only checkpoint of a perturbed random init: every norm scale differs from
1, so a swapped norm shows) except where a trained model matters. Every comparison is float32.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from mimo_reference import MiMoReference
from safetensors.torch import load_file
from train_helpers import tiny_cfg, write_corpus
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mtpjax.train.checkpoint import load_model
from mtpjax.config import load_config
from mtpjax.convert import layout
from mtpjax.convert.errors import ConvertError
from mtpjax.cli.convert import main
from mtpjax.convert.hf_tokenizer import export_tokenizer
from mtpjax.convert.importer import lazy_tree, save_model_checkpoint
from mtpjax.data import ByteTokenizer, train_bpe
from mtpjax.nn.model import build_model, init_mtp_from_last_block, param_counts

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=64", "model.mtp_depth=2", "model.init_std=0.2", "data.seq_len=32"]
TOL = 1e-4


def params_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def make_run(tmp: Path, name: str, *overrides: str, seed: int = 0) -> Path:
    """A model-only run directory (the items load_model reads) holding a randomly perturbed init (MoE routing
    biases, the state beside the parameters, included)."""
    run = tmp / name
    cfg = load_config(None, [*BASE, f"train.run_dir={run}", *overrides])
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: (np.asarray(x, np.float32) + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype),
                          nnx.to_pure_dict(nnx.state(build_model(cfg, seed=seed))))
    run.mkdir(parents=True)
    save_model_checkpoint(run, lazy_tree(params), {"step": 0, "config": cfg.to_dict()})
    (run / "config.yaml").write_text(cfg.to_yaml())
    ByteTokenizer().save(run / "tokenizer")
    return run


def batch(vocab=256, B=2, T=24, seed=1):
    return np.random.default_rng(seed).integers(1, vocab, (B, T)).astype(np.int32)


@nnx.jit
def _all_logits(model, tokens_BT):
    return model.logits(model(tokens_BT).hidden)


def our_logits(model, tokens) -> np.ndarray:
    """All depths' logits [depth, B, T, V] of our model (one compiled forward: eager runs compile op by op)."""
    return np.asarray(_all_logits(model, jnp.asarray(tokens)))


def hf_logits(directory, tokens) -> tuple[np.ndarray, str]:
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy(), type(hf).__name__


def cli(*argv) -> int:
    return main([str(a) for a in argv])


# ----------------------------------------------------------------------------- export -> transformers


@pytest.mark.parametrize("overrides, fmt, cls", [
    ((), "qwen2", "Qwen2ForCausalLM"),  # tied head, GQA, zero q/k/v biases written
    (("model.tie_embeddings=false", "model.qkv_bias=true", "model.n_kv_heads=4", "model.head_dim=16",
      "model.rope_theta=500.0", "model.norm_eps=1e-5"), "qwen2", "Qwen2ForCausalLM"),
    (("model.tie_embeddings=false", "model.scan_layers=true", "model.rope_scaling=llama3",
      "model.rope_scaling_factor=4.0", "model.rope_original_max_len=16"), "qwen2", "Qwen2ForCausalLM"),
    (("model.tie_embeddings=false", "model.mtp_depth=0"), "llama", "LlamaForCausalLM"),
    (("model.qkv_bias=true", "model.mtp_depth=0"), "llama", "LlamaForCausalLM"),  # attention_bias, zero o_proj bias
])
def test_export_logits_equal_transformers(tmp_path, overrides, fmt, cls):
    run = make_run(tmp_path, "run", *overrides)
    out = tmp_path / "hf"
    assert cli("export", "--run-dir", run, "--out", out, "--format", fmt) == 0
    _, model, _ = load_model(run)
    toks = batch()
    theirs, name = hf_logits(out, toks)
    assert name == cls
    assert np.abs(our_logits(model, toks)[0] - theirs).max() <= TOL
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["head_dim"] == model.cfg.resolved_head_dim
    expect_mtp = fmt == "qwen2" and model.cfg.mtp_depth > 0
    assert config["architectures"] == [("MiMoForCausalLM" if expect_mtp else cls)]
    assert config.get("num_nextn_predict_layers", 0) == (1 if expect_mtp else 0)


def test_export_detects_a_swapped_norm(tmp_path, monkeypatch):
    """Companion: exporting the attention norm as the MLP norm (and back) moves the logits well past the tolerance."""
    run = make_run(tmp_path, "run")
    swapped = tuple((n, ("mlp_norm", "scale") if p == ("attn_norm", "scale") else ("attn_norm", "scale")
                     if p == ("mlp_norm", "scale") else p, k) for n, p, k in layout._BLOCK)
    monkeypatch.setattr(layout, "_BLOCK", swapped)
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf") == 0
    _, model, _ = load_model(run)
    theirs, _ = hf_logits(tmp_path / "hf", batch())
    assert np.abs(our_logits(model, batch())[0] - theirs).max() > 1e-2


def test_sharded_export_loads_and_imports_back(tmp_path):
    """Above --shard-mb the weights split into files plus an index; transformers and our import both read it."""
    run = make_run(tmp_path, "run", "model.tie_embeddings=false")
    out = tmp_path / "hf"
    assert cli("export", "--run-dir", run, "--out", out, "--shard-mb", "0.05", "--mtp-modules", "2") == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(
        int(np.prod(v["shape"])) * 4 for f in shards for k, v in _header(out / f).items() if k != "__metadata__")
    _, model, _ = load_model(run)
    theirs, _ = hf_logits(out, batch())
    assert np.abs(our_logits(model, batch())[0] - theirs).max() <= TOL
    assert cli("import", "--hf", out, "--out", tmp_path / "back") == 0
    _, back, _ = load_model(tmp_path / "back")
    _assert_same_params(params_of(model), params_of(back))


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


# ----------------------------------------------------------------------------- the engines' MiMo MTP forward


@nnx.jit(static_argnums=2)
def _module1_engine(model, tokens_BT, zero_first: bool):
    h, _ = model.trunk(tokens_BT)
    emb = model.embed_tokens(tokens_BT[:, 1:])
    if zero_first:
        emb = emb.at[:, 0].set(0.0)
    pos = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1] - 1), emb.shape[:2])
    h1 = model.mtp[0](model.trunk_state(h[:, :-1]), emb, pos, None, None, "none")[0]  # (hidden, cache, routing)
    return model.logits(model.mtp[0].norm(h1))


def _module1_with_engine_inputs(model, tokens, zero_first: bool) -> np.ndarray:
    """Our module 1 at positions 0..T-2 fed as the engine feeds it: the trunk state at i and token x[i+1]
    (with zero_first, the embedding at position 0 zeroed, as vLLM and SGLang do)."""
    return np.asarray(_module1_engine(model, jnp.asarray(tokens), zero_first))


def test_engine_mimo_forward_equals_module_1(tmp_path):
    """The engines' MiMo MTP layer, loaded from the exported files only, computes our module 1.

    vLLM and SGLang zero the token embedding at position 0 ("not needed by MTP"); our modules are trained
    without that mask. So: fed the same inputs, reference and module 1 agree at every position; against our
    own convention they differ at position 0 and, through attention to position 0, a little after it.
    """
    run = make_run(tmp_path, "run", "model.tie_embeddings=false", "model.qkv_bias=true")
    out = tmp_path / "hf"
    assert cli("export", "--run-dir", run, "--out", out) == 0
    _, model, _ = load_model(run)
    ref = MiMoReference(out)
    toks = batch()
    engine = ref.depth1_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    assert np.abs(engine - _module1_with_engine_inputs(model, toks, zero_first=True)).max() <= TOL
    ours = our_logits(model, toks)[1][:, :-1]  # depth 1 at i reads x[i+1]: positions 0..T-2
    assert np.abs(ours - _module1_with_engine_inputs(model, toks, zero_first=False)).max() <= TOL
    assert np.abs(engine - ours)[:, 0].max() > 1e-2  # the engine's mask at position 0 matters
    main_logits = ref.main_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    assert np.abs(main_logits - our_logits(model, toks)[0]).max() <= TOL


def test_engine_forward_detects_unswapped_input_proj(tmp_path, monkeypatch):
    """Companion: writing eh_proj without swapping its halves (DeepSeek's order) breaks the MiMo equivalence."""
    run = make_run(tmp_path, "run")
    monkeypatch.setattr(layout, "to_hf", lambda t, x: np.asarray(x).T if t.kind in ("t", "eh") else np.asarray(x))
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf") == 0
    _, model, _ = load_model(run)
    toks = batch()
    engine = MiMoReference(tmp_path / "hf").depth1_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    assert np.abs(engine - _module1_with_engine_inputs(model, toks, zero_first=True)).max() > 1e-2


@pytest.mark.slow
def test_engine_greedy_drafts_on_a_trained_model(tmp_path):
    """A trained tiny model (written by train.py's own checkpointer): the engine's greedy drafts equal module 1's
    under the engine's inputs at every position, and how often they equal our own drafts is measured."""
    from mtpjax.train.loop import train

    cfg = tiny_cfg(tmp_path, "train.steps=60", "checkpoint.every=60", "train.eval_every=60",
                   "model.tie_embeddings=false")
    train(cfg)
    out = tmp_path / "hf"
    assert cli("export", "--run-dir", cfg.train.run_dir, "--out", out) == 0
    _, model, tok = load_model(cfg.train.run_dir)
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text()  # not in the training corpus
    toks = np.asarray([tok.encode(text[i * 300:(i + 1) * 300])[:128] for i in range(4)], np.int32)
    engine_logits = MiMoReference(out).depth1_logits(torch.tensor(toks, dtype=torch.long)).numpy()
    ours_logits = our_logits(model, toks)[1][:, :-1]
    engine, ours = engine_logits.argmax(-1), ours_logits.argmax(-1)
    assert (engine == _module1_with_engine_inputs(model, toks, zero_first=True).argmax(-1)).all()
    agree = float((engine[:, 1:] == ours[:, 1:]).mean())
    gap = np.abs(engine_logits - ours_logits).max(axis=(0, 2))
    print(f"engine drafts equal to ours at positions >= 1: {agree:.4f} of {engine[:, 1:].size}; position 0: "
          f"{float((engine[:, 0] == ours[:, 0]).mean()):.2f}; max |logit gap| at 0: {gap[0]:.3g}, at 1..7: "
          f"{gap[1:8].max():.3g}, at >= 32: {gap[32:].max():.3g}")
    assert agree > 0.9


# ----------------------------------------------------------------------------- import from transformers


def _tokenizer_json(directory: Path) -> None:
    """A small byte-level BPE saved as the directory's tokenizer.json (ids < 300)."""
    corpus = write_corpus(directory.parent)
    tok = train_bpe(iter(corpus.read_text().split("\n\n")), 300)
    tok._tok.save(str(directory / "tokenizer.json"))


def _hf_model(kind: str, seed=0):
    torch.manual_seed(seed)
    common = {"vocab_size": 320, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "initializer_range": 0.1}
    if kind == "llama":
        cfg = LlamaConfig(**common, head_dim=16, rope_theta=5000.0, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        model = LlamaForCausalLM(cfg)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=20000.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # nonzero biases, norm scales away from 1
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_import_transformers_model_logits(tmp_path, kind):
    hf_dir = tmp_path / kind
    hf = _hf_model(kind)
    hf.save_pretrained(str(hf_dir))
    _tokenizer_json(hf_dir)
    out = tmp_path / "run"
    assert cli("import", "--hf", hf_dir, "--out", out) == 0
    cfg, model, tok = load_model(out)
    m = cfg.model
    assert (m.qkv_bias, m.rope_scaling) == ((False, "llama3") if kind == "llama" else (True, "none"))
    assert (m.mtp_depth, m.tie_embeddings, m.n_kv_heads, m.norm_eps) == (1, False, 2, 1e-5)
    assert tok.vocab_size == 300 and (out / "config.yaml").is_file()
    assert cfg.data.tokenizer == str(out.absolute() / "tokenizer" / "tokenizer.json")  # data prepared later matches
    toks = batch(vocab=320, T=48)  # longer than llama3's original 32 positions
    with torch.no_grad():
        theirs = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    assert np.abs(our_logits(model, toks)[0] - theirs).max() <= TOL
    if kind == "llama":  # companion: without the llama3 rule the logits move
        plain = build_model(load_config(None, [*_model_overrides(m), "model.rope_scaling=none"]))
        nnx.update(plain, nnx.state(model))
        assert np.abs(our_logits(plain, toks)[0] - theirs).max() > 10 * TOL


def _model_overrides(m) -> list[str]:
    return [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in m.__dict__.items()]


@pytest.mark.slow
def test_imported_run_decodes_with_fresh_mtp_modules(tmp_path):
    """decode.py reads the imported directory unchanged; speculative greedy output equals plain greedy."""
    hf_dir = tmp_path / "qwen2"
    _hf_model("qwen2").save_pretrained(str(hf_dir))
    _tokenizer_json(hf_dir)
    out = tmp_path / "run"
    assert cli("import", "--hf", hf_dir, "--out", out, "model.mtp_depth=2") == 0
    outs = []
    for draft in ("2", "0"):
        p = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--run-dir", str(out), "--prompt", "def f(x):",
                            "--max-new-tokens", "12", "--num-draft", draft, "--stats"],
                           check=False, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr
        assert ("[plain]" if draft == "0" else f"[mtp draft={draft}]") in p.stderr  # what ran
        outs.append(p.stdout)
    assert outs[0] == outs[1] and len(outs[0].strip()) > 0


def test_mtp_init_last_block(tmp_path):
    """model.mtp_init=last_block: imported modules' blocks are the last trunk layer; the same rule as the model's."""
    hf_dir = tmp_path / "llama"
    hf = _hf_model("llama")
    hf.save_pretrained(str(hf_dir))
    _tokenizer_json(hf_dir)
    assert cli("import", "--hf", hf_dir, "--out", tmp_path / "run", "model.mtp_depth=2",
               "model.mtp_init=last_block") == 0
    _, model, _ = load_model(tmp_path / "run")
    p = params_of(model)
    for k in (0, 1):
        _assert_same_params(p["blocks"][1], p["mtp"][k]["block"])
        assert np.all(p["mtp"][k]["enorm"]["scale"] == 1.0)
    fresh = build_model(load_config(None, [*_model_overrides(model.cfg), "model.mtp_init=random"]), seed=3)
    nnx.update(fresh.blocks, nnx.state(model.blocks))
    init_mtp_from_last_block(fresh)  # the model's own rule gives the blocks the importer wrote
    for k in (0, 1):
        _assert_same_params(params_of(fresh)["mtp"][k]["block"], p["mtp"][k]["block"])


def test_model_features_for_import(model_cfg):
    """q/k/v biases are zero-initialised, sharded by heads, counted; last_block init copies (no shared buffers)."""
    from jax.sharding import PartitionSpec as P

    from mtpjax.config import MeshConfig
    from mtpjax.parallel.sharding import make_mesh, state_shardings

    plain, bias = build_model(model_cfg()), build_model(model_cfg(qkv_bias=True, mtp_init="last_block"))
    c = model_cfg()
    per_block = c.n_heads * c.resolved_head_dim + 2 * c.n_kv_heads * c.resolved_head_dim
    assert param_counts(bias)["total"] - param_counts(plain)["total"] == per_block * (c.n_layers + c.mtp_depth)
    assert np.all(np.asarray(bias.blocks[0].attn.wq.bias[...]) == 0)
    shardings = state_shardings(nnx.state(bias, nnx.Param), make_mesh(MeshConfig(), jax.devices()[:1]))
    assert shardings["blocks"][0]["attn"]["wk"]["bias"].get_value().spec == P("tensor")
    for m in bias.mtp:
        _assert_same_params(nnx.to_pure_dict(nnx.state(m.block)), nnx.to_pure_dict(nnx.state(bias.blocks[-1])))
        assert m.block.attn.wq.kernel[...] is not bias.blocks[-1].attn.wq.kernel[...]


# ----------------------------------------------------------------------------- export -> import round trip


def _assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("overrides, back", [
    (("model.tie_embeddings=false", "model.qkv_bias=true"), ()),
    (("model.scan_layers=true", "model.param_dtype=bfloat16"), ("model.scan_layers=true",)),
])
def test_export_import_roundtrip_is_bitwise(tmp_path, overrides, back):
    from mtpjax.decode import generate

    run = make_run(tmp_path, "run", *overrides)
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf", "--mtp-modules", "2") == 0
    assert cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back", *back) == 0
    cfg_a, a, tok_a = load_model(run)
    cfg_b, b, tok_b = load_model(tmp_path / "back")
    assert cfg_b.model == cfg_a.model and type(tok_b) is type(tok_a)
    _assert_same_params(params_of(a), params_of(b))
    # what torch readers see: the same numbers, bfloat16 bits included
    embed = load_file(str(tmp_path / "hf" / "model.safetensors"))["model.embed_tokens.weight"]
    assert str(embed.dtype) == f"torch.{cfg_a.model.param_dtype}"
    assert np.array_equal(embed.float().numpy(), np.asarray(a.embed[...], np.float32))
    if not cfg_a.model.scan_layers:  # one case suffices: equal parameters and config decode alike
        prompts = [tok_a.encode("def f(x):"), tok_a.encode("import os\n")]
        gen = [[list(map(int, r)) for r in generate(m, prompts, max_new_tokens=10, draft=2).tokens] for m in (a, b)]
        assert gen[0] == gen[1]


def test_companion_an_export_that_changes_one_tensor_fails_the_roundtrip(tmp_path, monkeypatch):
    """The bitwise comparison above can fail: one bit of one element of MTP module 2's MLP down projection,
    flipped on the way out, survives the import and is caught."""
    from mtpjax.convert import export

    real = export.write_checkpoint

    def flip_one_bit(directory, specs, max_bytes):
        last = [s.name for s in specs].index("model.mtp_layers.1.mlp.down_proj.weight")

        def produce(spec=specs[last]):
            x = np.array(spec.produce(), order="C")  # a copy reshape(-1) views
            x.reshape(-1).view(np.uint32)[0] ^= 1  # float32: the last mantissa bit
            return x
        return real(directory, [*specs[:last], specs[last]._replace(produce=produce), *specs[last + 1:]], max_bytes)

    monkeypatch.setattr(export, "write_checkpoint", flip_one_bit)
    run = make_run(tmp_path, "run", "model.tie_embeddings=false")
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf", "--mtp-modules", "2") == 0
    assert cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back") == 0
    with pytest.raises(AssertionError):
        _assert_same_params(params_of(load_model(run)[1]), params_of(load_model(tmp_path / "back")[1]))


def _flip_a_byte_of(path: Path, tensor: str) -> None:
    """One byte in the middle of `tensor`'s data, flipped in the file."""
    n = int.from_bytes(path.read_bytes()[:8], "little")
    begin, end = json.loads(path.read_bytes()[8:8 + n])[tensor]["data_offsets"]
    with path.open("r+b") as f:
        f.seek(8 + n + (begin + end) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def test_import_checks_the_exported_digests(tmp_path, capsys):
    """An export records each tensor's digest; a flipped byte is refused by name. Companion: the same file with its
    digests' keys renamed (as a writer without them would leave it) imports the flipped value silently."""
    run = make_run(tmp_path, "run")
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf") == 0
    st = tmp_path / "hf" / "model.safetensors"
    name = "model.layers.0.mlp.down_proj.weight"
    assert f'"mtpjax.xxh3-128.{name}":"' in st.read_bytes()[:20000].decode(errors="replace")
    _flip_a_byte_of(st, name)
    err = _bad(capsys, tmp_path / "back", "import", "--hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert f"tensor {name} in" in err and "does not match its xxh3-128 digest" in err, err
    st.write_bytes(st.read_bytes().replace(b'"mtpjax.xxh3-128.', b'"mtpjax.xxh3-12X.'))  # same length: offsets hold
    assert cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back") == 0
    with pytest.raises(AssertionError):
        _assert_same_params(params_of(load_model(run)[1]), params_of(load_model(tmp_path / "back")[1]))


def test_a_digest_mismatch_found_while_writing_logs_no_traceback(tmp_path, capsys, caplog):
    """The digest is checked as orbax writes the leaf, in its writer threads: the refusal is the one `error:` line,
    with no logged ERROR and traceback from those threads (a real process prints them on stderr)."""
    run = make_run(tmp_path, "run")
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf") == 0
    _flip_a_byte_of(tmp_path / "hf" / "model.safetensors", "model.layers.0.mlp.down_proj.weight")
    caplog.clear()
    _bad(capsys, tmp_path / "back", "import", "--hf", tmp_path / "hf", "--out", tmp_path / "back")
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage()[:200] for r in logged]


def test_default_export_writes_module_1_only(tmp_path):
    run = make_run(tmp_path, "run")
    assert cli("export", "--run-dir", run, "--out", tmp_path / "hf") == 0
    names = set(_header(tmp_path / "hf" / "model.safetensors"))
    assert "model.mtp_layers.0.input_proj.weight" in names and not any(".mtp_layers.1." in n for n in names)
    assert cli("import", "--hf", tmp_path / "hf", "--out", tmp_path / "back") == 0
    _, a, _ = load_model(run)
    cfg, b, _ = load_model(tmp_path / "back")
    assert cfg.model.mtp_depth == 1
    _assert_same_params(params_of(a)["mtp"][0], params_of(b)["mtp"][0])


# ----------------------------------------------------------------------------- tokenizers


def _random_strings(n: int, seed: int) -> list[str]:
    """Held-out strings mixing ASCII, code, other scripts, emoji, whitespace, NUL and the literal EOS text."""
    rng = random.Random(seed)
    pieces = ["def ", "return", " x", "\n", "\t", "  ", "日本語", "é", "🙂", "\x00", "<|eos|>", "{", "}", "42", "ß",
              "Привет", "\r\n", "'''", "#", "😀👍", "a", "Z"]
    out = []
    for _ in range(n):
        parts = [rng.choice(pieces) if rng.random() < 0.5 else chr(rng.randint(32, 0x2FFF))
                 for _ in range(rng.randint(1, 30))]
        out.append("".join(parts).encode("utf-8", "replace").decode("utf-8", "replace"))
    return out


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_exported_tokenizer_encodes_like_mtpjax(tmp_path, kind):
    if kind == "byte":
        tok = ByteTokenizer()
    else:
        tok = train_bpe(iter(write_corpus(tmp_path).read_text().split("\n\n")), 400)
    export_tokenizer(tok, tmp_path, 2048)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token_id == tok.eos_id
    strings = _random_strings(200, seed=7)
    assert any("<|eos|>" in s for s in strings) and any("\x00" in s for s in strings)
    for s in strings:
        assert hf(s, add_special_tokens=True)["input_ids"] == tok.encode(s), repr(s)


def test_exported_tokenizer_keeps_eos_text_as_text(tmp_path):
    """Companion: without split_special_tokens a literal <|eos|> in the text becomes the EOS id."""
    tok = train_bpe(iter(write_corpus(tmp_path).read_text().split("\n\n")), 400)
    export_tokenizer(tok, tmp_path, 2048)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "split_special_tokens": False}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("a<|eos|>b")["input_ids"] != tok.encode("a<|eos|>b")


# ----------------------------------------------------------------------------- bad input


def _bad(capsys, out: Path, *argv) -> str:
    capsys.readouterr()
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))
    return err


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    _hf_model("qwen2").save_pretrained(str(d))
    _tokenizer_json(d)
    return d


def _edit_config(d: Path, **changes) -> None:
    """config.json with `changes` set in it (a change to None removes the key)."""
    cfg = json.loads((d / "config.json").read_text()) | changes
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def _redeclare(d: Path, name: str, **info) -> None:
    """model.safetensors with tensor `name`'s header entry updated by `info` (the data bytes as they were)."""
    f = d / "model.safetensors"
    raw, head = f.read_bytes(), _header(f)
    head[name].update(info)
    new = json.dumps(head, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + int.from_bytes(raw[:8], "little"):])


def _retyped(**info):
    """An edit of the embedding's (float32) header entry."""
    return lambda d: _redeclare(d, "model.embed_tokens.weight", **info)


def _index(d: Path, text: str) -> None:
    (d / "model.safetensors.index.json").write_text(text)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "must hold a JSON object"),
    (lambda d: _edit_config(d, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda d: _edit_config(d, model_type="llama", mlp_bias=True), "mlp_bias=true"),
    (lambda d: _edit_config(d, model_type="llama", attention_bias=False), "config.json says attention_bias=false"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 4), "not a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little")), "header length is implausible"),
    (_retyped(dtype="C64"), "unsupported dtype C64"),
    (_retyped(dtype="F8_E5M2"), "float8 other than e4m3"),
    (_retyped(shape=[1]), "offsets that do not match its shape"),
    (_retyped(dtype="I32"), "is int32; import takes float checkpoints"),
    (lambda d: _index(d, "{nope"), "is not a valid safetensors index"),
    (lambda d: _index(d, '{"weight_map": {"lm_head.weight": "model-2.safetensors"}}'), "names model-2.safetensors"),
    (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda d: (d / "tokenizer.json").unlink(), "no usable tokenizer"),
    (lambda d: _edit_config(d, model_type="qwen3", architectures=["Qwen3ForCausalLM"]), "q/k RMSNorms"),
    (lambda d: _edit_config(d, model_type="mixtral"), "mixture of experts"),
    (lambda d: _edit_config(d, num_experts=8), "mixture-of-experts"),
    (lambda d: _edit_config(d, use_sliding_window=True, sliding_window=16), "sliding-window"),
    (lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "'yarn'"),
    (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act"),
    (lambda d: _edit_config(d, intermediate_size=64), "shape"),
    (lambda d: _edit_config(d, num_hidden_layers=3), "lacks tensor model.layers.2"),
    (lambda d: _edit_config(d, num_hidden_layers=1), "has tensor model.layers.1"),
    (lambda d: (d / "config.json").write_text("{nope"), "not valid JSON"),
    (lambda d: _edit_config(d, vocab_size=100), "tokenizer has 300 ids"),
])
def test_import_bad_input(tmp_path, capsys, hf_dir, edit, needle):
    edit(hf_dir)
    err = _bad(capsys, tmp_path / "run", "import", "--hf", hf_dir, "--out", tmp_path / "run")
    assert needle in err


def test_import_refuses_output_bias_and_bad_overrides(tmp_path, capsys, hf_dir):
    run = tmp_path / "run"
    assert "drop the checkpoint's nonzero q/k/v biases" in _bad(capsys, run, "import", "--hf", hf_dir, "--out", run,
                                                               "model.qkv_bias=false")
    assert "'model.mtp_kind'" in _bad(capsys, run, "import", "--hf", hf_dir, "--out", run, "model.mtp_kin=parallel")
    d = tmp_path / "llama"
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.bias.add_(1.0)
    model.save_pretrained(str(d))
    _tokenizer_json(d)
    assert "o_proj" in _bad(capsys, run, "import", "--hf", d, "--out", run)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.bias.zero_()
    model.save_pretrained(str(d))
    assert cli("import", "--hf", d, "--out", run) == 0  # a zero o_proj bias computes nothing
    capsys.readouterr()
    assert "already exists" in _bad_existing(capsys, run, "import", "--hf", d, "--out", run)
    assert "is not a directory" in _bad(capsys, tmp_path / "new", "import", "--hf", d / "config.json", "--out",
                                        tmp_path / "new")


def test_export_bad_input(tmp_path, capsys):
    plain = make_run(tmp_path, "plain", "model.mtp_depth=0")
    parallel = make_run(tmp_path, "parallel", "model.mtp_kind=parallel")
    seq = make_run(tmp_path, "seq")
    out = tmp_path / "hf"
    cases = [
        ((plain, "--mtp-modules", "1"), "more MTP modules than the run has"),
        ((seq, "--mtp-modules", "3"), "more MTP modules than the run has"),
        ((seq, "--mtp-modules", "-1"), "--mtp-modules -1 must be >= 0"),
        ((parallel, "--mtp-modules", "1"), "mtp_kind=parallel"),
        ((seq, "--format", "llama", "--mtp-modules", "1"), "trunk only"),
        ((seq, "--step", "7"), "no checkpoint at step 7"),
        ((tmp_path / "nothing",), "not a run directory"),
        ((seq, "--shard-mb", "0"), "--shard-mb"),
    ]
    for args, needle in cases:
        assert needle in _bad(capsys, out, "export", "--run-dir", *args, "--out", out)
    out.mkdir()
    assert "already exists" in _bad_existing(capsys, out, "export", "--run-dir", seq, "--out", out)
    out.rmdir()
    # a run without MTP modules exports its trunk by default
    assert cli("export", "--run-dir", plain, "--out", tmp_path / "trunk") == 0
    assert json.loads((tmp_path / "trunk" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_export_refuses_a_bad_out_or_format_and_a_full_disk_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from mtpjax.convert import export as export_mod

    run, out = make_run(tmp_path, "run"), tmp_path / "hf"
    (tmp_path / "a_file").write_text("")
    assert "the parent of --out" in _bad(capsys, tmp_path / "a_file" / "hf", "export", "--run-dir", run, "--out",
                                         tmp_path / "a_file" / "hf")
    with pytest.raises(ConvertError, match="^--format gpt2 is unknown; use one of "):
        export_mod.export_run(run, out, fmt="gpt2")

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod, "write_checkpoint", full)
    assert f"writing {out} failed (No space left on device); nothing was written" in _bad(
        capsys, out, "export", "--run-dir", run, "--out", out)
    deep = tmp_path / "new" / "deeper" / "hf"  # failing, it removes the parents it made too
    assert "nothing was written" in _bad(capsys, deep, "export", "--run-dir", run, "--out", deep)
    assert not (tmp_path / "new").exists()


def test_export_makes_the_missing_parents_of_out(tmp_path):
    """`--out exports/tiny` on a fresh checkout: its parents are made, as train.py makes a run directory's."""
    run = make_run(tmp_path, "run")
    assert cli("export", "--run-dir", run, "--out", tmp_path / "exports" / "deep" / "tiny") == 0
    assert (tmp_path / "exports" / "deep" / "tiny" / "config.json").is_file()


def _bad_existing(capsys, out: Path, *argv) -> str:
    before = sorted(out.iterdir())
    capsys.readouterr()
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and sorted(out.iterdir()) == before
    return err


@pytest.mark.parametrize("fmt", ["qwen2", "llama"])
def test_export_refuses_a_sentencepiece_tokenizer_before_writing(tmp_path, capsys, monkeypatch, fmt):
    """Every format checks the tokenizer first: no weight is written for a refused export (llama too)."""
    import mtpjax.data
    from mtpjax.convert import export

    run = make_run(tmp_path, "run")
    sp = type("SP", (), {"kind": "sentencepiece", "vocab_size": 200, "eos_id": 2})()
    monkeypatch.setattr(mtpjax.data, "tokenizer_from_dir", lambda d: sp)
    monkeypatch.setattr(export, "write_checkpoint", lambda *a: pytest.fail("weights written before the refusal"))
    assert "sentencepiece tokenizer cannot be exported" in _bad(capsys, tmp_path / "hf", "export", "--run-dir", run,
                                                                "--out", tmp_path / "hf", "--format", fmt)


def test_export_failing_midway_leaves_nothing(tmp_path, capsys):
    """A checkpoint whose arrays are gone fails while writing: one line, exit 2, no output or temporary directory."""
    import shutil

    run = make_run(tmp_path, "run")
    for p in (run / "checkpoints" / "0" / "model").iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    assert "unreadable" in _bad(capsys, tmp_path / "hf", "export", "--run-dir", run, "--out", tmp_path / "hf")


def test_cli_subprocess_bad_input_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mtpjax.convert", "import", "--hf", str(tmp_path), "--out",
                        str(tmp_path / "x")], check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and not (tmp_path / "x").exists()
