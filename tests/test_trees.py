"""Draft trees: greedy tree decoding equals plain greedy, every cache equals a fresh prefill after rounds with
rejected branches, the caches are updated in place, and a bad tree spec is one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import PROMPTS, TV_BOUND, _cache_copies_per_round, _cfg, _context_logits, _exact_joint, \
    _fresh_module_caches, _sharpen, _train, _tv

import mtpjax.decode.loop as loop_module
import mtpjax.decode.tree as tree_module
from mtpjax.decode import DecodeError, MTPTreeProposer, generate, make_loop, run, summarize
from mtpjax.decode.cache import stacked
from mtpjax.decode.sampling import make_sampler
from mtpjax.drafts import DraftError, Tree, chain, parse
from mtpjax.nn.model import build_model
from mtpjax.nn.speed import expected_tokens

MLA = dict(attention_kind="mla", kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6,
           v_head_dim=10)


def _half_trained(**kw):
    cfg = _cfg(**kw)
    model = build_model(cfg, seed=0)
    _train(model, cfg, steps=4)
    return model


@pytest.fixture(scope="module")
def half_trained():
    return _half_trained()


def _check_tree_equal(model, trees, batches, proposer="mtp"):
    for prompts in batches:
        base = generate(model, prompts, max_new_tokens=24)
        for tree in trees:
            out = generate(model, prompts, max_new_tokens=24, draft=tree, proposer=proposer)
            assert out.tokens == base.tokens, (tree, len(prompts))
            assert parse(out.stats["draft"]) == parse(tree)
            assert 0 < sum(out.stats["accepted"]) < sum(out.stats["reached"])  # accepted and rejected branches
            # the arithmetic's tree E from the measured acceptance by depth and rank is the measured count
            if "+" not in tree and "," not in tree:  # an MTP tree branching evenly
                E = expected_tokens(parse(tree), out.stats["acceptance_by_depth_rank"])
                assert E == pytest.approx(1 + sum(out.stats["accepted"]) / out.stats["rounds"])


def test_greedy_tree_equals_plain(half_trained):
    """Ragged prompts at batch 4: two MTP branches over both modules, and n-gram lookup's chain as a third branch
    (hybrid; its first token may repeat an MTP child's). Every other shape and model: slow."""
    _check_tree_equal(half_trained, ["2x1+ngram2"], [PROMPTS])


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["mtp", "mtp1"])
def test_greedy_tree_equals_plain_full_matrix(half_trained, proposer):
    """Batch 1 and 4, two shapes and a parent list, deeper than the modules (the last continues from itself)."""
    _check_tree_equal(half_trained, ["2x2", "2x2x1", "3x1", "-1,-1,0,0,2"], [PROMPTS[:1], PROMPTS], proposer)


@pytest.mark.slow
def test_greedy_hybrid_tree_equals_plain_at_batch_1(half_trained):
    """One prompt: the n-gram branch beside two MTP branches, and one deeper than the MTP tree."""
    _check_tree_equal(half_trained, ["2x1+ngram2", "1x1+ngram3"], [PROMPTS[:1]])


@pytest.mark.slow
@pytest.mark.parametrize("kw,trees,batches", [
    (MLA, ["2x2", "3x1"], [PROMPTS]),
    (dict(mtp_kind="parallel", scan_layers=True), ["2x2", "3x1", "2x1+ngram2"], [PROMPTS[:1], PROMPTS]),
], ids=["mla", "parallel-scanned"])
def test_greedy_tree_equals_plain_mla_and_parallel(kw, trees, batches):
    """Parallel heads (every node extends from the trunk's state): trees and a hybrid at batch 1 and 4."""
    _check_tree_equal(_half_trained(**kw), trees, batches)


@pytest.mark.slow
@pytest.mark.parametrize("hidden", ["raw", "normed"])
def test_a_chain_tree_drafts_as_the_chain_does(half_trained, hidden):
    """A tree of one child per depth accepts what a chain of as many drafts accepts (the same drafts), whichever
    trunk state (model.mtp_hidden) module 1 reads."""
    model = half_trained if hidden == "raw" else _half_trained(mtp_hidden=hidden)
    if hidden == "normed":  # a final-norm scale far from 1, else the modules' own norm hides a raw state read
        scale = model.final_norm.scale
        scale[...] = jnp.asarray(np.random.default_rng(0).uniform(0.2, 3.0, scale.shape), scale.dtype)
    chain = generate(model, PROMPTS, max_new_tokens=24, draft=2)
    tree = generate(model, PROMPTS, max_new_tokens=24, draft="1x1")
    assert tree.tokens == chain.tokens
    assert tree.stats["accepted"] == chain.stats["accepted"] and tree.stats["rounds"] == chain.stats["rounds"]


