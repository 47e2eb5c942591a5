"""DeepSeek-V3's block in float64 numpy, written once for the tests: RMSNorm, RoPE (plain or YaRN), multi-head
latent attention, the mixture of experts and the pre-norm block of both. Independent of mtpjax (only its config's
fields are read); each function's flags break one rule each, for the companions that show a rule matters."""

import math

import numpy as np

from mtpjax.config import ModelConfig


def rms_norm(x, scale, eps):
    """RMSNorm over the last axis."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def swiglu(x, g, u, d):
    """SwiGLU with kernels g, u [D, F] and d [F, D]."""
    a = x @ g
    return (a / (1 + np.exp(-a)) * (x @ u)) @ d


def reference_rope(x, pos, dim, cfg, scale):
    """Half-split rotation with plain or YaRN frequencies (DeepSeek-V3's formulas, re-derived here)."""
    half = dim // 2
    freq = cfg.rope_theta ** (-np.arange(half) / half)
    if cfg.rope_scaling == "yarn":
        f, orig = cfg.rope_scaling_factor, cfg.rope_original_max_len
        corr = [dim * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
                for r in (cfg.rope_beta_fast, cfg.rope_beta_slow)]
        lo, hi = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), dim - 1)
        ramp = np.clip((np.arange(half) - lo) / (hi - lo + (0.001 if lo == hi else 0)), 0, 1)
        freq = freq / f * ramp + freq * (1 - ramp)

        def ms(m):
            return 0.1 * m * math.log(f) + 1

        scale = scale * (ms(cfg.rope_mscale) / ms(cfg.rope_mscale_all_dim) if cfg.rope_mscale_all_dim else ms(1))
    ang = pos[:, None] * freq[None]
    cos, sin = np.cos(ang) * scale, np.sin(ang) * scale
    cos, sin = cos.reshape(cos.shape[0], *([1] * (x.ndim - 2)), half), sin.reshape(sin.shape[0], *([1] * (x.ndim - 2)),
                                                                                   half)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_mla(p, x, cfg, wrong_scale=False, no_norm=False, rope_on_nope=False):
    """One MLA layer over one sequence x [T, D] in float64, causal."""
    def norm(v, w):
        return v if no_norm else rms_norm(v, w, cfg.norm_eps)

    T, N = x.shape[0], cfg.n_heads
    dn, dr, dv, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    pos = np.arange(T, dtype=np.float64)
    q = (norm(x @ p["q_a"]["kernel"], p["q_a_norm"]["scale"]) @ p["q_b"]["kernel"]).reshape(T, N, dn + dr)
    kva = x @ p["kv_a"]["kernel"]
    c = norm(kva[:, :C], p["kv_a_norm"]["scale"])
    kv = (c @ p["kv_b"]["kernel"]).reshape(T, N, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q_nope, q_pe = q[..., :dn], reference_rope(q[..., dn:], pos, dr, cfg, 1.0)
    k_pe = reference_rope(kva[:, C:], pos, dr, cfg, 1.0)
    if rope_on_nope:
        q_nope, k_nope = reference_rope(q_nope, pos, dn, cfg, 1.0), reference_rope(k_nope, pos, dn, cfg, 1.0)
    qf = np.concatenate([q_nope, q_pe], -1)
    kf = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (T, N, dr))], -1)
    scale = 1 / math.sqrt(dn + dr)
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim and not wrong_scale:
        scale *= (0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_scaling_factor) + 1) ** 2
    s = np.einsum("tnh,snh->nts", qf, kf) * scale + np.where(np.tril(np.ones((T, T))) > 0, 0, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("nts,snh->tnh", w / w.sum(-1, keepdims=True), v).reshape(T, N * dv)
    return o @ p["wo"]["kernel"]


def reference_moe(x_ND, p, m: ModelConfig, *, normalize=True, bias_in_weights=False, group_limit=True,
                  bias_in_choice=True):
    """DeepSeek-V3's MoE MLP in float64, token by token: (output, chosen experts [N, k])."""
    E, G, k = m.n_routed_experts, m.n_group, m.num_experts_per_tok
    s_NE = 1 / (1 + np.exp(-(x_ND @ p["router"])))
    b_NE = s_NE + p["bias"][None] if bias_in_choice else s_NE
    y, chosen = np.zeros_like(x_ND), []
    for n in range(len(x_ND)):
        allowed = np.ones(E, bool)
        if group_limit and G > 1:
            group_score = np.sort(b_NE[n].reshape(G, E // G), axis=1)[:, -2:].sum(1)
            allowed = np.repeat(np.isin(np.arange(G), np.argsort(-group_score)[:m.topk_group]), E // G)
        top = np.argsort(-np.where(allowed, b_NE[n], -np.inf))[:k]
        w = (b_NE if bias_in_weights else s_NE)[n, top]
        w = (w / w.sum() if normalize else w) * m.routed_scaling_factor
        for e, we in zip(top, w):
            y[n] += we * swiglu(x_ND[n], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
        chosen.append(top)
    y += swiglu(x_ND, p["shared"]["gate"]["kernel"], p["shared"]["up"]["kernel"], p["shared"]["down"]["kernel"])
    return y, np.asarray(chosen)


def reference_block(p, x_TD, m: ModelConfig, **moe_flags):
    """A pre-norm MLA + MoE block over one sequence: x + mla(norm(x)), then + moe(norm(.)); (output, chosen)."""
    h_TD = x_TD + reference_mla(p["attn"], rms_norm(x_TD, p["attn_norm"]["scale"], m.norm_eps), m)
    y_TD, chosen = reference_moe(rms_norm(h_TD, p["mlp_norm"]["scale"], m.norm_eps), p["mlp"], m, **moe_flags)
    return h_TD + y_TD, chosen
