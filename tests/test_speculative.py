"""The decoder's invariants: speculative greedy == plain greedy, the target distribution is preserved,
module caches equal a fresh prefill, and cached decoding equals a full forward."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mtpjax.config import load_config
from mtpjax.decode import DecodeError, MTPChainProposer, autodraft, generate, host, make_loop, run, summarize
from mtpjax.decode.cache import layer, module_caches, stacked, trunk_cache
from mtpjax.decode.loop import Loop, execute, run_loop
from mtpjax.decode.sampling import make_sampler
from mtpjax.drafts import PLAIN, chain, parse
from mtpjax.eval.evaluate import agreement_at_round_starts, agreement_on, argmax_by_depth, run_forced
from mtpjax.nn.loss import mtp_loss
from mtpjax.nn.model import build_model
from mtpjax.nn.speed import by_position, choose_fastest, expected_tokens


def _pattern_batch(rng, B, T, V):
    """Sequences following x' = 3x+1 mod V with occasional random jumps: learnable, not trivial."""
    x = np.zeros((B, T), np.int32)
    x[:, 0] = rng.integers(0, V, B)
    for t in range(1, T):
        jump = rng.random(B) < 0.1
        x[:, t] = np.where(jump, rng.integers(0, V, B), (3 * x[:, t - 1] + 1) % V)
    return x


def _train(model, cfg, steps=150, seed=0):
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    rng = np.random.default_rng(seed)

    @nnx.jit
    def step(model, opt, toks):
        def f(m):
            return mtp_loss(m, m(toks), toks, step=0, cfg=cfg.loss)

        (_, met), g = nnx.value_and_grad(f, has_aux=True)(model)
        opt.update(model, g)
        return met

    for _ in range(steps):
        met = step(model, opt, jnp.asarray(_pattern_batch(rng, 16, 32, cfg.model.vocab_size)))
    return {k: float(v) for k, v in met.items()}


def _cfg(**kw):
    over = dict(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mtp_depth=2)
    over.update(kw)
    return load_config(None, [f"model.{k}={v}" for k, v in over.items()] + ["data.seq_len=32"])


@pytest.fixture(scope="module")
def trained():
    """Well trained: drafts are almost always accepted."""
    cfg = _cfg()
    model = build_model(cfg, seed=0)
    metrics = _train(model, cfg, steps=60)
    return model, metrics


@pytest.fixture(scope="module")
def half_trained():
    """A few steps in: drafts are accepted sometimes and rejected often, at every position."""
    cfg = _cfg()
    model = build_model(cfg, seed=0)
    _train(model, cfg, steps=4)
    return model


PROMPTS = [[1, 4, 13, 8, 25], [7, 22, 3], [2, 7, 22, 3, 10, 31, 30, 27, 18, 23, 6], [5, 16]]


def T(c):
    """A candidate as these tests spell it: a chain's γ, a tree's shape (`2`: two children of the root)."""
    return chain(c) if isinstance(c, int) else parse({"2": "-1,-1"}.get(c, c))


def _check_greedy_equal(model, proposer, drafts, batches, draft_model=None):
    for prompts in batches:
        base = generate(model, prompts, max_new_tokens=24)
        for g in drafts:
            out = generate(model, prompts, max_new_tokens=24, draft=g, proposer=proposer, draft_model=draft_model)
            assert out.tokens == base.tokens, (proposer, g, len(prompts))
            assert all(len(t) == 24 for t in out.tokens)
            assert 0 < sum(out.stats["accepted"]) < sum(out.stats["reached"])  # both outcomes exercised


def test_greedy_speculative_equals_plain(half_trained):
    _check_greedy_equal(half_trained, "mtp", (1, 3), (PROMPTS,))  # within and beyond the depth; all of 1-4: slow
    _check_greedy_equal(half_trained, "ngram", (2,), (PROMPTS,))


def test_module_1_drafting_every_token_equals_plain(half_trained):
    """proposer="mtp1": module 1 drafts every token (as vLLM and SGLang do), beyond the model's depth too."""
    assert autodraft.candidates(half_trained, "mtp1") == list(map(T, [0, 1, 2, 3, "2x1", "2x2"]))
    _check_greedy_equal(half_trained, "mtp1", (2, 3), (PROMPTS,))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["mtp", "ngram"])
def test_greedy_speculative_equals_plain_full_matrix(half_trained, proposer):
    _check_greedy_equal(half_trained, proposer, (1, 2, 3, 4), (PROMPTS[:1], PROMPTS))


def test_mtp_drafts_are_accepted_on_a_trained_model(trained):
    model, metrics = trained
    out = generate(model, PROMPTS, max_new_tokens=32, draft=2)
    alpha = out.stats["acceptance_by_position"]
    assert alpha[0] > 0.6 and out.stats["tokens_per_round"] > 1.5
    # Decode-time acceptance of depth 1 tracks the teacher-forced training agreement.
    assert abs(alpha[0] - metrics["agreement/mtp_1"]) < 0.2


def test_acceptance_is_the_agreement_where_rounds_start(half_trained):
    """Free-running acceptance by position is the teacher-forced agreement at the positions its rounds start from,
    exactly (rows of several lengths, one cut by EOS); over all positions it is only near it (which positions start
    a round depends on the weights)."""
    model = half_trained
    eos = generate(model, PROMPTS, max_new_tokens=24).tokens[0][9]
    for kw in ({"eos_id": eos}, {}):
        out = generate(model, PROMPTS, max_new_tokens=24, draft=2, **kw)
        alpha = out.stats["acceptance_by_position"]
        assert 0 < alpha[0] < 1 and alpha == agreement_at_round_starts(model, PROMPTS, out.tokens, 2), kw
    assert alpha != agreement_on(model, PROMPTS, out.tokens, 2)  # rows of equal length: all positions are scored


class AcceptAll(Loop):
    """A broken acceptance rule: every draft is accepted unchecked."""

    def accept(self, logits, st, it):
        a, toks, path = super().accept(logits, st, it)
        G = st.drafts_BG.shape[1]
        return jnp.full_like(a, G), jnp.concatenate([st.drafts_BG, toks[:, -1:]], axis=1), path


