"""Multi-head latent attention (DeepSeek-V3): low-rank query and key/value compression, a decoupled RoPE key
shared by every head, YaRN RoPE scaling, and a decode cache of the latent and the RoPE key only.

A full forward expands the latent into per-head keys and values and attends like GQA (`self_attention`, with
segment masks). A cached call never expands the cache: kv_b's key part is folded into the query and its value
part into the output (the absorbed form), so a step reads kv_lora_rank + qk_rope_head_dim numbers per cached token.
RoPE rotates halves, as everywhere in mtpjax (DeepSeek-V3's reference rotates interleaved pairs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.config import ModelConfig
from mtpjax.nn.layers import Dense, RMSNorm, apply_rope, dtype_of, llama3_rope, new_rows_seen, param, residual_std, \
    rope_frequencies, rope_tables, self_attention
from mtpjax.nn.placement import Placement


class DecodeLayout(nnx.Variable):
    """kv_b's up-projections laid out per head for the absorbed form (decode_view): derived, not trained."""


class MLACache(NamedTuple):
    """One MLA layer's cache: the normed latent and the roped RoPE key at absolute positions [0, S)."""

    c_BSZ: jax.Array
    kr_BSH: jax.Array


def mla_cache(cfg: ModelConfig, batch: int, capacity: int, lead=()) -> MLACache:
    """A zeroed MLA cache (`lead`: a stacked [L] axis for a scanned trunk)."""
    dt = dtype_of(cfg.dtype)
    return MLACache(jnp.zeros(lead + (batch, capacity, cfg.kv_lora_rank), dt),
                    jnp.zeros(lead + (batch, capacity, cfg.qk_rope_head_dim), dt))


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·m·ln(factor) + 1 (1 when the factor does not stretch)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_rope(cfg: ModelConfig) -> tuple | None:
    """(factor, original_max_len, beta_fast, beta_slow, mscale, mscale_all_dim) when rope_scaling is yarn."""
    if cfg.rope_scaling != "yarn":
        return None
    return (cfg.rope_scaling_factor, float(cfg.rope_original_max_len), cfg.rope_beta_fast, cfg.rope_beta_slow,
            cfg.rope_mscale, cfg.rope_mscale_all_dim)