@dataclasses.dataclass(frozen=True)
class NarrowTree(MTPTreeProposer):
    """Tree drafting that recomputes `rows` committed rows a round instead of depth + modules."""

    rows: int = 1

    def window(self, depth: int) -> int:
        return self.rows


def _caches_equal_fresh(model, st, used: int) -> tuple[bool, bool]:
    """(trunk equal, module caches equal): every committed entry of the loop's caches against a fresh prefill."""
    seq, n_B = np.asarray(st.seq_BS), np.asarray(st.n_B)
    trunk_ok = mods_ok = True
    for b in range(len(n_B)):
        n = int(n_B[b])
        trunk, mods = _fresh_module_caches(model, jax.numpy.asarray(seq[b]), n)
        for got, want in zip(jax.tree.leaves(stacked(st.trunk)), jax.tree.leaves(stacked(trunk))):
            trunk_ok &= bool(np.allclose(got[:, b][..., : n - 1, :], want[:, 0][..., : n - 1, :], atol=2e-5))
        for k in range(1, used + 1):
            got_kv = jax.tree.map(lambda x, k=k: x[k - 1], stacked(st.proposer.caches))
            for got, want in zip(jax.tree.leaves(got_kv), jax.tree.leaves(mods[k - 1])):
                mods_ok &= bool(np.allclose(got[b][..., : n - k, :], want[0][..., : n - k, :], atol=2e-5))
    return trunk_ok, mods_ok


def _tree_run(model, proposer, max_new=30):
    loop = make_loop(model, PROMPTS, max_new_tokens=max_new, sampler=make_sampler(), draft=proposer.tree)
    st = run(model, PROMPTS, dataclasses.replace(loop, proposer=proposer))
    res = summarize(st, loop.tree)
    assert 0 < sum(res.stats["accepted"]) < sum(res.stats["reached"])  # branches accepted and rejected
    return st


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, MLA], ids=["gqa", "mla"])
def test_tree_caches_equal_fresh_prefill(kw, monkeypatch):
    """After rounds with rejected branches every committed entry of the trunk's and the modules' caches equals a
    fresh prefill of the committed sequence, for a tree and for a hybrid whose n-gram branch is deeper than its MTP
    tree; companions: the accepted path left where the tree put it breaks the trunk's, a window one row short breaks
    the modules', and so does the hybrid's window sized by its MTP tree alone (missing a deep n-gram accept)."""
    model = _half_trained(**kw)
    tree = parse("2x2x1")
    assert _caches_equal_fresh(model, _tree_run(model, MTPTreeProposer(tree)), 2) == (True, True)
    narrow = NarrowTree(tree, rows=MTPTreeProposer(tree).window(2) - 1)
    assert _caches_equal_fresh(model, _tree_run(model, narrow), 2) == (True, False)
    hybrid = MTPTreeProposer(parse("2x1+ngram3"))
    st = _tree_run(model, hybrid)
    assert int(np.asarray(st.accepted_BG)[:, -1].sum()) > 0  # the n-gram branch accepted at depth 3
    assert _caches_equal_fresh(model, st, 2) == (True, True)
    mtp_only = NarrowTree(hybrid.tree, rows=hybrid.mtp.max_depth + hybrid.in_use(2))
    assert _caches_equal_fresh(model, _tree_run(model, mtp_only), 2) == (True, False)
    monkeypatch.setattr(loop_module, "keep_path", lambda cache, *a: cache)
    assert not _caches_equal_fresh(model, _tree_run(model, MTPTreeProposer(tree), max_new=29), 2)[0]