def as_loop(cls, loop):
    """The same loop as an instance of the subclass cls (a subclass compiles its own loop)."""
    return cls(**{f.name: getattr(loop, f.name) for f in dataclasses.fields(loop)})


def test_companion_unchecked_drafts_are_not_the_agreement_where_rounds_start(half_trained):
    model = half_trained
    loop = make_loop(model, PROMPTS, max_new_tokens=24, draft=2, proposer="mtp", sampler=make_sampler())
    out = summarize(run(model, PROMPTS, as_loop(AcceptAll, loop)), loop.tree)
    assert out.stats["acceptance_by_position"] != agreement_at_round_starts(model, PROMPTS, out.tokens, 2)


def test_companion_a_wrong_acceptance_rule_breaks_equality(half_trained):
    """The equality test can fail: accepting drafts without checking them changes the output."""
    model = half_trained
    base = generate(model, PROMPTS, max_new_tokens=24)
    loop = make_loop(model, PROMPTS, max_new_tokens=24, draft=2, proposer="ngram", sampler=make_sampler())
    out = summarize(run(model, PROMPTS, as_loop(AcceptAll, loop)), loop.tree)
    assert out.tokens != base.tokens


@pytest.mark.slow
def test_parallel_heads_and_scanned_layers_decode_exactly():
    for kw in ({"mtp_kind": "parallel"}, {"scan_layers": True}):
        cfg = _cfg(**kw)
        model = build_model(cfg, seed=1)
        _train(model, cfg, steps=5)
        base = generate(model, PROMPTS, max_new_tokens=16)
        out = generate(model, PROMPTS, max_new_tokens=16, draft=2)
        assert out.tokens == base.tokens and sum(out.stats["accepted"]) > 0


def test_eos_and_per_row_lengths(trained):
    model, _ = trained
    base = generate(model, PROMPTS, max_new_tokens=24)
    eos = base.tokens[0][5]
    out = generate(model, PROMPTS, max_new_tokens=24, draft=3, eos_id=eos)
    for full, cut in zip(base.tokens, out.tokens):
        k = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:k]


@nnx.jit(static_argnums=2)
def _fresh_module_caches(model, seq, n):
    """KV entries a fresh prefill of the committed sequence computes, per module (valid where j <= n-1-k).

    The whole buffer `seq` is prefilled, whatever n: one shape, so one compiled program for every row and round,
    and causality keeps an entry before n from reading anything past it (the callers compare only those)."""
    del n
    return _fresh_prefill(model, seq)


@nnx.jit
def _fresh_prefill(model, seq):
    cfg, S = model.cfg, seq.shape[0]
    toks, pos = seq[None], jnp.arange(S)[None]
    caches = module_caches(cfg, 1, S + 8)
    h, trunk = model.trunk(toks, pos, cache=trunk_cache(cfg, 1, S + 8))
    mods, hk = [], h
    for k in range(1, cfg.mtp_depth + 1):
        nxt = jnp.concatenate([seq[k:], jnp.zeros(k, seq.dtype)])[None]
        hk, kv = model.mtp_forward(k, hk, nxt, pos, cache=layer(caches, k - 1))
        mods.append(kv)
    return trunk, mods


@dataclasses.dataclass(frozen=True)
class NarrowMTP(MTPChainProposer):
    """MTP drafting that recomputes a window of `rows` rows instead of the one exactness needs."""

    rows: int = 1

    def window(self, depth: int) -> int:
        return self.rows


@pytest.mark.parametrize("proposer,expect_equal", [
    (MTPChainProposer(chain(3)), True), (NarrowMTP(chain(3), rows=1), False),
    (NarrowMTP(chain(3), rows=3), False), (MTPChainProposer(chain(3), modules=1), True)])
def test_module_caches_equal_fresh_prefill(half_trained, proposer, expect_equal):
    """After rounds with rejections, committed entries equal a fresh prefill; a too-small window breaks it,
    even one row short of the γ+1 the decoder recomputes (a round that accepts every draft needs them all)."""
    model = half_trained
    loop = make_loop(model, PROMPTS, max_new_tokens=30, draft=3, proposer="mtp", sampler=make_sampler())
    st = run(model, PROMPTS, dataclasses.replace(loop, proposer=proposer))
    res = summarize(st, loop.tree)
    assert 0 < sum(res.stats["accepted"]) < sum(res.stats["reached"])  # accepted and rejected drafts
    seq, n_B = np.asarray(st.seq_BS), np.asarray(st.n_B)
    ok = True
    for b in range(len(PROMPTS)):
        n = int(n_B[b])
        trunk, mods = _fresh_module_caches(model, jnp.asarray(seq[b]), n)
        np.testing.assert_allclose(stacked(st.trunk).k_BKSH[:, b, :, : n - 1],
                                   stacked(trunk).k_BKSH[:, 0, :, : n - 1], atol=2e-5)
        mtp = stacked(st.proposer.caches)
        mods = mods[: proposer.in_use(model.cfg.mtp_depth)]  # modules=1 drafts with module 1 alone
        for k, kv in enumerate(mods, start=1):
            valid = n - k
            for got, want in ((mtp.k_BKSH[k - 1, b, :, :valid], kv.k_BKSH[0, :, :valid]),
                              (mtp.v_BKSH[k - 1, b, :, :valid], kv.v_BKSH[0, :, :valid])):
                ok &= bool(np.allclose(got, want, atol=2e-5))
    assert ok == expect_equal


