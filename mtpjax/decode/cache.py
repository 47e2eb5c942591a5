"""Fixed-capacity KV caches (their rows and bytes: one rule) and per-row buffer access for the decode loop.

A row's committed length `n` is the only bookkeeping: attention at position p reads keys <= p, and a
cached call masks every entry at or past its first position, so entries past `n` (rejected drafts) are
invisible and get overwritten before any query can reach them. Rewinding is therefore just not advancing `n`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig
from mtpjax.nn.flops import cache_numbers_per_token
from mtpjax.nn.layers import KV, dtype_of
from mtpjax.nn.mla import MLACache, mla_cache

STACKED = (KV, MLACache)  # one cache whose arrays lead with a layer axis (scanned layers); else a tuple, one per layer


PROMPT_ROUND = 16  # prompts are padded to a multiple of this: nearby lengths share one compiled loop
CAPACITY_ROUND = 64


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Rows:
    """The rows of a generation's caches: the padded prompt and the capacity every cache is allocated with."""

    prompt_pad: int
    capacity: int


def rows(longest_prompt: int, max_new: int, nodes: int) -> Rows:
    """The one capacity rule: the padded prompt, the new tokens, and a round's writes past the committed length
    (the nodes verified with the last committed token, nodes + 1, and the nodes drafted beyond them; γ for a
    chain, a tree's node count for a tree), rounded up."""
    P = _round_up(longest_prompt, PROMPT_ROUND)
    return Rows(prompt_pad=P, capacity=_round_up(P + max_new + 2 * nodes + 2, CAPACITY_ROUND))


@dataclass(frozen=True)
class AttentionCaches:
    """Each trunk layer's and MTP module's attention cache (GQA keys and values, or MLA's latent and RoPE key: the
    numbers nn.flops.cache_numbers_per_token counts); an MTP model's drafting also keeps the trunk's hidden state per
    row. A cache of another shape (tree rows, a draft model's own) is another layout with its own bytes_per_row."""

    def attention_bytes_per_row(self, cfg: ModelConfig) -> int:
        return (cfg.n_layers + cfg.mtp_depth) * cache_numbers_per_token(cfg) * dtype_of(cfg.dtype).itemsize

    def bytes_per_row(self, cfg: ModelConfig) -> int:
        hidden = cfg.d_model if cfg.mtp_depth else 0
        return self.attention_bytes_per_row(cfg) + hidden * dtype_of(cfg.dtype).itemsize


def cache_bytes(cfg: ModelConfig, batch: int, capacity: int, layout: AttentionCaches = AttentionCaches()) -> int:
    """Bytes the decode caches of `batch` rows of `capacity` positions take (mtpjax.decode.host allocates them)."""
    return batch * capacity * layout.bytes_per_row(cfg)


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
    if isinstance(cache, STACKED):
        return type(cache)(*(x[i] for x in cache))
    return cache[i]


def set_layer(cache: tuple, i: int, new: KV) -> tuple:
    """The tuple of KVs with entry i replaced."""
    return cache[:i] + (new,) + cache[i + 1:]


def stacked(cache) -> KV:
    """All layers as one [L, B, K, S, H] KV (for inspection and tests)."""
    if isinstance(cache, STACKED):
        return cache
    return type(cache[0])(*(jnp.stack(xs) for xs in zip(*cache)))


def keep_path(cache, start_B, src_BY, stacked_layers: bool):
    """Every layer's entries start+src[b, d] moved to start+d (a verified tree's accepted path, made contiguous).

    The few rows are gathered before they are written, so each buffer is updated in place. The position axis is
    every cache array's second to last (KV and MLA alike).
    """
    def one(x, s, src):
        rows = jnp.take(x, s + src, axis=-2)
        return jax.lax.dynamic_update_slice_in_dim(x, rows, s, axis=-2)

    def leaf(x):
        f = jax.vmap(one)
        return jax.vmap(f, in_axes=(0, None, None))(x, start_B, src_BY) if stacked_layers else f(x, start_B, src_BY)

    return jax.tree.map(leaf, cache)


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
