"""Transformer layers: RMSNorm, RoPE, GQA attention with an optional fixed-capacity KV cache, SwiGLU MLP.

Parameters carry `logical_axes` metadata; `mtpjax.parallel.sharding` maps those names onto the mesh.

Array names carry their axes as a suffix (`x_BTD`); the letters are mtpjax/nn/shapes.py's ALPHABET.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mtpjax.nn import kernels
from mtpjax.config import ModelConfig
from mtpjax.nn.placement import Placement


def residual_std(cfg: ModelConfig) -> float:
    """Init std of a projection that writes to the residual stream: init_std / √(2L), as GPT-2 scales them."""
    return cfg.init_std / math.sqrt(2 * max(1, cfg.n_layers))


def dtype_of(name: str):
    """jnp dtype from its config name."""
    return jnp.dtype(name)


def param(rngs: nnx.Rngs, shape, std: float, axes: tuple, dtype) -> nnx.Param:
    """A normal(0, std) parameter tagged with logical axis names (std 0 means ones: norm scales)."""
    if std == 0.0:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class Dense(nnx.Module):
    """Projection, bias-free unless `bias` (zero-initialised); inputs are flattened to 2-D (XLA CPU's backward is
    slow on 3-D dots)."""

    COMPUTE_WEIGHTS = ("kernel", "bias")  # read only cast to the compute dtype: nn.model.for_decoding casts them once

    def __init__(self, d_in: int, d_out: int, axes: tuple, cfg: ModelConfig, rngs: nnx.Rngs, std=None, bias=False):
        std = cfg.init_std if std is None else std
        self.kernel = param(rngs, (d_in, d_out), std, axes, dtype_of(cfg.param_dtype))
        if bias:
            self.bias = nnx.Param(jnp.zeros((d_out,), dtype_of(cfg.param_dtype)), logical_axes=axes[1:])
        self.dtype = dtype_of(cfg.dtype)
        # nn.model.for_decoding's float32: a 1-row product summed in float32 and rounded once, as a GEMM does; left
        # to the compute dtype, XLA's GPU compiler computes it as a bf16 multiply written out, then a sum (3x the bytes)
        self.accumulate = None

    def __call__(self, x):
        """x: [..., d_in] with any leading axes."""
        lead = x.shape[:-1]
        x_ID = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y_ID = jnp.dot(x_ID, self.kernel[...].astype(self.dtype), preferred_element_type=self.accumulate)
        y_ID = y_ID.astype(self.dtype)
        if hasattr(self, "bias"):
            y_ID = y_ID + self.bias[...].astype(self.dtype)[None, :]
        return y_ID.reshape(*lead, y_ID.shape[-1])


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, cast back to the compute dtype."""

    def __init__(self, d: int, cfg: ModelConfig, rngs: nnx.Rngs):
        self.scale = param(rngs, (d,), 0.0, ("embed",), dtype_of(cfg.param_dtype))
        self.eps = cfg.norm_eps
        self.dtype = dtype_of(cfg.dtype)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)[(None,) * (y.ndim - 1)]).astype(self.dtype)


def llama3_rope(cfg: ModelConfig) -> tuple | None:
    """(factor, low_freq_factor, high_freq_factor, original_max_len) when rope_scaling is llama3, else None."""
    if cfg.rope_scaling != "llama3":
        return None
    return (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            float(cfg.rope_original_max_len))


