"""The draft-model proposer: greedy == plain, the target distribution is kept, its cache equals a fresh prefill."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import test_speculative
from flax import nnx
from test_speculative import PROMPTS, _cfg, _check_greedy_equal, _context_logits, _exact_joint, _sharpen, _train

from mtpjax.decode import DecodeError, DraftModelProposer, generate, make_loop, run, summarize
from mtpjax.drafts import chain
from mtpjax.decode.cache import stacked, trunk_cache
from mtpjax.decode.sampling import make_sampler
from mtpjax.nn.model import build_model

half_trained = test_speculative.half_trained  # the target: drafts accepted sometimes


def _draft_cfg(**kw):
    return _cfg(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mtp_depth=0, **kw)


@pytest.fixture(scope="module")
def draft():
    """A small model trained a little on the same task: its drafts are accepted sometimes, at every position."""
    cfg = _draft_cfg()
    model = build_model(cfg, seed=5)
    _train(model, cfg, steps=10)
    return model


@pytest.mark.slow
def test_greedy_draft_model_equals_plain(half_trained, draft):
    _check_greedy_equal(half_trained, "model", (1, 3), (PROMPTS,), draft_model=draft)  # ragged prompts, batch 4


@pytest.mark.slow
def test_greedy_draft_model_equals_plain_full_matrix(half_trained, draft):
    _check_greedy_equal(half_trained, "model", (1, 2, 3, 4), (PROMPTS[:1], PROMPTS), draft_model=draft)


class ShortCatchUp(DraftModelProposer):
    """The draft model runs only the newest committed token each round (the entry before it goes stale)."""

    def catch_up(self) -> int:
        return 1


@nnx.jit(static_argnums=2)
def _fresh_draft_cache(model, seq, n):
    _, cache = model.trunk(seq[None, :n], jnp.arange(n)[None], cache=trunk_cache(model.cfg, 1, n + 8))
    return cache


@pytest.mark.parametrize("proposer,expect_equal", [(DraftModelProposer(chain(2, "model")), True),
                                                    (ShortCatchUp(chain(2, "model")), False)])
def test_draft_cache_equals_fresh_prefill_after_rejections(half_trained, draft, proposer, expect_equal):
    """After rounds with accepted and rejected drafts, the draft model's entries at committed positions are a
    fresh prefill's; catching up on one token only (companion) leaves the entry of a fully accepted round stale."""
    loop = make_loop(half_trained, PROMPTS, max_new_tokens=30, draft=2, proposer="model", draft_model=draft)
    st = run(half_trained, PROMPTS, dataclasses.replace(loop, proposer=proposer), draft_model=draft)
    res = summarize(st, loop.tree)
    assert 0 < res.stats["accepted"][0] < res.stats["reached"][0]  # rejections happened
    assert res.stats["accepted"][1] > 0  # and rounds where every draft was accepted
    got, seq, n_B = stacked(st.proposer), np.asarray(st.seq_BS), np.asarray(st.n_B)
    ok = True
    for b in range(len(PROMPTS)):
        n = int(n_B[b])
        want = stacked(_fresh_draft_cache(draft, jnp.asarray(seq[b]), n))
        for g, w in ((got.k_BKSH, want.k_BKSH), (got.v_BKSH, want.v_BKSH)):
            ok &= bool(np.allclose(g[:, b, :, :n], w[:, 0, :, :n], atol=2e-5))
    assert ok == expect_equal


@pytest.mark.slow
def test_stochastic_draft_model_preserves_target_distribution():
    cfg = _cfg(vocab_size=6, mtp_depth=0)
    model = build_model(cfg, seed=2)
    dm = build_model(_draft_cfg(vocab_size=6), seed=3)
    _sharpen(model)
    _sharpen(dm)  # a random draft: far from the target, so rejections and resampling are exercised
    sampler = make_sampler(1.0, 0, None)
    prompt, n_tok, N = [1, 2, 3], 3, 6000
    exact = _exact_joint(_context_logits(model, prompt, n_tok))  # the float64 numpy reference, T=1, no filter
    loop = make_loop(model, [prompt] * N, max_new_tokens=n_tok, draft=2, proposer="model", sampler=sampler,
                     draft_model=dm)
    res = summarize(run(model, [prompt] * N, loop, seed=7, draft_model=dm), loop.tree)
    assert 0.05 < res.stats["acceptance_by_position"][0] < 0.95  # accepted and rejected drafts
    idx = np.array([np.ravel_multi_index(t, (6,) * n_tok) for t in res.tokens])
    emp = np.bincount(idx, minlength=6 ** n_tok) / N
    assert 0.5 * np.abs(emp - exact).sum() < 0.04  # the bound of the MTP and n-gram test


def test_draft_model_requests_are_checked(half_trained, draft):
    other = build_model(_draft_cfg(vocab_size=48), seed=0)
    cases = [
        (lambda: generate(half_trained, [[1]], max_new_tokens=4, draft=2, proposer="model"), "needs a draft model"),
        (lambda: generate(half_trained, [[1]], max_new_tokens=4, draft="auto", proposer="model"),
         "needs a draft model"),
        (lambda: generate(half_trained, [[1]], max_new_tokens=4, draft=2, proposer="model", draft_model=other),
         "vocabulary \\(48 ids\\) differs from the target's \\(32\\)"),
        (lambda: generate(half_trained, [[1]], max_new_tokens=4, draft=2, proposer="mtp", draft_model=draft),
         "only with proposer='model'"),
    ]
    for fn, text in cases:
        with pytest.raises(DecodeError, match=text) as e:
            fn()
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_auto_num_draft_covers_the_draft_model(half_trained, draft):
    base = generate(half_trained, PROMPTS[:2], max_new_tokens=16)
    out = generate(half_trained, PROMPTS[:2], max_new_tokens=16, draft="auto", proposer="model", draft_model=draft)
    assert out.tokens == base.tokens
    assert set(out.stats["calibration"]["round_cost"]) == {"0", "1", "2", "3", "4"}
    assert out.stats["draft"] == out.stats["calibration"]["draft"]
