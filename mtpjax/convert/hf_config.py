"""config.json both ways: our model section as a Qwen2 / MiMo / Llama config, and a Llama / Qwen2 config as overrides.

Import refuses, with one line naming it, what our model cannot compute: another architecture (Qwen3's
per-head q/k norms, MoE, ...), sliding-window attention, biases beyond q/k/v, another activation, a RoPE
scaling other than Llama 3's, partial rotary embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpjax.config import ModelConfig
from mtpjax.convert.errors import ConvertError

_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32", "float64": "float32"}
_KNOWN = {  # model types people bring, and why they do not fit
    "qwen3": "per-head q/k RMSNorms", "qwen3_moe": "mixture of experts and q/k norms",
    "qwen2_moe": "mixture of experts",
    "mixtral": "mixture of experts", "deepseek_v3": "MLA attention and mixture of experts", "gemma": "GeGLU and "
    "offset norms", "gemma2": "soft-capping and sliding windows", "mistral": "sliding-window attention",
    "phi3": "fused projections", "mimo": "custom code",
}



def rope_fields(cfg: ModelConfig) -> dict:
    """RoPE keys in both spellings: rope_theta/rope_scaling (engines, older transformers) and rope_parameters."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_len}
        params.update(scaling)
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def export_config(cfg: ModelConfig, fmt: str, mtp_modules: int, eos_id: int, max_positions: int) -> dict:
    """config.json of an exported model (MiMoForCausalLM + num_nextn_predict_layers when it carries MTP modules)."""
    if cfg.rope_scaling == "llama3":  # transformers wants the scaled context above the original one
        max_positions = max(max_positions, int(cfg.rope_original_max_len * cfg.rope_scaling_factor))
    out = {
        "architectures": ["LlamaForCausalLM" if fmt == "llama" else "MiMoForCausalLM" if mtp_modules
                          else "Qwen2ForCausalLM"],
        "model_type": fmt,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_positions, "rms_norm_eps": cfg.norm_eps, **rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype, "use_cache": True, "attention_dropout": 0.0,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": eos_id,
    }
    if fmt == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        if mtp_modules:
            out["num_nextn_predict_layers"] = mtp_modules
    return out


def read_config(directory: Path) -> dict:
    """The parsed config.json of a Hugging Face directory; ConvertError if missing or not JSON."""
    p = Path(directory) / "config.json"
    if not p.is_file():
        raise ConvertError(f"'{directory}' has no config.json; pass a Hugging Face model directory (save_pretrained)")
    try:
        raw = json.loads(p.read_text())
    except ValueError as e:
        raise ConvertError(f"'{p}' is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"'{p}' must hold a JSON object")
    return raw


def architecture(hf: dict) -> str:
    """qwen2 or llama (the layout of the checkpoint); ConvertError naming anything else."""
    mt, arch = hf.get("model_type"), (hf.get("architectures") or ["?"])[0]
    if mt in ("qwen2", "llama"):
        return mt
    why = _KNOWN.get(mt, "not a Llama or Qwen2 model")
    raise ConvertError(f"unsupported architecture {arch} (model_type {mt!r}: {why}); "
                        "import takes LlamaForCausalLM or Qwen2ForCausalLM checkpoints")


def _refuse(hf: dict, fmt: str) -> None:
    """ConvertError for the first feature of a Llama / Qwen2 config our model cannot compute."""
    if any(k in hf for k in ("num_experts", "num_local_experts", "moe_intermediate_size")):
        raise ConvertError("the config describes a mixture-of-experts model, which mtpjax cannot represent")
    types = set(hf.get("layer_types") or [])
    if hf.get("use_sliding_window") or types - {"full_attention"}:
        raise ConvertError("the config uses sliding-window attention, which mtpjax cannot represent; "
                            "set use_sliding_window=false only if the model was trained without it")
    if fmt == "llama" and hf.get("mlp_bias"):
        raise ConvertError("the config has MLP biases (mlp_bias=true), which mtpjax cannot represent")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"the config uses hidden_act={hf['hidden_act']!r}; mtpjax's MLP is SwiGLU (silu)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError("the config rotates part of each head (partial_rotary_factor), which mtpjax cannot "
                           "represent")


def _rope(hf: dict) -> list[str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    if kind == "default":
        return [f"model.rope_theta={float(theta)}"]
    if kind != "llama3":
        raise ConvertError(f"the config uses RoPE scaling {kind!r}; mtpjax implements only llama3 scaling")
    return [f"model.rope_theta={float(theta)}", "model.rope_scaling=llama3",
            f"model.rope_scaling_factor={float(merged['factor'])}",
            f"model.rope_low_freq_factor={float(merged['low_freq_factor'])}",
            f"model.rope_high_freq_factor={float(merged['high_freq_factor'])}",
            f"model.rope_original_max_len={int(merged['original_max_position_embeddings'])}"]


def model_overrides(hf: dict) -> tuple[str, list[str]]:
    """(format, dotted model.* overrides) reproducing a Llama / Qwen2 config; ConvertError if it cannot."""
    fmt = architecture(hf)
    _refuse(hf, fmt)
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or d // heads)
        dtype = _DTYPE.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), "float32")
        out = [f"model.vocab_size={int(hf['vocab_size'])}", f"model.d_model={d}",
               f"model.n_layers={int(hf['num_hidden_layers'])}", f"model.n_heads={heads}",
               f"model.n_kv_heads={int(hf.get('num_key_value_heads') or heads)}",
               f"model.head_dim={0 if head_dim * heads == d else head_dim}",
               f"model.d_ff={int(hf['intermediate_size'])}", f"model.norm_eps={float(hf.get('rms_norm_eps', 1e-6))}",
               f"model.tie_embeddings={str(bool(hf.get('tie_word_embeddings', False))).lower()}",
               f"model.init_std={float(hf.get('initializer_range', 0.02))}",
               f"model.param_dtype={dtype}", *_rope(hf)]
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"config.json lacks or mistypes a required field ({type(e).__name__}: {e})") from None
    if hf.get("num_nextn_predict_layers"):
        out.append(f"model.mtp_depth={int(hf['num_nextn_predict_layers'])}")
    return fmt, out
