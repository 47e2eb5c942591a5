"""Speculative decoding with the MTP modules (or n-gram lookup) as proposer, in one jitted while_loop.

One round: verify [last committed token, drafts] with one cached trunk forward, accept a prefix (greedy
match or rejection sampling), commit it plus one target token, then propose the next drafts. Module k
recomputes a window of W = num_draft + min(num_draft, D) positions ending at n-2 each round, which
covers every entry that was built from a draft that has since been rejected; so at every loop
boundary each module cache equals a fresh prefill of the committed sequence wherever its inputs
are committed (DESIGN §6). Plain decoding is the same loop with num_draft = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax import autodraft
from mtpjax.cache import DecodeState, init_cache, layer, read_rows, set_layer, take_rows, write_rows
from mtpjax.model import DecodeCache, MTPTransformer
from mtpjax.sampling import Sampler, make_sampler, probs


class DecodeError(ValueError):
    """Bad generation request (one line naming the problem and the fix)."""


@dataclass(frozen=True)
class DecodeSpec:
    """Static description of one compiled generation (shapes and choices)."""

    num_draft: int
    proposer: str  # mtp | ngram
    sampler: Sampler
    max_new: int
    capacity: int
    prompt_pad: int
    eos_id: int  # -1: none
    ngram_max: int = 3

    depth: int = 0  # the model's mtp_depth
    window_size: int = -1  # -1: the smallest window that keeps the module caches exact (tests shrink it)
    on_commit: object = None  # host callback(tokens_BY, count_B) after each round, for streaming
    forced: bool = False  # commit one reference token per round instead of the accepted ones (teacher forcing)

    @property
    def window(self) -> int:
        if self.window_size > 0:
            return self.window_size
        return max(1, self.num_draft + min(self.num_draft, self.depth)) if self.proposer == "mtp" else 0


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- randomness


def _row_keys(key, tag: int, it, B: int):
    """Independent keys per row, per loop iteration and per use (tag)."""
    base = jax.random.fold_in(jax.random.fold_in(key, tag), it)
    return jax.vmap(lambda b: jax.random.fold_in(base, b))(jnp.arange(B))


def _choose(logits_BV, sampler: Sampler, keys_B):
    """(token, q) where q is the distribution the token was drawn from (greedy: argmax, q unused)."""
    if sampler.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), jnp.zeros(logits_BV.shape[:1] + (1,), jnp.float32)
    q = probs(sampler, logits_BV)
    tok = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(jnp.maximum(p, 1e-30))))(keys_B, q)
    return tok.astype(jnp.int32), q


# ----------------------------------------------------------------------------- proposers


def _draft_mtp(model: MTPTransformer, st: DecodeState, spec: DecodeSpec, start_B, W: int, it):
    """Module k drafts token k from a recomputed window [start, start+W) ending at n-2; last module reused."""
    D, G, B = model.cfg.mtp_depth, spec.num_draft, st.n_B.shape[0]
    sequential = model.cfg.mtp_kind == "sequential"
    pos_BW = start_B[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]
    out_idx = st.n_B - 2 - start_B
    h0_BWD = read_rows(st.h0_BSD, start_B, W)
    h_prev, seq, mtp = h0_BWD, st.seq_BS, st.cache.mtp
    drafts, qs, h_at = [], [], None
    for k in range(1, G + 1):
        with jax.named_scope(f"draft{k}"):  # profiles attribute time per depth
            if k <= D:
                toks = read_rows(seq, start_B + k, W)
                h, kv = model.mtp_forward(k, h_prev if sequential else h0_BWD, toks, pos_BW, cache=layer(mtp, k - 1))
                mtp, h_prev, h_at, m = set_layer(mtp, k - 1, kv), h, take_rows(h, out_idx), k
            else:  # beyond D: the last module continues autoregressively from its own output
                pos = (st.n_B - 2 + (k - D))[:, None]
                h, kv = model.mtp_forward(D, h_at[:, None], drafts[-1][:, None], pos, cache=layer(mtp, D - 1))
                mtp, h_at, m = set_layer(mtp, D - 1, kv), h[:, 0], D
            d, q = _choose(model.logits(model.head_norm(m, h_at)), spec.sampler, _row_keys(st.key, 10 + k, it, B))
            seq = write_rows(seq, d[:, None], st.n_B + k - 1)
            drafts.append(d)
            qs.append(q)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), mtp


def _draft_ngram(seq_BS, n_B, G: int, max_n: int):
    """Prompt lookup: continue the latest earlier occurrence of the longest matching suffix (<= max_n)."""
    S = seq_BS.shape[1]
    pos = jnp.arange(S)
    best = jnp.full(n_B.shape, -1, jnp.int32)
    for m in range(max_n, 0, -1):
        eq = (pos[None, :] < n_B[:, None] - 1) & (pos[None, :] >= m - 1)
        for t in range(m):
            tail = take_rows(seq_BS, jnp.maximum(n_B - 1 - t, 0))
            eq &= jnp.roll(seq_BS, t, axis=1) == tail[:, None]
        eq &= (n_B >= m + 1)[:, None]
        j = jnp.max(jnp.where(eq, pos[None, :], -1), axis=1).astype(jnp.int32)
        best = jnp.where(best < 0, j, best)
    idx = jnp.minimum(best[:, None] + 1 + jnp.arange(G)[None, :], n_B[:, None] - 1)
    last = take_rows(seq_BS, n_B - 1)[:, None]
    drafts = jnp.where(best[:, None] >= 0, jnp.take_along_axis(seq_BS, idx, axis=1), last)
    return drafts.astype(jnp.int32)


def _propose(model, st: DecodeState, spec: DecodeSpec, start_B, W: int, it):
    B, G = st.n_B.shape[0], spec.num_draft
    if G == 0:
        return st.replace(drafts_BG=jnp.zeros((B, 0), jnp.int32))
    if spec.proposer == "ngram":
        drafts = _draft_ngram(st.seq_BS, st.n_B, G, spec.ngram_max)
        q = jnp.zeros((B, G, 1), jnp.float32)
        if not spec.sampler.greedy:  # a deterministic draft: q is one-hot
            q = jax.nn.one_hot(drafts, model.cfg.vocab_size, dtype=jnp.float32)
        return st.replace(drafts_BG=drafts, q_BGV=q, seq_BS=write_rows(st.seq_BS, drafts, st.n_B))
    drafts, q, mtp = _draft_mtp(model, st, spec, start_B, W, it)
    seq = write_rows(st.seq_BS, drafts, st.n_B)
    return st.replace(drafts_BG=drafts, q_BGV=q, seq_BS=seq, cache=st.cache._replace(mtp=mtp))


# ----------------------------------------------------------------------------- verification


def _accept(logits_BYV, st: DecodeState, spec: DecodeSpec, it):
    """(number of accepted drafts a, the γ+1 tokens to commit: accepted drafts then one target token)."""
    B, Y, V = logits_BYV.shape
    G, d = Y - 1, st.drafts_BG
    if spec.sampler.greedy:
        g = jnp.argmax(logits_BYV, axis=-1).astype(jnp.int32)
        a = jnp.cumprod(d == g[:, :G], axis=1).sum(axis=1).astype(jnp.int32)
        bonus = take_rows(g, a)
    else:
        p = probs(spec.sampler, logits_BYV.reshape(B * Y, V)).reshape(B, Y, V)
        p_d = jnp.take_along_axis(p[:, :G], d[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(st.q_BGV, d[..., None], axis=-1)[..., 0]
        u = jax.vmap(lambda k: jax.random.uniform(k, (G,)))(_row_keys(st.key, 1, it, B))
        a = jnp.cumprod(u * q_d < p_d, axis=1).sum(axis=1).astype(jnp.int32)
        p_a = take_rows(p, a)
        q_a = take_rows(jnp.concatenate([st.q_BGV, jnp.zeros((B, 1, V))], 1), a)  # q = 0 past the drafts
        resid = jnp.maximum(p_a - q_a, 0.0)
        mass = resid.sum(-1, keepdims=True)
        resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_a)
        keys = _row_keys(st.key, 2, it, B)
        bonus = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(jnp.maximum(r, 1e-30))))(keys, resid)
    i = jnp.arange(Y)[None, :]
    toks = jnp.where(i < a[:, None], jnp.pad(d, ((0, 0), (0, 1))), bonus[:, None].astype(jnp.int32))
    return a, toks


def _commit(st: DecodeState, a_B, toks_BY, spec: DecodeSpec):
    """Advance each active row by its accepted prefix + 1, cut at EOS and at the length budget."""
    Y = toks_BY.shape[1]
    i = jnp.arange(Y)[None, :]
    c = jnp.minimum(a_B + 1, st.budget_B - (st.n_B - st.prompt_len_B))
    if spec.forced:  # measure the drafts against the target, but walk the reference text one token a round
        toks_BY = read_rows(st.ref_BS, st.n_B, Y)
        c = jnp.minimum(c, 1)
    if spec.eos_id >= 0:
        is_eos = (toks_BY == spec.eos_id) & (i < c[:, None])
        first = jnp.argmax(is_eos, axis=1)
        hit = is_eos.any(axis=1)
        c = jnp.where(hit, first + 1, c)
    else:
        hit = jnp.zeros_like(st.done_B)
    active = ~st.done_B
    c = jnp.where(active, c, 0)
    seq = write_rows(st.seq_BS, toks_BY, st.n_B)  # past n for inactive rows: scratch
    if spec.on_commit is not None:
        jax.debug.callback(spec.on_commit, toks_BY, c, ordered=True)
    n = st.n_B + c
    done = st.done_B | hit | (n - st.prompt_len_B >= st.budget_B)
    G = Y - 1
    gi = jnp.arange(G)[None, :]
    reached = st.reached_BG + (active[:, None] & (gi <= a_B[:, None])).astype(jnp.int32)
    accepted = st.accepted_BG + (active[:, None] & (gi < a_B[:, None])).astype(jnp.int32)
    return st.replace(seq_BS=seq, n_B=n, done_B=done, rounds_B=st.rounds_B + active.astype(jnp.int32),
                      reached_BG=reached, accepted_BG=accepted)


def _round(model: MTPTransformer, st: DecodeState, spec: DecodeSpec, it):
    """One verify → accept → commit → propose round."""
    last = take_rows(st.seq_BS, st.n_B - 1)[:, None]
    vt = jnp.concatenate([last, st.drafts_BG], axis=1)
    pos = (st.n_B - 1)[:, None] + jnp.arange(vt.shape[1], dtype=jnp.int32)[None, :]
    with jax.named_scope("verify"):
        h, trunk = model.trunk(vt, pos, cache=st.cache.trunk)
    h0 = write_rows(st.h0_BSD, h, st.n_B - 1) if spec.proposer == "mtp" and spec.num_draft else st.h0_BSD
    st = st.replace(cache=st.cache._replace(trunk=trunk), h0_BSD=h0)
    with jax.named_scope("accept"):
        a, toks = _accept(model.logits(model.final_norm(h)), st, spec, it)
    with jax.named_scope("commit"):
        st = _commit(st, a, toks, spec)
    W = spec.window
    start = jnp.maximum(st.n_B - 1 - W, 0)
    return _propose(model, st, spec, start, W, it)


def _prefill(model: MTPTransformer, tokens_BP, plen_B, budget_B, ref_BS, key, spec: DecodeSpec) -> DecodeState:
    """Trunk over the prompts, first token from the last prompt position, module caches over the prompt."""
    cfg, (B, P) = model.cfg, tokens_BP.shape
    S, G = spec.capacity, spec.num_draft
    cache = init_cache(cfg, B, S)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    h, trunk = model.trunk(tokens_BP, pos, cache=cache.trunk)
    use_h0 = spec.proposer == "mtp" and G > 0
    h0 = jnp.zeros((B, S if use_h0 else 1, cfg.d_model), h.dtype)
    h0 = h0.at[:, :P].set(h) if use_h0 else h0
    first, _ = _choose(model.logits(model.final_norm(take_rows(h, plen_B - 1))), spec.sampler, _row_keys(key, 0, 0, B))
    if spec.forced:
        first = take_rows(ref_BS, plen_B)
    seq = jnp.zeros((B, S), jnp.int32).at[:, :P].set(tokens_BP)
    seq = write_rows(seq, first[:, None], plen_B)
    done = (first == spec.eos_id) | (budget_B <= 1)
    if spec.on_commit is not None:
        jax.debug.callback(spec.on_commit, first[:, None], jnp.ones_like(first), ordered=True)
    V = cfg.vocab_size if (not spec.sampler.greedy) else 1
    st = DecodeState(
        cache=DecodeCache(trunk=trunk, mtp=cache.mtp), seq_BS=seq, h0_BSD=h0, n_B=plen_B + 1,
        prompt_len_B=plen_B, budget_B=budget_B, ref_BS=ref_BS, drafts_BG=jnp.zeros((B, G), jnp.int32),
        q_BGV=jnp.zeros((B, G, V), jnp.float32),
        done_B=done, rounds_B=jnp.zeros((B,), jnp.int32), reached_BG=jnp.zeros((B, G), jnp.int32),
        accepted_BG=jnp.zeros((B, G), jnp.int32), key=key)
    return _propose(model, st, spec, jnp.zeros((B,), jnp.int32), P, 0)


def _generate(gdef, params, tokens_BP, plen_B, budget_B, ref_BS, key, spec: DecodeSpec) -> DecodeState:
    model = nnx.merge(gdef, params)
    st = _prefill(model, tokens_BP, plen_B, budget_B, ref_BS, key, spec)

    def body(carry):
        it, st = carry
        return it + 1, _round(model, st, spec, it + 1)

    _, st = jax.lax.while_loop(lambda c: jnp.any(~c[1].done_B), body, (jnp.int32(0), st))
    return st


_generate_jit = jax.jit(_generate, static_argnames=("gdef", "spec"))


# ----------------------------------------------------------------------------- public API


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_spec(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int, proposer: str,
              sampler: Sampler, eos_id, max_len, on_commit=None) -> DecodeSpec:
    """Validate a request and fix the static shapes of its compiled loop."""
    cfg = model.cfg
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodeError("empty prompt: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if num_draft < 0:
        raise DecodeError(f"num_draft={num_draft} must be >= 0 (0 = plain decoding)")
    if proposer not in ("mtp", "ngram"):
        raise DecodeError(f"proposer={proposer!r} is unknown; use 'mtp' or 'ngram'")
    if proposer == "mtp" and num_draft > 0 and cfg.mtp_depth == 0:
        raise DecodeError("this model has no MTP modules (mtp_depth 0); use --proposer ngram or --num-draft 0")
    if proposer == "mtp" and cfg.mtp_kind == "parallel" and num_draft > cfg.mtp_depth:
        raise DecodeError(f"num_draft={num_draft} exceeds the {cfg.mtp_depth} parallel MTP heads; lower --num-draft")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise DecodeError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    longest = max(len(p) for p in prompts)
    if max_len is not None and longest + max_new_tokens > max_len:
        raise DecodeError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the cache "
                          f"capacity max_len={max_len}; shorten the prompt or raise decode.max_len")
    P = _round_up(longest, 16)
    W = num_draft + min(num_draft, cfg.mtp_depth)
    capacity = _round_up(P + max_new_tokens + num_draft + W + cfg.mtp_depth + 2, 64)
    return DecodeSpec(num_draft=num_draft, proposer=proposer, sampler=sampler, max_new=max_new_tokens,
                      capacity=capacity, prompt_pad=P, eos_id=-1 if eos_id is None else int(eos_id),
                      depth=cfg.mtp_depth, on_commit=on_commit)


def run(model: MTPTransformer, prompts, spec: DecodeSpec, seed: int = 0, budget: int | None = None,
        reference=None) -> DecodeState:
    """Compile (once per spec) and run the whole generation; returns the final DecodeState.

    `budget` (<= spec.max_new, default spec.max_new) caps the new tokens per row without recompiling.
    `reference` (spec.forced only): per row, the tokens to commit after the prompt, one per round.
    """
    B = len(prompts)
    toks = np.zeros((B, spec.prompt_pad), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    budget_B = np.full((B,), spec.max_new if budget is None else min(max(1, budget), spec.max_new), np.int32)
    ref = np.zeros((B, spec.capacity if spec.forced else 1), np.int32)
    if spec.forced:
        if reference is None or len(reference) != B:
            raise DecodeError("forced decoding needs one reference continuation per prompt")
        for i, (p, r) in enumerate(zip(prompts, reference)):
            if len(r) < budget_B[i]:
                raise DecodeError(f"reference {i} has {len(r)} tokens, fewer than the {budget_B[i]} to decode")
            ref[i, len(p): len(p) + budget_B[i]] = r[: budget_B[i]]
    gdef, params = nnx.split(model)
    return _generate_jit(gdef, params, jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(budget_B), jnp.asarray(ref),
                         jax.random.key(seed), spec)


def summarize(st: DecodeState) -> GenerateResult:
    """Tokens per row and acceptance statistics from a final state."""
    seq, n, plen = np.asarray(st.seq_BS), np.asarray(st.n_B), np.asarray(st.prompt_len_B)
    tokens = [seq[b, plen[b]: n[b]].tolist() for b in range(len(n))]
    rounds = int(np.asarray(st.rounds_B).sum())
    reached = np.asarray(st.reached_BG).sum(0)
    accepted = np.asarray(st.accepted_BG).sum(0)
    generated = int((n - plen).sum())
    alpha = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    stats = {"rounds": rounds, "generated": generated,
             # the first token comes from the prefill, not from a round
             "tokens_per_round": (generated - len(n)) / rounds if rounds else 0.0,
             "acceptance_by_position": alpha, "accepted": accepted.tolist(), "reached": reached.tolist()}
    return GenerateResult(tokens=tokens, stats=stats)


def generate(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int | str = 0, proposer: str = "mtp",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, max_len: int | None = None, on_commit=None,
             calibrations: autodraft.SavedCalibrations | None = None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt (lists of token ids of any lengths), speculatively if num_draft>0.

    num_draft="auto" measures every candidate γ on these prompts and uses the fastest by the cost model
    (mtpjax.autodraft); stats["num_draft"] says which, stats["calibration"] why. With `calibrations`, a
    measurement saved there for this machine and request shape is reused, and a new one is saved.
    """
    try:
        sampler = make_sampler(temperature, top_k, top_p)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    relay = autodraft.Relay(on_commit) if on_commit is not None else None

    def spec_for(g: int) -> DecodeSpec:
        return make_spec(model, prompts, max_new_tokens=max_new_tokens, num_draft=g, proposer=proposer,
                         sampler=sampler, eos_id=eos_id, max_len=max_len, on_commit=relay)

    cal = None
    if num_draft == "auto":
        if proposer == "mtp" and model.cfg.mtp_depth == 0:
            raise DecodeError("this model has no MTP modules (mtp_depth 0); use --proposer ngram or --num-draft 0")
        num_draft, cal = autodraft.resolve(model, prompts, spec_for, proposer, seed, relay, calibrations)
    elif isinstance(num_draft, bool) or not isinstance(num_draft, (int, np.integer)):
        raise DecodeError(f"num_draft={num_draft!r} must be an integer >= 0 or 'auto'")
    res = summarize(run(model, prompts, spec_for(int(num_draft)), seed))
    res.stats["num_draft"] = int(num_draft)
    if cal is not None:
        res.stats["calibration"] = cal.as_dict()
    return res
