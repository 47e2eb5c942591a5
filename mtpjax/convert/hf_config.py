"""config.json both ways: our model section as a Qwen2 / MiMo / Llama / DeepSeek-V3 config, and such a config as
overrides.

Import refuses, with one line naming it, what our model cannot compute: another architecture (Qwen3's
per-head q/k norms, Mixtral's softmax routing, ...), sliding-window attention, biases beyond q/k/v, another
activation, a RoPE scaling other than Llama 3's (and YaRN for DeepSeek-V3), partial rotary embeddings,
DeepSeek routing other than V3's (sigmoid scores, noaux_tc, normalized top-k, every layer past the dense ones
MoE), quantization other than DeepSeek-V3's fp8 block scales (mtpjax.convert.fp8).
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpjax.config import ModelConfig
from mtpjax.convert import fp8
from mtpjax.convert.errors import ConvertError

_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32", "float64": "float32"}
_KNOWN = {  # model types people bring, and why they do not fit
    "qwen3": "per-head q/k RMSNorms", "qwen3_moe": "mixture of experts and q/k norms",
    "qwen2_moe": "mixture of experts",
    "mixtral": "mixture of experts", "deepseek_v2": "softmax-routed experts", "gemma": "GeGLU and "
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
    elif cfg.rope_scaling == "yarn":
        scaling = {"rope_type": "yarn", "type": "yarn", "factor": cfg.rope_scaling_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_len, "beta_fast": cfg.rope_beta_fast,
                   "beta_slow": cfg.rope_beta_slow, "mscale": cfg.rope_mscale,
                   "mscale_all_dim": cfg.rope_mscale_all_dim}
        params.update(scaling)
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def deepseek_config(cfg: ModelConfig, mtp_modules: int) -> dict:
    """The DeepSeek-V3 keys of config.json: MLA, the routing the engines read, and the MTP layers."""
    moe = cfg.mlp_kind == "moe"
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "num_nextn_predict_layers": mtp_modules, "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "rope_interleave": True, "attention_bias": False,
        "moe_intermediate_size": cfg.moe_d_ff, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_shared_experts": cfg.n_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "moe_layer_freq": 1, "ep_size": 1,
        # a dense model: every layer, the MTP ones included, before the first MoE one
        "first_k_dense_replace": cfg.first_k_dense_replace if moe else cfg.n_layers + mtp_modules,
        "tie_word_embeddings": False,  # the head is written out (DeepSeek's engines do not tie)
    }


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
    elif fmt == "deepseek_v3":
        del out["head_dim"]  # transformers derives it (qk_rope_head_dim)
        out.update(deepseek_config(cfg, mtp_modules))
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
    """qwen2, llama or deepseek_v3 (the layout of the checkpoint); ConvertError naming anything else."""
    mt, arch = hf.get("model_type"), (hf.get("architectures") or ["?"])[0]
    if mt in ("qwen2", "llama", "deepseek_v3"):
        return mt
    why = _KNOWN.get(mt, "not a Llama, Qwen2 or DeepSeek-V3 model")
    raise ConvertError(f"unsupported architecture {arch} (model_type {mt!r}: {why}); "
                        "import takes LlamaForCausalLM, Qwen2ForCausalLM or DeepseekV3ForCausalLM checkpoints")


def _refuse(hf: dict, fmt: str) -> None:
    """ConvertError for the first feature of a Llama / Qwen2 / DeepSeek-V3 config our model cannot compute."""
    fp8.block_of(hf)  # DeepSeek-V3's fp8 block scales are read; any other quantization is refused
    if fmt == "deepseek_v3":
        return _refuse_deepseek(hf)
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


_DS_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "moe_layer_freq": 1,
               "attention_bias": False, "hidden_act": "silu"}


def _refuse_deepseek(hf: dict) -> None:
    for key, want in _DS_ROUTING.items():
        if hf.get(key, want) != want:
            raise ConvertError(f"the config has {key}={hf[key]!r}; mtpjax computes DeepSeek-V3's {key}={want!r} "
                               "only, so it cannot represent this model")


def _deepseek(hf: dict) -> list[str]:
    """DeepSeek-V3's MLA, MoE and MTP keys as overrides (the module reads the final-normed state, as its engines)."""
    L, J = int(hf["num_hidden_layers"]), int(hf.get("num_nextn_predict_layers") or 0)
    # the keys whose default differs between readers (transformers: 3 dense blocks, 8 groups, ...) are required
    first = int(hf["first_k_dense_replace"])
    out = ["model.attention_kind=mla", f"model.q_lora_rank={int(hf['q_lora_rank'] or 0)}",
           *(f"model.{k}={int(hf[k])}" for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")),
           "model.mtp_hidden=normed", f"model.mtp_depth={J}"]
    if first >= L:  # dense
        if first < L + J:
            raise ConvertError(f"the config's MTP layers are MoE (first_k_dense_replace={first}) but its trunk is "
                               "dense; mtpjax's MTP blocks are of the trunk's kind")
        return out
    return [*out, "model.mlp_kind=moe", f"model.first_k_dense_replace={first}",
            f"model.moe_d_ff={int(hf['moe_intermediate_size'])}",
            f"model.n_routed_experts={int(hf['n_routed_experts'])}",
            f"model.num_experts_per_tok={int(hf['num_experts_per_tok'])}",
            f"model.n_shared_experts={int(hf['n_shared_experts'] or 0)}",
            f"model.n_group={int(hf['n_group'])}", f"model.topk_group={int(hf['topk_group'])}",
            f"model.routed_scaling_factor={float(hf['routed_scaling_factor'])}"]


def _rope(hf: dict) -> list[str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    if kind == "default":
        return [f"model.rope_theta={float(theta)}"]
    if kind == "yarn" and hf.get("model_type") == "deepseek_v3":
        return [f"model.rope_theta={float(theta)}", "model.rope_scaling=yarn",
                f"model.rope_scaling_factor={float(merged['factor'])}",
                f"model.rope_original_max_len={int(merged['original_max_position_embeddings'])}",
                *(f"model.rope_{k}={float(merged.get(k, d))}" for k, d in (
                    ("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 1.0), ("mscale_all_dim", 0.0)))]
    if kind != "llama3":
        raise ConvertError(f"the config uses RoPE scaling {kind!r}; mtpjax implements llama3 scaling (and YaRN for "
                           "DeepSeek-V3)")
    return [f"model.rope_theta={float(theta)}", "model.rope_scaling=llama3",
            f"model.rope_scaling_factor={float(merged['factor'])}",
            f"model.rope_low_freq_factor={float(merged['low_freq_factor'])}",
            f"model.rope_high_freq_factor={float(merged['high_freq_factor'])}",
            f"model.rope_original_max_len={int(merged['original_max_position_embeddings'])}"]


def model_overrides(hf: dict) -> tuple[str, list[str]]:
    """(format, dotted model.* overrides) reproducing a Llama / Qwen2 / DeepSeek-V3 config; ConvertError if it
    cannot."""
    fmt = architecture(hf)
    _refuse(hf, fmt)
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = d // heads if fmt == "deepseek_v3" else int(hf.get("head_dim") or d // heads)
        dtype = _DTYPE.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), "float32")
        out = [f"model.vocab_size={int(hf['vocab_size'])}", f"model.d_model={d}",
               f"model.n_layers={int(hf['num_hidden_layers'])}", f"model.n_heads={heads}",
               f"model.n_kv_heads={int(hf.get('num_key_value_heads') or heads)}",
               f"model.head_dim={0 if head_dim * heads == d else head_dim}",
               f"model.d_ff={int(hf['intermediate_size'])}", f"model.norm_eps={float(hf.get('rms_norm_eps', 1e-6))}",
               f"model.tie_embeddings={str(bool(hf.get('tie_word_embeddings', False))).lower()}",
               f"model.init_std={float(hf.get('initializer_range', 0.02))}",
               f"model.param_dtype={dtype}", *_rope(hf)]
        if fmt == "deepseek_v3":
            return fmt, [*out, *_deepseek(hf)]
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"config.json lacks or mistypes a required field ({type(e).__name__}: {e})") from None
    if hf.get("num_nextn_predict_layers"):
        out.append(f"model.mtp_depth={int(hf['num_nextn_predict_layers'])}")
    return fmt, out