def test_bad_tree_specs_are_one_line_errors():
    assert parse("2x2x1").parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert parse("-1,-1,0").parents == (-1, -1, 0) and Tree((-1, -1, 0, 1), ("mtp",) * 4).name() == "2x1"
    assert Tree((-1, -1, 0, 2), ("mtp",) * 4).name() == "-1,-1,0,2"
    assert parse("2x2+ngram3").part("mtp") == parse("2x2") and parse("2x2+ngram3").count("ngram") == 3
    assert parse("3") == chain(3) and parse("0").size == 0  # a number spells a chain (0: plain)
    for spec in ["2x0", "ax2", "", "-1,1", "9x9", "2x2+ngram0", "2x2+trie", "0+ngram2"]:
        with pytest.raises(DraftError) as e:
            parse(spec)
        assert "\n" not in str(e.value) and spec in str(e.value)
    for spec in ["65", "-1" + ",-1" * 64]:  # a chain's length and a parent list: each counted against the limit
        with pytest.raises(DraftError, match="has 65 nodes; use 0..64"):
            parse(spec)
    model = build_model(_cfg(), seed=0)
    with pytest.raises(DecodeError, match="proposer mtp or mtp1"):
        make_loop(model, PROMPTS, max_new_tokens=4, proposer="ngram", draft="2x2")
    with pytest.raises(DecodeError, match="draft '2x0'"):
        make_loop(model, PROMPTS, max_new_tokens=4, draft="2x0")
    for bad in (2.5, True, None):  # a spelling is a string or an int; a bool is no count
        with pytest.raises(DecodeError, match=f"^draft={bad!r} is not a draft; give one of "):
            make_loop(model, PROMPTS, max_new_tokens=4, draft=bad)
    with pytest.raises(DecodeError, match="^a loop drafts a fixed tree; draft='auto' is generate's"):
        make_loop(model, PROMPTS, max_new_tokens=4, draft="auto")


@pytest.mark.slow
def test_tree_rounds_update_the_caches_in_place(half_trained, monkeypatch):
    """Verifying a tree and keeping its accepted path writes the caches in place: no whole-buffer copy per round;
    companion: the verification's write not ordered after its reads makes XLA copy the buffers in a tree loop too."""
    assert _cache_copies_per_round(half_trained, "2x2") == []
    import mtpjax.nn.layers as layers

    monkeypatch.setattr(layers, "write_after", lambda cache, k, v, start, o: layers.write_kv(cache, k, v, start))
    assert len(_cache_copies_per_round(half_trained, "2x2")) >= 2 * half_trained.cfg.n_layers


def _tree_tv(tree: str, sampling: dict, proposer="mtp"):
    """TV between sampled tree decoding's 3-token continuations and the exact joint, and the depth-1 acceptance."""
    model = build_model(_cfg(vocab_size=6, mtp_depth=2), seed=2)
    _sharpen(model, 5.0)  # a random model: drafts disagree with the target often, so every rule is exercised
    sampler = make_sampler(sampling["temperature"], sampling.get("top_k"), sampling.get("top_p"))
    prompt, n_tok, N = [1, 2, 3], 3, 6000
    exact = _exact_joint(_context_logits(model, prompt, n_tok), **sampling)
    loop = make_loop(model, [prompt] * N, max_new_tokens=n_tok, proposer=proposer, sampler=sampler, draft=tree)
    res = summarize(run(model, [prompt] * N, loop, seed=7), loop.tree)
    return _tv(res, exact, 6, n_tok), res.stats["acceptance_by_position"][0]


@pytest.mark.slow
@pytest.mark.parametrize("tree,sampling", [("2x2", dict(temperature=1.0, top_k=2)),
                                           ("3x1", dict(temperature=0.7, top_p=0.8))])
def test_sampled_trees_preserve_the_target_distribution(tree, sampling):
    """Siblings drawn i.i.d. from q, recursive rejection with p <- norm(max(p - q, 0)): the exact joint."""
    tv, alpha = _tree_tv(tree, sampling)
    assert tv < TV_BOUND and alpha < 0.95  # rejections happened


@pytest.mark.slow
def test_sampled_tree_companion_a_wrong_sibling_rule_is_detected(monkeypatch):
    """Testing every sibling against the unreduced p (no residual after a rejection) visibly changes the output."""
    monkeypatch.setattr(tree_module, "residual", lambda p, q: p)
    assert _tree_tv("3x1", dict(temperature=1.0))[0] > TV_BOUND


