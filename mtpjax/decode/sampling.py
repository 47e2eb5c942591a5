"""Samplers as small frozen dataclasses; one function turns logits into the distribution sampled from.

The same `probs` serves the target (p) and every proposer's draft (q), so speculative sampling compares
like with like.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Sampler:
    """temperature 0 = greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_sampler(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> Sampler:
    """Normalize user arguments (None = off) into a Sampler; raises ValueError on impossible values or types."""
    real = lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool)  # noqa: E731
    if not real(temperature) or not (top_p is None or real(top_p)):
        raise ValueError(f"temperature={temperature!r} and top_p={top_p!r} must be numbers (top_p may be None)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0 or None")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 or None disables it)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    return Sampler(float(temperature), int(top_k or 0), float(1.0 if top_p is None else top_p))


def probs(sampler: Sampler, logits_IV):
    """float32 probabilities after temperature, top-k and top-p (greedy: one-hot of the argmax)."""
    logits = logits_IV.astype(jnp.float32)
    V = logits.shape[-1]
    if sampler.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    # Shifted so the largest is 0 and divided by at least float32's smallest normal number: a tiny temperature sends
    # the rest to -inf (its limit, greedy), never the largest to +inf (softmax then NaN, and every draw token 0).
    t = max(sampler.temperature, float(jnp.finfo(jnp.float32).tiny))
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / t
    if 0 < sampler.top_k < V:
        kth = jax.lax.top_k(logits, sampler.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampler.top_p < 1.0:
        sorted_desc = jnp.sort(logits, axis=-1)[..., ::-1]
        p_sorted = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
        cutoff = jnp.min(jnp.where(mass_before < sampler.top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.nn.softmax(logits, axis=-1)



def row_keys(key, tag: int, it, B: int):
    """Independent keys per row, per loop iteration and per use (tag)."""
    base = jax.random.fold_in(jax.random.fold_in(key, tag), it)
    return jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(B))


def draw(keys_B, p_BV):
    """One token per row from the distributions p (rows of probabilities)."""
    one = lambda k, p: jax.random.categorical(k, jnp.log(jnp.maximum(p, 1e-30)))  # noqa: E731
    return jax.vmap(one)(keys_B, p_BV).astype(jnp.int32)


def choose(sampler: Sampler, logits_BV, keys_B):
    """(token, q): q is the distribution the token was drawn from, None when greedy (the argmax; no q needed)."""
    if sampler.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    q = probs(sampler, logits_BV)
    return draw(keys_B, q), q
