"""Fixed-capacity decode state: KV caches of the trunk and every MTP module, per-row lengths, buffers.

A row's committed length `n` is the only bookkeeping: attention at position p reads keys <= p, so
entries past `n` (rejected drafts) are invisible and get overwritten before any query can reach them.
Rewinding is therefore just not advancing `n`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.config import ModelConfig
from mtpjax.layers import KV, dtype_of
from mtpjax.model import DecodeCache


def init_cache(cfg: ModelConfig, batch: int, capacity: int) -> DecodeCache:
    """Zeroed caches, one KV per layer and per MTP module (a stacked [L,...] KV for a scanned trunk).

    Separate per-layer buffers let XLA update each in place inside the decode loop; a stacked array
    would be rebuilt (copied) by every forward.
    """
    dt = dtype_of(cfg.dtype)
    shape = (batch, cfg.n_kv_heads, capacity, cfg.resolved_head_dim)

    def kv(lead=()):
        return KV(jnp.zeros(lead + shape, dt), jnp.zeros(lead + shape, dt))

    trunk = kv((cfg.n_layers,)) if cfg.scan_layers else tuple(kv() for _ in range(cfg.n_layers))
    return DecodeCache(trunk=trunk, mtp=tuple(kv() for _ in range(cfg.mtp_depth)))


def layer(cache, i: int) -> KV:
    """The cache of layer/module i (of a tuple of KVs or of a stacked KV)."""
    if isinstance(cache, KV):
        return KV(cache.k_BKSH[i], cache.v_BKSH[i])
    return cache[i]


def set_layer(cache: tuple, i: int, new: KV) -> tuple:
    """The tuple of KVs with entry i replaced."""
    return cache[:i] + (new,) + cache[i + 1:]


def stacked(cache) -> KV:
    """All layers as one [L, B, KV, S, hd] KV (for inspection and tests)."""
    if isinstance(cache, KV):
        return cache
    return KV(jnp.stack([c.k_BKSH for c in cache]), jnp.stack([c.v_BKSH for c in cache]))


def write_rows(buf_BS, upd_BT, start_B):
    """Write upd[b] into buf[b, start[b]:start[b]+T] (works for [B,S] and [B,S,d] buffers)."""
    def one(b, u, s):
        idx = (s,) + (0,) * (b.ndim - 1)
        return jax.lax.dynamic_update_slice(b, u.astype(b.dtype), idx)

    return jax.vmap(one)(buf_BS, upd_BT, start_B)


def read_rows(buf_BS, start_B, length: int):
    """buf[b, start[b]:start[b]+length] for each row."""
    def one(b, s):
        idx = (s,) + (0,) * (b.ndim - 1)
        return jax.lax.dynamic_slice(b, idx, (length,) + b.shape[1:])

    return jax.vmap(one)(buf_BS, start_B)


def take_rows(x_BT, idx_B):
    """x[b, idx[b]] for each row (x may have trailing dims)."""
    return jax.vmap(lambda r, i: r[i])(x_BT, idx_B)


@struct.dataclass
class DecodeState:
    """Everything carried through the generation loop, as one pytree."""

    cache: DecodeCache
    seq_BS: jax.Array  # committed tokens [0, n); drafts of the current round are written past n
    h0_BSD: jax.Array  # trunk raw hidden state at every committed position (input of MTP depth 1)
    n_B: jax.Array  # committed length per row
    prompt_len_B: jax.Array
    ref_BS: jax.Array  # forced decoding: the reference sequence to commit ([B, 1] and unused otherwise)
    budget_B: jax.Array  # new tokens each row may still commit in total (<= spec.max_new; traced, so no recompile)
    drafts_BG: jax.Array  # drafts proposed for the next round
    q_BGV: jax.Array  # the distributions the drafts were sampled from (stochastic MTP only)
    done_B: jax.Array
    rounds_B: jax.Array
    reached_BG: jax.Array  # rounds in which draft position i was evaluated (all before it accepted)
    accepted_BG: jax.Array  # rounds in which draft position i was accepted
    key: jax.Array