def test_cached_decoding_equals_full_forward(trained):
    model, _ = trained
    rng = np.random.default_rng(3)
    toks = jnp.asarray(rng.integers(0, 32, (2, 20)), jnp.int32)
    full, cached0, cached1 = _cached_vs_full(model, toks)
    np.testing.assert_allclose(cached0, full[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(cached1, full[1], atol=2e-5, rtol=1e-5)
    # Companion: a cache that misses one chunk's entries no longer matches.
    _, trunk = model.trunk(toks[:, :7], jnp.broadcast_to(jnp.arange(7), (2, 7)), cache=trunk_cache(model.cfg, 2, 32))
    h, _ = model.trunk(toks[:, 8:12], jnp.broadcast_to(jnp.arange(8, 12), (2, 4)), cache=trunk)
    assert not np.allclose(model.logits(model.final_norm(h)), full[0][:, 8:12], atol=1e-3)


@nnx.jit
def _cached_vs_full(model, toks):
    full = model.logits(model(toks).hidden)  # [D+1, B, T, V]
    trunk, hs = trunk_cache(model.cfg, 2, 32), []
    for s, e in ((0, 7), (7, 8), (8, 12), (12, 20)):  # a prefill, a single step, then chunks
        pos = jnp.broadcast_to(jnp.arange(s, e), (2, e - s))
        h, trunk = model.trunk(toks[:, s:e], pos, cache=trunk)
        hs.append(h)
    h0 = jnp.concatenate(hs, axis=1)
    # MTP depth 1 cached in two pieces == the training forward's depth 1.
    nxt = jnp.concatenate([toks[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)
    kv, parts = layer(module_caches(model.cfg, 2, 32), 0), []
    for s, e in ((0, 11), (11, 20)):
        pos = jnp.broadcast_to(jnp.arange(s, e), (2, e - s))
        h1, kv = model.mtp_forward(1, model.trunk_state(h0[:, s:e]), nxt[:, s:e], pos, cache=kv)
        parts.append(h1)
    h1 = jnp.concatenate(parts, axis=1)
    return full, model.logits(model.final_norm(h0)), model.logits(model.head_norm(1, h1))


def _as_normed(model):
    """The same parameters with module 1 reading the trunk's final-normed state (model.mtp_hidden=normed)."""
    m = nnx.clone(model)
    m.cfg = m.cfg.model_copy(update={"mtp_hidden": "normed"})
    return m


@pytest.mark.slow
@pytest.mark.as_users_compile  # the trunk's logits of two programs bitwise equal: XLA's production choices (not -O0's)
def test_normed_mtp_hidden_cached_equals_full(half_trained):
    """model.mtp_hidden=normed: cached == full forward at depth 1; the companion: the same weights reading the raw
    state give other depth-1 logits, so the setting reaches the module."""
    model = _as_normed(half_trained)
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 32, (2, 20)), jnp.int32)
    full, cached0, cached1 = _cached_vs_full(model, toks)
    np.testing.assert_allclose(cached0, full[0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(cached1, full[1], atol=2e-5, rtol=1e-5)
    raw = _cached_vs_full(half_trained, toks)[0]
    assert not np.allclose(raw[1], full[1], atol=1e-3)
    np.testing.assert_array_equal(raw[0], full[0])  # the trunk itself is untouched


@pytest.mark.slow
def test_normed_mtp_hidden_speculative_equals_plain(half_trained):
    """The MTP proposer stores the state module 1 reads (trunk_state): normed drafting stays exact."""
    _check_greedy_equal(_as_normed(half_trained), "mtp", (2,), (PROMPTS,))


def _sharpen(model, factor=20.0):
    """Scale a random model's matrices up so its distributions are far from uniform (and from its drafts)."""
    st = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * factor if x.ndim == 2 else x, st))


@nnx.jit
def _last_logits(model, batch):
    return model.logits(model(batch).hidden[0])[:, -1]


def _reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, crossing=True):
    """Temperature, top-k and top-p once more in float64 numpy, independent of `sampling.probs` (rows of logits).
    crossing=False drops the token whose mass crosses top_p: the off-by-one cut the companions need."""
    x = np.asarray(logits, np.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # the mass of the tokens ranked above each one
        # the decoder sums in float32: a mass within rounding of top_p would leave its cut undecided
        assert np.abs(before - top_p).min() > 1e-4, "pick another top_p: a cumulative mass lies on it"
        kept = (before if crossing else before + sorted_p) < top_p
        kept[:, 0] = True  # the most likely token always stays (crossing=False would keep none when it crosses)
        keep = np.zeros_like(p, bool)
        np.put_along_axis(keep, order, kept, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def _context_logits(model, prompt, n_tokens):
    """The target's next-token logits after the prompt and each continuation of 0..n_tokens-1 tokens (in order)."""
    V = model.cfg.vocab_size
    seqs, levels = [tuple()], []
    for _ in range(n_tokens):
        batch = jnp.asarray([list(prompt) + list(s) for s in seqs], jnp.int32)
        levels.append(np.asarray(_last_logits(model, batch)))
        seqs = [s + (v,) for s in seqs for v in range(V)]
    return levels


def _exact_joint(levels, **sampling):
    """P(x1..xn | prompt) by enumeration, each step's distribution from the numpy reference."""
    pr = np.ones(1)
    for logits in levels:
        pr = (pr[:, None] * _reference_probs(logits, **sampling)).reshape(-1)
    return pr


def _tv(res, exact, V, n_tok):
    """Total variation between the decoded sequences' frequencies and the exact joint."""
    idx = np.array([np.ravel_multi_index(t, (V,) * n_tok) for t in res.tokens])
    emp = np.bincount(idx, minlength=V ** n_tok) / len(res.tokens)
    return 0.5 * np.abs(emp - exact).sum()


# Sampling noise alone (6000 samples of 216 cells) stays under TV 0.025 in 99.5% of draws for every case here;
# each filter and the temperature move the exact distribution by 0.09 or more (the companions check it).
TV_BOUND = 0.04
ALL_SCHEMES = ((0, "mtp"), (2, "mtp"), (2, "ngram"), (3, "mtp1"))


def _wrong_references(sampling):
    """References one step off the sampler: top-k keeping one token more or fewer, the token crossing top_p
    dropped, temperature left at 1."""
    k = sampling.get("top_k", 0)
    wrong = [dict(sampling, top_k=k + 1), dict(sampling, top_k=k - 1)] if k else []
    wrong += [dict(sampling, crossing=False)] if sampling.get("top_p", 1.0) < 1.0 else []
    return wrong + ([dict(sampling, temperature=1.0)] if sampling["temperature"] != 1.0 else [])


# Each case runs plain decoding and draft schemes; the sharpening keeps every case's distribution on few cells
# (low noise) while its filters still bind. Default tier: top_k alone, and temperature with top_p on plain and MTP
# drafting; the rest (no filter, all three together, the other schemes) is slow.
@pytest.mark.parametrize("sharpen,sampling,schemes", [
    (5.0, dict(temperature=1.0, top_k=2), ALL_SCHEMES[:3]),
    pytest.param(5.0, dict(temperature=1.0, top_k=2), ALL_SCHEMES[3:], marks=pytest.mark.slow),
    (5.0, dict(temperature=0.7, top_p=0.8), ALL_SCHEMES[:2]),
    pytest.param(5.0, dict(temperature=0.7, top_p=0.8), ALL_SCHEMES[2:], marks=pytest.mark.slow),
    pytest.param(8.0, dict(temperature=0.7, top_k=2, top_p=0.75), ALL_SCHEMES, marks=pytest.mark.slow),
    pytest.param(20.0, dict(temperature=1.0), ALL_SCHEMES, marks=pytest.mark.slow),
], ids=["top_k", "top_k-mtp1", "temperature-top_p", "temperature-top_p-other-schemes", "all-filters", "unfiltered"])
def test_stochastic_speculative_preserves_target_distribution(sharpen, sampling, schemes):
    cfg = _cfg(vocab_size=6, mtp_depth=2)
    model = build_model(cfg, seed=2)
    # A random model: drafts disagree with the target often, so rejections and resampling are exercised.
    _sharpen(model, sharpen)
    _check_target_distribution(model, sampling, schemes)


def _check_target_distribution(model, sampling, schemes):
    """Each (num_draft, proposer)'s sampled continuations are the exact joint's; plain's tells wrong ones apart."""
    sampler = make_sampler(sampling["temperature"], sampling.get("top_k"), sampling.get("top_p"))
    prompt, n_tok, N = [1, 2, 3], 3, 6000
    levels = _context_logits(model, prompt, n_tok)
    exact = _exact_joint(levels, **sampling)
    for num_draft, proposer in schemes:
        loop = make_loop(model, [prompt] * N, max_new_tokens=n_tok, draft=num_draft, proposer=proposer,
                         sampler=sampler)
        res = summarize(run(model, [prompt] * N, loop, seed=7), loop.tree)
        assert _tv(res, exact, 6, n_tok) < TV_BOUND, (num_draft, proposer)
        if num_draft:
            assert res.stats["acceptance_by_position"][0] < 0.95  # rejections happened
        else:  # companion: a reference one step off the sampler is told apart from the decoder's output
            for wrong in _wrong_references(sampling):
                assert _tv(res, _exact_joint(levels, **wrong), 6, n_tok) > TV_BOUND, wrong


def test_stochastic_companion_wrong_rule_is_detected():
    """Accepting every draft (no rejection test) visibly changes the output distribution."""
    cfg = _cfg(vocab_size=6, mtp_depth=2)
    model = build_model(cfg, seed=2)
    _sharpen(model)
    sampler = make_sampler(1.0, 0, None)
    prompt, N = [1, 2, 3], 6000
    exact = _exact_joint(_context_logits(model, prompt, 3))
    loop = make_loop(model, [prompt] * N, max_new_tokens=3, draft=2, proposer="mtp", sampler=sampler)
    res = summarize(run(model, [prompt] * N, as_loop(AcceptAll, loop), seed=7), loop.tree)
    assert _tv(res, exact, 6, 3) > TV_BOUND


def _cache_copies_per_round(model, draft) -> list[str]:
    """Instructions of the compiled decode loop's body that copy or transpose a whole KV-cache buffer."""
    import functools
    import re

    loop = make_loop(model, PROMPTS[:1], max_new_tokens=8, draft=draft, proposer="mtp", sampler=make_sampler())
    cfg = model.cfg
    elems = loop.capacity * cfg.n_kv_heads * cfg.resolved_head_dim  # batch 1
    gdef, params = nnx.split(model)
    req = host.request(loop, PROMPTS[:1])
    fresh = jax.jit(functools.partial(run_loop), static_argnames=("loop", "graphs"))  # traced anew, not from a cache
    hlo = fresh.lower(loop, (gdef, None), (params, None), req).compile().as_text()
    body = re.search(r"while\(.*?body=%?([\w.-]+)", hlo).group(1)
    text = hlo[hlo.index(f"%{body} ("):]
    text = text[: text.index("\n}\n")]
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = f32\[([\d,]*)\]\S* (\w+)\(", line)
        if m and int(np.prod([int(d) for d in m.group(2).split(",") if d])) == elems:
            if m.group(3) in ("copy", "transpose") or m.group(1).startswith(("copy", "transpose")):
                found.append(m.group(1))
    return found


@pytest.mark.parametrize("num_draft", [0, 1])
def test_decode_loop_updates_the_kv_caches_in_place(half_trained, num_draft, monkeypatch):
    """Each round writes its new keys into the caches in place: no whole-buffer copy or transpose per step."""
    assert _cache_copies_per_round(half_trained, num_draft) == []
    # companion: the same write without its ordering after the reads makes XLA copy every cache buffer
    import mtpjax.nn.layers as layers

    monkeypatch.setattr(layers, "write_after", lambda cache, k, v, start, o: layers.write_kv(cache, k, v, start))
    assert len(_cache_copies_per_round(half_trained, num_draft)) >= 2 * half_trained.cfg.n_layers


def test_auto_num_draft_is_measured_and_keeps_greedy_output(half_trained):
    """auto times plain, the chains and the trees on the request and runs the fastest by E / cost: the greedy
    output is plain greedy's whatever it picked, and stats name the choice (a tree by its shape)."""
    base = generate(half_trained, PROMPTS, max_new_tokens=24)
    out = generate(half_trained, PROMPTS, max_new_tokens=24, draft="auto")
    cal = out.stats["calibration"]
    assert out.tokens == base.tokens
    assert list(cal["round_cost"]) == ["0", "1", "2", "2x1", "2x2"] and cal["round_cost"]["0"] == 1.0
    assert all(c > 0 for c in cal["round_cost"].values()) and len(cal["alpha_by_position"]) == 2
    assert set(cal["acceptance_by_depth_rank"]) == {"2x1", "2x2"}
    for shape, (a1, a2) in cal["acceptance_by_depth_rank"].items():  # a tree's E from its own probe, by hand:
        # 1 + (a[0][0] + a[0][1]) + (a[0][0] + a[0][1]) · (a[1][0] (+ a[1][1] for 2x2)), every parent alike
        assert cal["expected_tokens"][shape] == pytest.approx(1 + sum(a1) * (1 + sum(a2)))
    chosen = _chosen_by_hand(cal)
    assert cal["draft"] == chosen and out.stats["draft"] == cal["draft"]
    assert out.stats["drafts"] == cal["drafts"] == parse(chosen).size
    assert cal["rounds"] > 0 and "0" not in cal["pruned"] and len(cal["pruned"]) >= 5 - autodraft.KEEP
    again = generate(half_trained, PROMPTS, max_new_tokens=24, draft="auto")
    assert again.stats["calibration"] == cal  # one probe per request shape


def _chosen_by_hand(cal):
    """The candidate with the most tokens per unit of round cost among those timed past the first pass, E(γ) =
    1 + α1 + α1·α2 + ... for a chain, the tree's E as reported; plain (0) unless it is predicted autodraft.MARGIN
    times as fast as plain decoding (cost(0) = 1), the rule decode uses."""
    alpha, cost = cal["alpha_by_position"], cal["round_cost"]
    e = {g: sum(float(np.prod(alpha[:i])) for i in range(int(g) + 1)) if g.isdigit() else cal["expected_tokens"][g]
         for g in cost}
    rate = {g: e[g] / cost[g] for g in cost if g != "0" and g not in cal["pruned"]}
    best = max(rate, key=rate.get, default="0")
    return best if best != "0" and rate[best] >= autodraft.MARGIN else "0"


@pytest.mark.parametrize("chosen", [0, 2, "2x2"])
def test_auto_num_draft_runs_what_the_calibration_chose(half_trained, chosen):
    """The wiring, not the timing: a remembered choice, a chain or a tree, is what generate runs and what its stats
    name (a wrong wiring fails one case), and greedy output stays plain greedy's."""
    prompts = PROMPTS[:2]
    loop = make_loop(half_trained, prompts, max_new_tokens=16, draft=0, proposer="mtp", sampler=make_sampler())
    key = autodraft.request_key(prompts, loop, "mtp", autodraft.candidates(half_trained, "mtp"))
    tree = chosen if isinstance(chosen, str) else None
    autodraft.memo(half_trained)[key] = autodraft.Calibration(choice=T(chosen))
    try:
        out = generate(half_trained, prompts, max_new_tokens=16, draft="auto")
    finally:
        del autodraft.memo(half_trained)[key]
    assert out.stats["drafts"] == T(chosen).size and out.stats["draft"] == T(chosen).name()
    assert len(out.stats["acceptance_by_position"]) == (2 if tree else chosen)  # a tree's: by depth
    assert out.tokens == generate(half_trained, prompts, max_new_tokens=16).tokens


def test_auto_candidates_are_plain_chains_and_the_trees_the_proposer_can_draft(half_trained):
    """Trees only where the MTP modules draft them, as deep as the chains reach (one parallel head: depth 1)."""
    assert autodraft.candidates(half_trained, "mtp") == list(map(T, [0, 1, 2, "2x1", "2x2"]))
    assert autodraft.candidates(half_trained, "ngram") == [chain(g, "ngram") for g in (0, 1, 2, 3)]
    assert autodraft.candidates(build_model(_cfg(mtp_depth=1), seed=0), "mtp") == list(map(T, [0, 1, "2"]))
    parallel = build_model(_cfg(mtp_kind="parallel"), seed=0)
    assert autodraft.candidates(parallel, "mtp") == list(map(T, [0, 1, 2, "2x1", "2x2"]))
    assert autodraft.candidates(parallel, "mtp1") == list(map(T, [0, 1, "2"]))


def test_the_calibration_key_names_the_candidates(half_trained, tmp_path, monkeypatch):
    """A measurement saved among other candidates (chains only) is not reused now that trees are candidates; one
    among these is read back, a tree's choice with it."""
    def loop_for(c):
        return make_loop(half_trained, PROMPTS, max_new_tokens=24, draft=c)

    cands = autodraft.candidates(half_trained, "mtp")
    key = autodraft.request_key(PROMPTS, loop_for(PLAIN), "mtp", cands)
    saved = autodraft.SavedCalibrations(tmp_path / "cal.json", "step 1")
    saved.put(key[:-1] + (("0", "1", "2"),),
              autodraft.Calibration(choice=T(2), round_cost={T(0): 1.0, T(1): 1.1, T(2): 1.2}))
    probes = []

    def fake_calibrate(model, prompts, loops, seed=0, **kw):
        probes.append(list(loops))
        return autodraft.Calibration(choice=T("2x2"), round_cost={c: 1.0 + c.size / 10 for c in loops},
                                     pruned=[T(1), T("2x1")])

    monkeypatch.setattr(autodraft, "calibrate", fake_calibrate)
    autodraft.memo(half_trained).clear()
    assert autodraft.resolve(half_trained, PROMPTS, loop_for, "mtp", 0, saved)[0] == T("2x2")
    assert probes == [cands]
    autodraft.memo(half_trained).clear()  # only the file may remember
    choice, cal = autodraft.resolve(half_trained, PROMPTS, loop_for, "mtp", 0, saved)
    assert len(probes) == 1 and cal.source == "saved" and (choice, cal.choice.size) == (T("2x2"), 6)
    assert cal.round_cost == {T(0): 1.0, T(1): 1.1, T(2): 1.2, T("2x1"): 1.4, T("2x2"): 1.6}
    assert cal.pruned == [T(1), T("2x1")]
    autodraft.memo(half_trained).clear()


def test_saved_calibration_is_reused_and_kept_per_machine_and_model(half_trained, tmp_path, monkeypatch):
    """A saved measurement skips the probe; another checkpoint tag, a corrupt file or refresh measure again."""
    prompts, path = PROMPTS, tmp_path / "cal.json"  # the request of the auto test above: its loops are compiled
    probes = []

    def fake_calibrate(model, prompts, specs, seed=0, **kw):
        probes.append(list(specs))
        return autodraft.Calibration(choice=T(len(probes) % 3), round_cost={g: 1.0 + g.size for g in specs},
                                     alpha_by_position=[0.5, 0.25], expected_tokens={g: 1.0 for g in specs},
                                     seconds=1.5)

    monkeypatch.setattr(autodraft, "calibrate", fake_calibrate)

    def run(tag, refresh=False):
        autodraft.memo(half_trained).clear()  # only the file may remember
        saved = autodraft.SavedCalibrations(path, tag, refresh=refresh)
        return generate(half_trained, prompts, max_new_tokens=24, draft="auto", calibrations=saved).stats

    first = run("step 1")
    assert len(probes) == 1 and first["calibration"]["source"] == "probe" and first["drafts"] == 1
    again = run("step 1")
    assert len(probes) == 1 and again["calibration"]["source"] == "saved"
    assert again["drafts"] == 1 and again["calibration"]["round_cost"] == first["calibration"]["round_cost"]
    assert run("step 2")["drafts"] == 2 and len(probes) == 2  # another checkpoint: measured again
    assert len(json.loads(path.read_text())) == 2
    assert run("step 1", refresh=True)["calibration"]["source"] == "probe" and len(probes) == 3
    path.write_text("{not json")
    assert run("step 1")["calibration"]["source"] == "probe" and len(probes) == 4
    assert len(json.loads(path.read_text())) == 1  # the corrupt file was replaced by a valid one
    monkeypatch.setattr(autodraft, "machine", lambda: "another machine")
    assert run("step 1")["calibration"]["source"] == "probe" and len(probes) == 5  # costs hold per machine
    autodraft.memo(half_trained).clear()
    (tmp_path / "a_file").write_text("")
    bad = autodraft.SavedCalibrations(tmp_path / "a_file" / "cal.json", "step 1")  # its directory is a file
    assert bad.put((1,), autodraft.Calibration()) is False and bad.get((1,)) is None


class _FakeLoop:
    """Stands in for the compiled loop: a clock that advances 10 ms of prefill plus a cost per round, and
    interference that slows chosen calls (interference only ever adds time)."""

    cost = {"0": 1e-3, "1": 2.5e-3, "2": 3.5e-3}  # seconds per round, by the candidate's name
    per_round = {"0": 1, "1": 2, "2": 2.5}  # tokens per round

    def __init__(self, slow_calls=()):
        self.now, self.calls, self.slow = 0.0, [], set(slow_calls)

    def run(self, model, prompts, loop, seed=0, budget=None, **kw):
        g = loop.tree.name()
        rounds = int(-(-(budget - 1) // self.per_round[g]))
        self.now += 10e-3 + rounds * self.cost[g] + (50e-3 if len(self.calls) in self.slow else 0.0)
        self.calls.append((g, budget))
        return SimpleNamespace(n_B=jnp.zeros(1), rounds_B=np.array([rounds]))


def test_calibration_costs_are_marginal_round_times_robust_to_interference(half_trained, monkeypatch):
    """Slopes from a prefill-only run to a long one (fixed costs cancel), each length at its fastest."""
    loops = {T(g): SimpleNamespace(tree=T(g), max_new=64) for g in (0, 1, 2)}
    warm, per_pass = 3, 6  # compile runs, then (short, long) per candidate per pass
    # slow down the long probe of γ=1 in two of three passes and γ=0's short probe in one: medians would be fooled
    loop = _FakeLoop(slow_calls={warm + 3, warm + per_pass + 3, warm + 0})
    monkeypatch.setattr(host, "run", loop.run)
    alpha = SimpleNamespace(stats={"acceptance_by_position": [0.9, 0.6]})
    monkeypatch.setattr(host, "summarize", lambda st, tree: alpha)
    monkeypatch.setattr(autodraft.time, "perf_counter", lambda: loop.now)
    cal = autodraft.calibrate(half_trained, PROMPTS, loops, probe=32, repeats=3, min_seconds=0.0)
    assert {b for _, b in loop.calls[warm:]} == {1, 64} and len(loop.calls) == warm + 3 * per_pass
    assert cal.round_cost == pytest.approx({T(0): 1.0, T(1): 2.5, T(2): 3.5})
    assert cal.choice == PLAIN  # E(1) / 2.5 = 1.9 / 2.5 and E(2) / 3.5 = 2.44 / 3.5: both slower than plain
    # passes continue until min_seconds of probing (at most max_repeats)
    loop = _FakeLoop()
    monkeypatch.setattr(host, "run", loop.run)
    autodraft.calibrate(half_trained, PROMPTS, loops, probe=32, repeats=1, min_seconds=1.0, max_repeats=50)
    passes = (len(loop.calls) - warm) // per_pass
    one_pass = sum(2 * 10e-3 + r * loop.cost[g] for g, r in (("0", 63), ("1", 32), ("2", 26)))
    assert passes == int(-(-1.0 // one_pass))


class _FakeTreeLoops(_FakeLoop):
    """_FakeLoop over chains and trees: each candidate's seconds and tokens per round, and the acceptance its probe
    reports (chains α = [0.6, 0.5]; trees a[0] = [0.6, 0.25], a[1] by rank from accepted_by_node)."""

    accepted_by_node = {"-1,-1": [60, 25], "2x1": [60, 25, 40, 15], "2x2": [60, 25, 40, 10, 15, 5],
                        "3x1": [60, 20, 5, 40, 10, 3]}
    reached = {"-1,-1": [100], "2x1": [100, 85], "2x2": [100, 85], "3x1": [100, 85]}
    per_round = {"0": 1.0, "1": 1.6, "2": 1.9, "3": 2.05, "-1,-1": 1.85, "2x1": 2.4, "2x2": 2.55, "3x1": 2.38}  # E

    def __init__(self, cost: dict):
        super().__init__()
        self.cost = cost

    def run(self, model, prompts, loop, seed=0, budget=None, **kw):
        st = super().run(model, prompts, loop, seed, budget)
        return SimpleNamespace(n_B=st.n_B, rounds_B=st.rounds_B, candidate=loop.tree.name())

    def summarize(self, st, tree):
        c = st.candidate
        return SimpleNamespace(stats={"acceptance_by_position": [0.6, 0.5, 0.5][: parse(c).size],
                                      "accepted_by_node": self.accepted_by_node.get(c), "reached": self.reached.get(c)})

    def loops(self, cands):
        return {T(c): SimpleNamespace(tree=T(c), max_new=64) for c in cands}

    def calibrate(self, monkeypatch, model, cands, **kw):
        monkeypatch.setattr(host, "run", self.run)
        monkeypatch.setattr(host, "summarize", self.summarize)
        monkeypatch.setattr(autodraft.time, "perf_counter", lambda: self.now)
        return autodraft.calibrate(model, PROMPTS, self.loops(cands), probe=32, **{"min_seconds": 0.0, **kw})


CHAINS_AND_TREES = [0, 1, 2, "2x1", "2x2"]
ROUND_S = {"0": 1e-3, "1": 1.3e-3, "2": 1.6e-3, "3": 1.9e-3, "-1,-1": 1.4e-3, "2x1": 1.5e-3, "2x2": 1.5e-3,
           "3x1": 1.7e-3}  # by the candidate's name


def test_auto_chooses_a_tree_where_its_measured_round_pays(half_trained, monkeypatch):
    """A 2x2 round that costs what 2x1's does gives the most tokens per second (2.55 / 1.5 over 2.4 / 1.5 and
    the chains' 1.6 / 1.3, 1.9 / 1.6): it is chosen, named, and its E is the hand-computed one; companions: a dearer
    2x2 round loses to 2x1, and trees dearer still lose to a chain."""
    cal = _FakeTreeLoops(ROUND_S).calibrate(monkeypatch, half_trained, CHAINS_AND_TREES)
    assert (cal.choice, cal.choice.size) == (T("2x2"), 6)
    assert cal.round_cost == pytest.approx({T(0): 1.0, T(1): 1.3, T(2): 1.6, T("2x1"): 1.5, T("2x2"): 1.5})
    assert cal.acceptance_by_depth_rank["2x2"] == [pytest.approx([0.6, 0.25]), pytest.approx([55 / 85, 15 / 85])]
    assert cal.expected_tokens[T("2x2")] == pytest.approx(1 + 0.85 + 0.85 * 70 / 85)  # 2.55
    assert cal.expected_tokens[T("2x1")] == pytest.approx(1 + 0.85 + 0.85 * 55 / 85)  # 2.40
    assert cal.expected_tokens[T(2)] == pytest.approx(1 + 0.6 + 0.3)
    assert cal.pruned == [T(1), T(2)]  # after the first pass: below both trees
    saved = autodraft.Calibration.from_dict(cal.as_dict())
    assert (saved.choice, saved.round_cost, saved.pruned) == (T("2x2"), cal.round_cost, [T(1), T(2)])

    dear = _FakeTreeLoops({**ROUND_S, "2x2": 1.7e-3}).calibrate(monkeypatch, half_trained, CHAINS_AND_TREES)
    assert dear.choice == T("2x1") and dear.choice.size == 4
    dearer = _FakeTreeLoops({**ROUND_S, "2x1": 2.4e-3, "2x2": 2.6e-3})
    chain = dearer.calibrate(monkeypatch, half_trained, CHAINS_AND_TREES)
    assert chain.choice == T(1) and chain.choice.is_chain() and chain.pruned == [T("2x1"), T("2x2")]


def test_a_one_depth_tree_and_the_chain_of_as_many_drafts_stay_apart():
    """The tree `2` (two children of the root) and the chain of 2 drafts are different candidates: a saved
    calibration reads each back as itself and a request key tells the candidate sets apart."""
    cal = autodraft.Calibration(choice=T("2"), round_cost={T(0): 1.0, T(2): 1.6, T("2"): 1.4}, pruned=[T(2)],
                                expected_tokens={T(0): 1.0, T(2): 1.9, T("2"): 1.8})
    back = autodraft.Calibration.from_dict(json.loads(json.dumps(cal.as_dict())))
    assert back.round_cost == {T(0): 1.0, T(2): 1.6, T("2"): 1.4} and back.pruned == [T(2)] and back.choice == T("2")
    assert T(2).name() != T("2").name() and parse(T("2").name()) == T("2")  # each spelled as itself


def test_calibration_rounds_past_the_first_pass_do_not_grow_with_the_candidates(half_trained, monkeypatch):
    """Every candidate is timed once; later passes time plain and the KEEP - 1 best, so the probe's rounds past the
    first pass are the same for 5 candidates and for 8 (counted in decode rounds, not seconds); companion: timing
    every candidate in every pass (keep = all) grows them."""
    many = [0, 1, 2, 3, "2", "2x1", "2x2", "3x1"]

    def rounds_after_first_pass(cands, **kw):
        cal = _FakeTreeLoops(ROUND_S).calibrate(monkeypatch, half_trained, cands, **kw)
        first = sum(-(-63 // _FakeTreeLoops.per_round[T(c).name()]) for c in cands)  # one 64-token run each
        return cal.rounds - first, cal

    few_later, few = rounds_after_first_pass(CHAINS_AND_TREES, repeats=3)
    many_later, lots = rounds_after_first_pass(many, repeats=3)
    kept = [0, "2x1", "2x2"]  # the best two rivals among either set, in candidate order
    assert [c for c in CHAINS_AND_TREES if T(c) not in few.pruned] == [c for c in many if T(c) not in lots.pruned] \
        == kept
    assert few_later == many_later == 2 * sum(-(-63 // _FakeTreeLoops.per_round[T(c).name()]) for c in kept)
    # min_seconds never reached: passes stop at max_repeats, still of the kept three
    capped, _ = rounds_after_first_pass(many, repeats=1, min_seconds=1e9, max_repeats=5)
    assert capped == 4 * sum(-(-63 // _FakeTreeLoops.per_round[T(c).name()]) for c in kept)
    assert rounds_after_first_pass(many, repeats=3, keep=len(many))[0] > few_later


def _fastest_chain(alpha, round_cost: dict) -> int:
    """The γ choose_fastest picks among chains with E from α (0: plain)."""
    cost = {chain(g): c for g, c in {0: 1.0, **round_cost}.items()}
    return choose_fastest({t: expected_tokens(t, by_position(alpha)) for t in cost}, cost).size


def test_choose_fastest_falls_back_to_plain_when_drafting_costs_more_than_it_saves():
    alpha = [0.9, 0.7]
    assert _fastest_chain(alpha, {1: 3.8, 2: 5.1}) == 0  # batch 1 on a 2-core CPU, measured
    assert _fastest_chain(alpha, {1: 1.5, 2: 2.5}) == 1  # batch 32, measured
    assert _fastest_chain(alpha, {1: 1.1, 2: 1.3}) == 2


def test_budget_cuts_generation_without_recompiling(half_trained):
    loop = make_loop(half_trained, PROMPTS, max_new_tokens=20, draft=2, proposer="mtp", sampler=make_sampler())
    full = summarize(run(half_trained, PROMPTS, loop), loop.tree).tokens
    size = jax_cache_size()
    short = summarize(run(half_trained, PROMPTS, loop, budget=7), loop.tree).tokens
    assert jax_cache_size() == size
    assert short == [t[:7] for t in full]


def test_streaming_callbacks_never_recompile(half_trained):
    """Three calls with three different callbacks compile the loop once; each callback sees its own call's tokens."""
    size = jax_cache_size()
    for seed in range(3):
        streamed = []

        def on_commit(toks, counts, streamed=streamed):
            streamed.extend(toks[0, : int(counts[0])].tolist())

        out = generate(half_trained, PROMPTS, max_new_tokens=13, draft=2, temperature=1.0, seed=seed,
                       on_commit=on_commit)
        assert streamed == out.tokens[0]
    assert jax_cache_size() == size + 1


def jax_cache_size():
    return execute._cache_size()


def _teacher_forced_depth1(model, prompts, refs, n):
    """Matches and positions of argmax depth 1 at i == argmax main head at i+1, i in [P-1, P+n-3], by full forward."""
    seqs = [p + r[:n] for p, r in zip(prompts, refs)]
    T = max(map(len, seqs))  # causal: padding at the end changes no earlier position
    am = np.asarray(argmax_by_depth(model, jnp.asarray([s + [0] * (T - len(s)) for s in seqs], jnp.int32)))
    match = total = 0
    for b, p in enumerate(prompts):
        i = np.arange(len(p) - 1, len(p) + n - 2)
        match += int((am[1, b, i] == am[0, b, i + 1]).sum())
        total += len(i)
    return match, total


@dataclasses.dataclass(frozen=True)
class StaleTrunkMTP(MTPChainProposer):
    """A broken draft state: MTP drafting that never stores the trunk's new hidden states (module 1 reads rows
    that were never written)."""

    def step(self, models, state, ctx):
        W = self.window(models.target.cfg.mtp_depth)
        return self._draft_from(models.target, state, ctx, jnp.maximum(ctx.n_B - 1 - W, 0), W)


@pytest.mark.parametrize("proposer,equal", [(MTPChainProposer(chain(2)), True),
                                            (StaleTrunkMTP(chain(2)), False)])
def test_forced_decoding_acceptance_equals_teacher_forced_agreement(half_trained, proposer, equal):
    """Walking a reference text, depth-1 acceptance counts equal agreement/mtp_1 from a full forward on it:
    the decoder's draft state is the training forward's. The companion walks the same text with a broken draft
    state: the same tokens and rounds, other acceptance counts."""
    rng = np.random.default_rng(1)
    refs = [_pattern_batch(rng, 1, 20, 32)[0].tolist() for _ in PROMPTS]
    n = 16
    loop = make_loop(half_trained, PROMPTS, max_new_tokens=n, draft=2, proposer="mtp", sampler=make_sampler())
    res = summarize(run_forced(half_trained, PROMPTS, dataclasses.replace(loop, proposer=proposer), refs), loop.tree)
    match, total = _teacher_forced_depth1(half_trained, PROMPTS, refs, n)
    assert 0 < match < total
    assert res.tokens == [r[:n] for r in refs] and res.stats["reached"][0] == total
    assert (res.stats["accepted"][0] == match) == equal


def test_rows_sample_independently(trained):
    model, _ = trained
    out = generate(model, [[1, 2]] * 8, max_new_tokens=12, draft=2, temperature=1.5, seed=3)
    assert len({tuple(t) for t in out.tokens}) > 1


def test_bad_requests_raise_one_line_errors(trained):
    model, _ = trained
    plain = build_model(_cfg(mtp_depth=0))
    cases = [
        (lambda: generate(model, [[]], max_new_tokens=4), "empty prompt"),
        (lambda: generate(model, [[1] * 40], max_new_tokens=30, max_len=64), "exceeds the cache"),
        (lambda: generate(plain, [[1]], max_new_tokens=4, draft=2), "no MTP modules"),
        (lambda: generate(model, [[99]], max_new_tokens=4), "outside the vocabulary"),
        (lambda: generate(model, [[1]], max_new_tokens=0), "max_new_tokens"),
        (lambda: generate(model, [[1]], max_new_tokens=4, temperature=-1.0), "temperature"),
        (lambda: generate(model, [[1]], max_new_tokens=4, temperature=float("nan")), "temperature=nan must be a fin"),
        (lambda: generate(model, [[1]], max_new_tokens=4, temperature=float("inf")), "temperature=inf must be a fin"),
        (lambda: generate(model, [[1]], max_new_tokens=4, draft=1, proposer="x"), "proposer"),
        (lambda: generate(model, [[1]], max_new_tokens=4, draft="many"), "is not one of auto"),
        (lambda: generate(plain, [[1]], max_new_tokens=4, draft="auto"), "no MTP modules"),
    ]
    for fn, text in cases:
        with pytest.raises(DecodeError, match=text) as e:
            fn()
        assert "\n" not in str(e.value)
    # The n-gram proposer works without MTP modules: the plain model's greedy tokens, all 4 of them.
    out = generate(plain, [[1, 2, 1, 2]], max_new_tokens=4, draft=2, proposer="ngram")
    assert len(out.tokens[0]) == 4 and out.tokens == generate(plain, [[1, 2, 1, 2]], max_new_tokens=4).tokens


def test_companion_a_non_finite_temperature_samples_garbage():
    """What make_sampler's finiteness check guards: a Sampler built around it samples NaNs (nan) or ignores the model
    (inf: every token equally likely)."""
    from mtpjax.decode.sampling import Sampler, probs

    logits = jnp.array([[0.0, 5.0, 10.0, -3.0]])
    assert np.isnan(np.asarray(probs(Sampler(float("nan")), logits))).all()
    assert np.asarray(probs(Sampler(float("inf")), logits)).tolist() == [[0.25] * 4]