def yarn_frequencies(dim: int, theta: float, yarn: tuple):
    """YaRN's H/2 frequencies: kept above beta_fast rotations per original context, divided by the factor below
    beta_slow, linearly ramped between (correction range floored/ceiled, as DeepSeek-V3 does)."""
    factor, original, beta_fast, beta_slow, _, _ = yarn
    half = dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)

    def corr(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # a one-point ramp would divide by zero
    keep = 1 - jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return freq / factor * (1 - keep) + freq * keep


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)² under YaRN (DeepSeek-V3's)."""
    scale = 1 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope_scale(cfg: ModelConfig) -> float:
    """The factor on YaRN's cos/sin (1 without YaRN)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    f = cfg.rope_scaling_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(f, cfg.rope_mscale) / yarn_mscale(f, cfg.rope_mscale_all_dim)
    return yarn_mscale(f)


def _latent_norm(d: int, cfg: ModelConfig, rngs: nnx.Rngs) -> RMSNorm:
    norm = RMSNorm(d, cfg, rngs)
    norm.scale = param(rngs, (d,), 0.0, ("latent",), dtype_of(cfg.param_dtype))  # a latent axis, not the width
    return norm


def _write(buf, upd, start_B):
    return jax.vmap(lambda b, u, s: jax.lax.dynamic_update_slice(b, u.astype(b.dtype), (s, 0)))(buf, upd,
                                                                                               start_B)


def write_after(cache: MLACache, c_BTZ, kr_BTH, start_B, o) -> MLACache:
    """Write T new entries at start_B.., ordered after `o` (layers.write_after's reason: in-place updates)."""
    dep = 0.0 * o.reshape(o.shape[0], -1)[:, :1, None].astype(c_BTZ.dtype)
    return MLACache(_write(cache.c_BSZ, c_BTZ + dep, start_B), _write(cache.kr_BSH, kr_BTH + dep, start_B))


def attend_absorbed(qn_BTNH, qr_BTNH, c_BTZ, kr_BTH, cache: MLACache, start_B, wk_NZH, wv_NHZ, sees_BTT=None):
    """Attention of T new queries over the committed cache (< start) and the T new entries (causal, or `sees_BTT`),
    in the absorbed form: scores q_nope·W_k·c + q_rope·k_rope, output (softmax·c)·W_v. Queries come pre-scaled;
    the up-projections come per head (MLAttention.up_projections), the layout the per-head products read."""
    f32 = jnp.float32
    dt = c_BTZ.dtype
    qc_BTNZ = jnp.einsum("btnh,nzh->btnz", qn_BTNH, wk_NZH.astype(dt), preferred_element_type=f32).astype(dt)

    def scores(c_BSZ, kr_BSH):
        return (jnp.einsum("btnz,bsz->bnts", qc_BTNZ, c_BSZ.astype(dt), preferred_element_type=f32)
                + jnp.einsum("btnh,bsh->bnts", qr_BTNH, kr_BSH.astype(dt), preferred_element_type=f32))

    T = c_BTZ.shape[1]
    s_old = scores(cache.c_BSZ, cache.kr_BSH)
    committed_BS = jnp.arange(s_old.shape[-1])[None, :] < start_B[:, None]
    s_old = s_old + jnp.where(committed_BS, 0.0, -1e30)[:, None, None, :]
    s_new = scores(c_BTZ, kr_BTH) + jnp.where(new_rows_seen(T, sees_BTT), 0.0, -1e30)[:, None]
    m = jax.lax.stop_gradient(jnp.maximum(s_old.max(-1, keepdims=True), s_new.max(-1, keepdims=True)))
    e_old, e_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
    oc_BNTZ = (jnp.einsum("bnts,bsz->bntz", e_old.astype(dt), cache.c_BSZ.astype(dt), preferred_element_type=f32)
               + jnp.einsum("bnts,bsz->bntz", e_new.astype(dt), c_BTZ, preferred_element_type=f32))
    oc_BNTZ = oc_BNTZ / (e_old.sum(-1) + e_new.sum(-1))[..., None]
    return jnp.einsum("bntz,nhz->btnh", oc_BNTZ.astype(dt), wv_NHZ.astype(dt), preferred_element_type=f32)


def decode_view(model: nnx.Module) -> nnx.Module:
    """A copy of `model` (the same arrays) whose MLA layers hold kv_b's up-projections laid out per head: built once
    before the decode loop, so no step re-lays them (XLA keeps a weight re-layout inside the loop, though the
    weights do not change). The model itself is left as it was."""
    view = nnx.clone(model)
    for _, m in nnx.iter_modules(view):
        if isinstance(m, MLAttention):
            m.layout = tuple(DecodeLayout(w) for w in m.per_head(m.kv_b.kernel[...]))
    return view


class MLAttention(nnx.Module):
    """DeepSeek-V3's multi-head latent attention with RoPE (optionally YaRN), segment masking and a latent cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, placement: Placement):
        d, N = cfg.d_model, cfg.n_heads
        self.n_heads, self.nope, self.rope, self.v_dim = N, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.theta, self.llama3, self.yarn = cfg.rope_theta, llama3_rope(cfg), yarn_rope(cfg)
        self.scale, self.cos_sin_scale = softmax_scale(cfg), rope_scale(cfg)
        qk = self.nope + self.rope
        self.attention = cfg.attention  # unequal q/k and v widths: the fused kernels pad v (kernels.fused_attention)
        self.placement = placement
        self.layout = nnx.data(None)  # (W_k, W_v) per head on decode_view's copy only
        if cfg.q_lora_rank:
            self.q_a = Dense(d, cfg.q_lora_rank, ("embed", "latent"), cfg, rngs)
            self.q_a_norm = _latent_norm(cfg.q_lora_rank, cfg, rngs)
            self.q_b = Dense(cfg.q_lora_rank, N * qk, ("latent", "heads"), cfg, rngs)
        else:
            self.q_proj = Dense(d, N * qk, ("embed", "heads"), cfg, rngs)
        self.kv_a = Dense(d, self.rank + self.rope, ("embed", "latent"), cfg, rngs)
        self.kv_a_norm = _latent_norm(self.rank, cfg, rngs)
        self.kv_b = Dense(self.rank, N * (self.nope + self.v_dim), ("latent", "heads"), cfg, rngs)
        self.wo = Dense(N * self.v_dim, d, ("heads", "embed"), cfg, rngs, std=residual_std(cfg))

    def project(self, x_BTD, pos_BT):
        """(q_nope, q_rope) [B,T,N,·] with the softmax scale folded in, the normed latent c [B,T,Z] and the roped
        RoPE key [B,T,H]."""
        B, T, _ = x_BTD.shape
        q = self.q_b(self.q_a_norm(self.q_a(x_BTD))) if hasattr(self, "q_a") else self.q_proj(x_BTD)
        q_BTNH = q.reshape(B, T, self.n_heads, self.nope + self.rope)
        kv = self.kv_a(x_BTD)
        c_BTZ = self.kv_a_norm(kv[..., :self.rank])
        freq = yarn_frequencies(self.rope, self.theta, self.yarn) if self.yarn else rope_frequencies(
            self.rope, self.theta, self.llama3)
        tables = rope_tables(pos_BT, self.rope, self.theta, freq=freq)
        qr_BTNH = apply_rope(q_BTNH[..., self.nope:], tables, self.cos_sin_scale * self.scale)
        kr_BTH = apply_rope(kv[..., None, self.rank:], tables, self.cos_sin_scale)[:, :, 0]
        return (q_BTNH[..., :self.nope] * self.scale).astype(q_BTNH.dtype), qr_BTNH, c_BTZ, kr_BTH

    def per_head(self, w):
        """kv_b's kernel [.., Z, N·(nope+v)] (a leading layer axis when scanned) as (W_k [.., N, Z, nope],
        W_v [.., N, v, Z])."""
        w_ZNH = w.reshape(*w.shape[:-2], self.rank, self.n_heads, self.nope + self.v_dim)
        return (jnp.swapaxes(w_ZNH[..., :self.nope], -3, -2),
                jnp.moveaxis(w_ZNH[..., self.nope:], -3, -1))

    def up_projections(self):
        """kv_b's key and value parts per head: W_k [N,Z,nope], W_v [N,v,Z]; as laid out once on a decode_view."""
        if self.layout is not None:
            return tuple(w[...] for w in self.layout)
        return self.per_head(self.kv_b.kernel[...])

    def expanded(self, qn_BTNH, qr_BTNH, c_BTZ, kr_BTH, pos_BT, seg_BT):
        """The full forward: per-head keys and values from the latent, causal attention as GQA's with K = N."""
        B, T, _ = c_BTZ.shape
        kv_BTNH = self.kv_b(c_BTZ).reshape(B, T, self.n_heads, self.nope + self.v_dim)
        k_BTNH = jnp.concatenate(
            [kv_BTNH[..., :self.nope], jnp.broadcast_to(kr_BTH[:, :, None], (B, T, self.n_heads, self.rope))], -1)
        q_BTNRH = jnp.concatenate([qn_BTNH, qr_BTNH], -1)[:, :, :, None]
        return self_attention(q_BTNRH, k_BTNH, kv_BTNH[..., self.nope:], pos_BT, seg_BT, self.attention,
                              self.placement)[:, :, :, 0]

    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache: MLACache | None = None):
        B, T, _ = x_BTD.shape
        qn, qr, c, kr = self.project(x_BTD, pos_BT)
        if cache is None:
            o, new_cache = self.expanded(qn, qr, c, kr, pos_BT, seg_BT), None
        else:
            # As GQA's cached call: entries at or past a row's start are stale and masked, this call's own come
            # from c, kr directly and are written afterwards.
            o = attend_absorbed(qn, qr, c, kr, cache, pos_BT[:, 0], *self.up_projections(), seg_BT)
            new_cache = write_after(cache, c, kr, pos_BT[:, 0], o)
        return self.wo(o.astype(x_BTD.dtype).reshape(B, T, self.n_heads * self.v_dim)), new_cache