def test_a_bad_tree_flag_is_one_line_and_exit_2(capsys):
    from mtpjax.cli.decode import main

    assert main(["--run-dir", "nowhere", "--prompt", "x", "--tree", "2x0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tree" in err and "2x2x1" in err


HYBRID_SAMPLING = dict(temperature=1.0, top_k=2)


@pytest.mark.slow
def test_sampled_hybrid_tree_preserves_the_target_distribution():
    """The n-gram branch is a point mass (one-hot q) beside i.i.d. MTP siblings: each rejection uses its own q."""
    tv, alpha = _tree_tv("2x1+ngram2", HYBRID_SAMPLING)
    assert tv < TV_BOUND and alpha < 0.95


def _ngram_scored_with_the_mtp_q(real):
    """sampled_path with the n-gram nodes' one-hot q replaced by the root's MTP q (node 0's, drawn i.i.d.)."""

    def wrong(tree, drafts_BG, q_BGV, p_BYV, u_BG):
        G = parse("2x1").size  # the MTP nodes; the n-gram chain's follow
        return real(tree, drafts_BG, q_BGV.at[:, G:].set(q_BGV[:, :1]), p_BYV, u_BG)

    return wrong


def _point_mass_left_in_the_residual(real):
    """residual that keeps p unchanged after a point mass (a one-hot q) is rejected."""
    return lambda p_BV, q_BV: jnp.where(q_BV.max(-1, keepdims=True) == 1.0, p_BV, real(p_BV, q_BV))


@pytest.fixture
def fresh_traces():
    """Forget every compiled loop before and after: a monkeypatched rule must be traced, and never reused."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("name,wrong", [("sampled_path", _ngram_scored_with_the_mtp_q),
                                        ("residual", _point_mass_left_in_the_residual)], ids=["mtp-q", "no-residual"])
def test_sampled_hybrid_tree_companion_a_wrong_ngram_rule_is_detected(monkeypatch, fresh_traces, name, wrong):
    """The n-gram branch scored with its siblings' q, or its rejection not taken out of p, visibly changes the
    output."""
    monkeypatch.setattr(tree_module, name, wrong(getattr(tree_module, name)))
    assert _tree_tv("2x1+ngram2", HYBRID_SAMPLING)[0] > 2 * TV_BOUND


@pytest.mark.slow
def test_eval_speed_report_prices_a_tree(half_trained):
    """speed_report(wider=...): the tree's E from its acceptance by depth and rank, by hand, its ceiling over one
    plain step plus one module call per depth at a chain draft's floor r, and its estimate over v of its 7 rows
    (the n-gram round verifying 6 drafts) instead of the one step."""
    from mtpjax.eval.evaluate import decode_context, speed_report
    from mtpjax.nn.speed import floor_ratio
    from mtpjax.decode import MTPChainProposer

    prompts = PROMPTS[:2]
    d = speed_report(half_trained, prompts, gamma=2, max_new=16, wider=parse("2x2"))
    assert d["outputs_identical"] is True and d["tree"] == "2x2" and d["tree_nodes"] == 6
    a1, a2 = d["tree_acceptance_depth1"], d["tree_acceptance_depth2"]
    assert len(a1) == len(a2) == 2 and 0 < sum(a1) <= 1
    e = 1 + sum(a1) * (1 + sum(a2))  # each depth-1 node's two children share a[1]
    assert d["tree_expected_tokens_per_round"] == pytest.approx(e)
    assert d["tree_predicted_speedup"] == pytest.approx(e / d["tree_round_cost"])
    assert d["tree_speedup"] == pytest.approx(d["tree_tokens_per_sec"] / d["plain_tokens_per_sec"])
    r = floor_ratio(MTPChainProposer(chain(2)), half_trained.cfg, decode_context(prompts, 16))
    assert d["tree_verify_cost_v"] > 0
    # issue 50: the ceiling is a bound (verification at least one plain step); over the n-gram round's v it is the
    # estimate tree_floor_draft_speedup, which a measured speedup can exceed
    assert d["tree_speedup_ceiling"] == pytest.approx(e / (1 + 2 * r))
    assert d["tree_floor_draft_speedup"] == pytest.approx(e / (max(1.0, d["tree_verify_cost_v"]) + 2 * r))