def rope_frequencies(head_dim: int, theta: float, llama3: tuple | None = None):
    """The H/2 rotation frequencies theta^(-i/(H/2)); `llama3` = (factor, low_freq_factor, high_freq_factor,
    original_max_len) applies Llama 3's long-context rule: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if llama3 is None:
        return freq
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / freq
    smooth = (original / wavelen - low) / (high - low)
    between = (1 - smooth) * freq / factor + smooth * freq
    return jnp.where(wavelen > original / low, freq / factor, jnp.where(wavelen < original / high, freq, between))


def rope_tables(pos_BT, head_dim: int, theta: float, llama3: tuple | None = None, freq=None):
    """(cos, sin) of shape [B, T, 1, H/2], materialized once per attention call.

    The barrier stops XLA from fusing sin/cos into every consumer, where they were recomputed for
    each head and each half of the rotation (profiled: ~5% of a tiny-config train step).
    """
    freq = rope_frequencies(head_dim, theta, llama3) if freq is None else freq  # freq: another rule's (YaRN)
    ang_BTH = pos_BT.astype(jnp.float32)[..., None] * freq[None, None, :]  # H/2 frequencies
    cos, sin = jax.lax.optimization_barrier((jnp.cos(ang_BTH), jnp.sin(ang_BTH)))
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(x_BTNH, tables, scale: float = 1.0):
    """Rotary embedding on the last axis (half-split convention) from rope_tables, times `scale`."""
    cos, sin = tables
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def _attend_parts(q_BKRTH, k_BKSH, v_BKSH, bias_BTS):
    """(o, e, l) of head-major attention: R·T query rows per KV head as one axis (row r·T + t); o is normalized."""
    B, K, RT, _ = q_BKRTH.shape
    T, S = bias_BTS.shape[1:]
    s_BKRTS = jnp.einsum("bkqh,bksh->bkqs", q_BKRTH, k_BKSH, preferred_element_type=jnp.float32)
    s_BKRTS = (s_BKRTS.reshape(B, K, RT // T, T, S) + bias_BTS[:, None, None]).reshape(B, K, RT, S)
    e_BKRTS = jnp.exp(s_BKRTS - s_BKRTS.max(axis=-1, keepdims=True))
    l_BKRT = e_BKRTS.sum(axis=-1)
    o_BKRTH = jnp.einsum("bkqs,bksh->bkqh", e_BKRTS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=jnp.float32)
    return o_BKRTH / l_BKRT[..., None], e_BKRTS, l_BKRT


@jax.custom_vjp
def _attend_hm(q_BKRTH, k_BKSH, v_BKSH, bias_BTS):
    return _attend_parts(q_BKRTH, k_BKSH, v_BKSH, bias_BTS)[0]


def _attend_hm_fwd(q_BKRTH, k_BKSH, v_BKSH, bias_BTS):
    o_BKRTH, e_BKRTS, l_BKRT = _attend_parts(q_BKRTH, k_BKSH, v_BKSH, bias_BTS)
    return o_BKRTH, (q_BKRTH, k_BKSH, v_BKSH, bias_BTS, e_BKRTS, l_BKRT, o_BKRTH)


def _attend_hm_bwd(res, do_BKRTH):
    # Written out so every product reads an [R·T,S] tensor as it lies: autodiff contracted it over R·T on the
    # left, which XLA CPU served by transposing it (profiled: 18% of a tiny step). The max is a constant.
    q_BKRTH, k_BKSH, v_BKSH, bias_BTS, e_BKRTS, l_BKRT, o_BKRTH = res
    f32 = jnp.float32
    do_BKRTH = do_BKRTH.astype(f32)
    dou_BKRTH = do_BKRTH / l_BKRT[..., None]  # through o = o_unnormalized / l
    dl_BKRT = -(do_BKRTH * o_BKRTH).sum(-1) / l_BKRT
    de_BKRTS = jnp.einsum("bkqh,bksh->bkqs", dou_BKRTH, v_BKSH.astype(f32), preferred_element_type=f32)
    ds_BKRTS = (de_BKRTS + dl_BKRT[..., None]) * e_BKRTS
    dq_BKRTH = jnp.einsum("bkqs,bksh->bkqh", ds_BKRTS, k_BKSH.astype(f32), preferred_element_type=f32)
    dk_BKHS = jnp.einsum("bkqh,bkqs->bkhs", q_BKRTH.astype(f32), ds_BKRTS, preferred_element_type=f32)
    dv_BKHS = jnp.einsum("bkqh,bkqs->bkhs", dou_BKRTH, e_BKRTS, preferred_element_type=f32)
    B, K, RT, S = ds_BKRTS.shape
    T = bias_BTS.shape[1]
    dbias_BTS = ds_BKRTS.reshape(B, K, RT // T, T, S).sum((1, 2))
    return (dq_BKRTH.astype(q_BKRTH.dtype), dk_BKHS.swapaxes(-1, -2).astype(k_BKSH.dtype),
            dv_BKHS.swapaxes(-1, -2).astype(v_BKSH.dtype), dbias_BTS.astype(bias_BTS.dtype))


_attend_hm.defvjp(_attend_hm_fwd, _attend_hm_bwd)


def attend(q_BTKRH, k_BSKH, v_BSKH, bias_BTS, causal_blocks: int = 1):
    """Softmax attention with an additive mask; the softmax is normalized after the value product.

    Dividing o [B,T,N,H] instead of the scores [B,N,T,S] and adding the mask instead of selecting
    removes three passes over the score tensor forward and backward (profiled on CPU: ~10% of a step).
    Computed head-major ([B,K,R·T,H] queries: the dots' natural layout, no transposed scores) with a
    hand-written backward (_attend_hm_bwd). `causal_blocks` > 1 (T divisible by it; S = T, the mask causal
    over increasing positions): query block i reads only keys of blocks <= i, skipping the scores the mask
    would zero (exp(-1e30 - max) is exactly 0, so only the summation order changes).
    """
    B, T, K, R, H = q_BTKRH.shape
    k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    n = causal_blocks if causal_blocks > 1 and T % causal_blocks == 0 else 1
    Tb = T // n
    outs = []
    for i in range(n):
        S = T if n == 1 else (i + 1) * Tb
        q_BKRTH = q_BTKRH[:, i * Tb:(i + 1) * Tb].transpose(0, 2, 3, 1, 4).reshape(B, K, R * Tb, H)
        o_BKRTH = _attend_hm(q_BKRTH, k_BKSH[:, :, :S], v_BKSH[:, :, :S], bias_BTS[:, i * Tb:(i + 1) * Tb, :S])
        outs.append(o_BKRTH.reshape(B, K, R, Tb, v_BKSH.shape[-1]))  # values may be narrower (MLA's v_head_dim)
    o_BKRTH = outs[0] if n == 1 else jnp.concatenate(outs, axis=3)
    return o_BKRTH.transpose(0, 3, 1, 2, 4)


def self_attention(q_BTKRH, k_BTKH, v_BTKH, pos_BT, seg_BT, name: str, placement: Placement):
    """Causal attention of T positions over themselves (segment-restricted), computed by `model.attention`.

    The one place the backend is chosen, by the platform the model is placed on (not this host's backend: a
    program compiled here for a TPU mesh gets the TPU's kernel), and the fused kernels run per device over the
    placement's mesh. They take positions to be 0..T-1, as every caller without a cache has them; `attend` (xla) is
    the reference they are tested against.
    """
    backend, interpret = kernels.attention_backend(name, placement.platform, jnp.dtype(q_BTKRH.dtype).name,
                                                   q_BTKRH.shape[-1], os.environ.get(kernels.INTERPRET_ENV) == "1")
    if backend != "xla":
        return kernels.fused_attention(backend, interpret, q_BTKRH, k_BTKH, v_BTKH, seg_BT, placement)
    mask_BTS = pos_BT[:, None, :] <= pos_BT[:, :, None]
    if seg_BT is not None:
        mask_BTS &= seg_BT[:, None, :] == seg_BT[:, :, None]
    # Two causal blocks: a quarter of the scores skipped; measured 0.61x of one block's time, 4 blocks 0.73x (CPU).
    return attend(q_BTKRH, k_BTKH, v_BTKH, jnp.where(mask_BTS, 0.0, -1e30).astype(jnp.float32), causal_blocks=2)


class KV(NamedTuple):
    """One attention layer's cache, head-major: keys/values at absolute positions [0, S) of each KV head.

    Head-major is the layout the attention dots read without a transpose; [B,S,K,H] cost two whole-cache
    copies per layer per decode step.
    """

    k_BKSH: jax.Array
    v_BKSH: jax.Array


def write_kv(cache: KV, k_BTKH, v_BTKH, start_B) -> KV:
    """Write T new entries at per-row positions start_B .. start_B+T-1 (capacity must allow it)."""
    upd = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u.transpose(1, 0, 2).astype(c.dtype), (0, s, 0)))
    return KV(upd(cache.k_BKSH, k_BTKH, start_B), upd(cache.v_BKSH, v_BTKH, start_B))


def write_after(cache: KV, k_BTKH, v_BTKH, start_B, o) -> KV:
    """write_kv, ordered after `o` and so after every read of the old cache that produced it.

    Without a data dependency XLA cannot tell the reads come first and copies every cache buffer each
    step; 0 * a finite value is exactly 0, so what is written does not change.
    """
    dep = 0.0 * o.reshape(o.shape[0], -1)[:, :1, None, None].astype(k_BTKH.dtype)
    return write_kv(cache, k_BTKH + dep, v_BTKH + dep, start_B)


def attend_cached(q_BTKRH, k_BTKH, v_BTKH, cache: KV, start_B, sees_BTT=None):
    """Attention of T new queries over the committed cache entries (< start) and the T new keys (causal, or which
    of them each query sees when `sees_BTT` is given: a draft tree's ancestors).

    Reading the cache before this call's keys are written leaves the write without a reader in the step,
    so (with write_after) XLA updates the buffers in place.
    """
    B, T, K, R, H = q_BTKRH.shape
    q_BKRTH = q_BTKRH.transpose(0, 2, 3, 1, 4).reshape(B, K, R * T, H)  # RT (q in the einsums): one axis, row r*T + t
    s_BKRTS = jnp.einsum("bkqh,bksh->bkqs", q_BKRTH, cache.k_BKSH.astype(q_BKRTH.dtype),
                         preferred_element_type=jnp.float32)
    committed_BS = jnp.arange(s_BKRTS.shape[-1])[None, :] < start_B[:, None]
    s_BKRTS = s_BKRTS + jnp.where(committed_BS, 0.0, -1e30)[:, None, None, :]
    s_BKRTT = jnp.einsum("bkqh,btkh->bkqt", q_BKRTH, k_BTKH, preferred_element_type=jnp.float32)
    sees_BTT = new_rows_seen(T, sees_BTT)
    s_BKRTT = s_BKRTT + jnp.tile(jnp.where(sees_BTT, 0.0, -1e30), (1, R, 1))[:, None]
    m = jax.lax.stop_gradient(jnp.maximum(s_BKRTS.max(-1, keepdims=True), s_BKRTT.max(-1, keepdims=True)))
    e_old, e_new = jnp.exp(s_BKRTS - m), jnp.exp(s_BKRTT - m)
    dt = v_BTKH.dtype
    f32 = jnp.float32
    o_BKRTH = (jnp.einsum("bkqs,bksh->bkqh", e_old.astype(dt), cache.v_BKSH.astype(dt), preferred_element_type=f32)
               + jnp.einsum("bkqt,btkh->bkqh", e_new.astype(dt), v_BTKH, preferred_element_type=f32))
    o_BKRTH = o_BKRTH / (e_old.sum(-1) + e_new.sum(-1))[..., None]
    return o_BKRTH.reshape(B, K, R, T, H).transpose(0, 3, 1, 2, 4)


def new_rows_seen(T: int, sees_BTT=None):
    """[B|1, T, T]: which of a cached call's own rows each row sees (default causal)."""
    if sees_BTT is None:
        return (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None]
    return sees_BTT if sees_BTT.ndim == 3 else sees_BTT[None]


class Attention(nnx.Module):
    """Grouped-query causal attention with RoPE, segment masking and an optional KV cache."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, placement: Placement):
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        self.n_heads, self.n_kv, self.head_dim, self.theta = h, kv, hd, cfg.rope_theta
        self.llama3 = llama3_rope(cfg)
        self.attention, self.placement = cfg.attention, placement  # how, not what: no parameter depends on them
        out_std = residual_std(cfg)
        self.wq = Dense(d, h * hd, ("embed", "heads"), cfg, rngs, bias=cfg.qkv_bias)
        self.wk = Dense(d, kv * hd, ("embed", "kv_heads"), cfg, rngs, bias=cfg.qkv_bias)
        self.wv = Dense(d, kv * hd, ("embed", "kv_heads"), cfg, rngs, bias=cfg.qkv_bias)
        self.wo = Dense(h * hd, d, ("heads", "embed"), cfg, rngs, std=out_std)

    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache: KV | None = None):
        B, T, _ = x_BTD.shape
        tables = rope_tables(pos_BT, self.head_dim, self.theta, self.llama3)
        # The 1/sqrt(H) score scale rides on q's rotation: [B,T,N,H] multiplies instead of [B,N,T,S].
        q = apply_rope(self.wq(x_BTD).reshape(B, T, self.n_heads, self.head_dim), tables, 1 / math.sqrt(self.head_dim))
        k = apply_rope(self.wk(x_BTD).reshape(B, T, self.n_kv, self.head_dim), tables)
        v = self.wv(x_BTD).reshape(B, T, self.n_kv, self.head_dim)
        R = self.n_heads // self.n_kv
        on = self.placement.constrain
        q = on(q.reshape(B, T, self.n_kv, R, self.head_dim), "batch", "length", "kv_heads", None, None)
        k, v = (on(x, "batch", "length", "kv_heads", None) for x in (k, v))
        if cache is None:
            o, new_cache = self_attention(q, k, v, pos_BT, seg_BT, self.attention, self.placement), None
        else:
            # Entries at or past a row's start are stale (rejected drafts) and masked; this call's own
            # keys come from k, v directly and are written afterwards. A cached call has no segments: seg_BT, when
            # given, is the [B,T,T] mask of which of its rows each row sees (a draft tree).
            o = attend_cached(q, k, v, cache, pos_BT[:, 0], seg_BT)
            new_cache = write_after(cache, k, v, pos_BT[:, 0], o)
        o = on(o.astype(x_BTD.dtype), "batch", "length", "kv_heads", None, None)
        return self.wo(o.reshape(B, T, self.n_heads * self.head_dim)), new_cache


class MLP(nnx.Module):
    """SwiGLU feed-forward; its hidden activation [rows..., F] split over the placement's rows and MLP columns."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None, placement: Placement | None = None):
        d, f = cfg.d_model, cfg.resolved_d_ff if d_ff is None else d_ff
        self.gate = Dense(d, f, ("embed", "mlp"), cfg, rngs)
        self.up = Dense(d, f, ("embed", "mlp"), cfg, rngs)
        self.down = Dense(f, d, ("mlp", "embed"), cfg, rngs, std=residual_std(cfg))
        self.placement = placement or Placement()  # how, not what: no parameter depends on it

    def __call__(self, x):
        """x: [rows, ..., D], its leading axis the batch's rows (or tokens in row order)."""
        axes = ("batch", *(None,) * (x.ndim - 2))
        h = self.placement.constrain(jax.nn.silu(self.gate(x)) * self.up(x), *axes, "mlp")
        return self.down(h)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP a SwiGLU or (`moe`) a mixture
    of experts, whose routing info (expert loads, balance statistic) is returned beside the hidden state."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, placement: Placement, attn: nnx.Module | None = None,
                 mlp: nnx.Module | None = None):
        """`attn`, `mlp`: the attention and feed-forward model.make_block chose (latent attention, a mixture of
        experts); None builds GQA attention and the SwiGLU."""
        self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs)
        self.attn = Attention(cfg, rngs, placement) if attn is None else attn
        self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs)
        self.mlp = MLP(cfg, rngs, placement=placement) if mlp is None else mlp
        self.placement = placement

    def __call__(self, x_BTD, pos_BT, seg_BT=None, cache: KV | None = None):
        """(x, updated cache, routing info: {} for a dense MLP); every [B,T,D] it passes on split by batch rows."""
        on = lambda x: self.placement.constrain(x, "batch", "length", "embed")
        x_BTD = on(x_BTD)
        with jax.named_scope("attention"):  # compiled ops (and their collectives) name the layer they come from
            a, new_cache = self.attn(on(self.attn_norm(x_BTD)), pos_BT, seg_BT, cache)
        x_BTD = on(x_BTD + on(a))
        h_BTD = on(self.mlp_norm(x_BTD))
        # A cached call's seg_BT may be a draft tree's [B,T,T] mask (see Attention), not segment ids; the MoE reads
        # them only to leave padding out of its expert loads, which move balance biases in training alone.
        seg_BT = seg_BT if cache is None else None
        with jax.named_scope("mlp"):
            y, aux = (self.mlp(h_BTD), {}) if isinstance(self.mlp, MLP) else self.mlp(h_BTD, seg_BT)
        return on(x_BTD + on(y)), new_cache, aux
