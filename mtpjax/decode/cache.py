"""Fixed-capacity KV caches and per-row buffer access for the decode loop.

A row's committed length `n` is the only bookkeeping: attention at position p reads keys <= p, and a
cached call masks every entry at or past its first position, so entries past `n` (rejected drafts) are
invisible and get overwritten before any query can reach them. Rewinding is therefore just not advancing `n`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig
from mtpjax.nn.layers import KV, dtype_of
from mtpjax.nn.mla import mla_cache


def _kv(cfg: ModelConfig, batch: int, capacity: int, lead=()) -> KV:
    if cfg.attention_kind == "mla":
        return mla_cache(cfg, batch, capacity, lead)
    shape = lead + (batch, cfg.n_kv_heads, capacity, cfg.resolved_head_dim)
    dt = dtype_of(cfg.dtype)
    return KV(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def trunk_cache(cfg: ModelConfig, batch: int, capacity: int):
    """Zeroed trunk cache: one KV per layer (a stacked [L,...] KV for a scanned trunk).

    Separate per-layer buffers let XLA update each in place inside the decode loop; a stacked array
    would be rebuilt (copied) by every forward.
    """
    if cfg.scan_layers:
        return _kv(cfg, batch, capacity, (cfg.n_layers,))
    return tuple(_kv(cfg, batch, capacity) for _ in range(cfg.n_layers))


def module_caches(cfg: ModelConfig, batch: int, capacity: int) -> tuple:
    """Zeroed caches of the MTP modules, one KV each."""
    return tuple(_kv(cfg, batch, capacity) for _ in range(cfg.mtp_depth))


def layer(cache, i: int) -> KV:
    """The cache of layer/module i (of a tuple of KVs or of a stacked KV)."""
    if hasattr(cache, "_fields"):  # a stacked KV or MLACache
        return type(cache)(*(x[i] for x in cache))
    return cache[i]


def set_layer(cache: tuple, i: int, new: KV) -> tuple:
    """The tuple of KVs with entry i replaced."""
    return cache[:i] + (new,) + cache[i + 1:]


def stacked(cache) -> KV:
    """All layers as one [L, B, K, S, H] KV (for inspection and tests)."""
    if hasattr(cache, "_fields"):
        return cache
    return type(cache[0])(*(jnp.stack(xs) for xs in zip(*cache)))


def write_rows(buf_BS, upd_BT, start_B):
    """Write upd[b] into buf[b, start[b]:start[b]+T] (works for [B,S] and [B,S,D] buffers)."""
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
