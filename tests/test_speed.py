"""The speculation arithmetic (mtpjax.nn.speed): E(γ), the ceiling, the draft-work ratio by counted rows, γ's choice."""

import jax
import jax.numpy as jnp
import pytest

from mtpjax.decode import DraftModelProposer, MTPChainProposer, NgramProposer
from mtpjax.decode.proposers import Plain
from mtpjax.drafts import chain, parse
from mtpjax.nn.loss import expected_accept_length
from mtpjax.nn.speed import (
    by_position,
    ceiling,
    choose_fastest,
    expected_tokens,
    floor_ratio,
    speedup_ceiling,
    weight_ratio,
    work_ratio,
)


def E(alpha, g):
    """A chain's E(γ) from α by position: expected_tokens of the chain."""
    return expected_tokens(chain(g), by_position(alpha))


def fastest(alpha, round_cost: dict) -> int:
    """The γ choose_fastest picks among chains with E from α (0: plain, cost 1)."""
    cost = {chain(g): c for g, c in {0: 1.0, **round_cost}.items()}
    return choose_fastest({t: expected_tokens(t, by_position(alpha)) for t in cost}, cost).size


def test_expected_tokens():
    assert E([0.5, 0.5], 2) == pytest.approx(1.75)
    assert E([1.0, 0.0], 2) == pytest.approx(2.0)
    assert E([0.9], 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)  # last rate reused past the list
    assert E([], 2) == 1.0


def test_tree_expected_tokens_by_depth_and_rank():
    """2x1 by hand: depth 1 accepts rank 0 with 0.6, rank 1 with 0.2; depth 2 accepts its one child with 0.5."""
    tree, a = parse("2x1"), [[0.6, 0.2], [0.5]]
    assert expected_tokens(tree, a) == pytest.approx(1 + 0.6 + 0.2 + 0.6 * 0.5 + 0.2 * 0.5)
    assert ceiling(tree, a, r=0.05, verify_cost=1.3) == pytest.approx(2.2 / (1.3 + 2 * 0.05))  # 2 levels
    # a chain is E(γ), by depth; a second sibling adds its own share, never the first's again
    assert expected_tokens(chain(3), [[0.8], [0.6], [0.5]]) == pytest.approx(E([.8, .6, .5], 3))
    assert expected_tokens(parse("-1,-1"), [[0.6, 0.2]]) == pytest.approx(1.8)
    assert expected_tokens(parse("-1,-1"), [[0.6]]) == pytest.approx(2.2)  # the last rank's rate reused


def test_a_tree_ceiling_charges_one_module_call_per_depth():
    """Drafting a tree runs one module call per depth whatever its nodes: 2x2 (6 nodes, 2 levels) pays 2r, as the
    chain of 2 does, by hand E = 1 + 0.8 + 0.8 · (0.5 + 0.5) = 2.6 over v + 2r; charging r per node (6r) fails."""
    a = [[0.6, 0.2], [0.5]]  # rank 1 at depth 2 reuses rank 0's rate
    assert ceiling(parse("2x2"), a, r=0.1, verify_cost=1.5) == pytest.approx(2.6 / (1.5 + 2 * 0.1))
    assert ceiling(parse("2x2"), a, r=0.1) != pytest.approx(2.6 / (1.0 + 6 * 0.1))
    # a chain-shaped tree's ceiling is the chain's
    alpha = [0.8, 0.6, 0.5]
    bound = ceiling(chain(3), [[x] for x in alpha], r=0.1, verify_cost=1.2)
    assert bound == pytest.approx(E(alpha, 3) / (1.2 + 3 * 0.1))


def test_choose_fastest_ranks_chains_and_trees_alike():
    """E / cost over any candidates: a tree wins where its round pays, a chain where the tree's costs more, plain
    within the margin."""
    t0, t1, t22 = chain(0), chain(1), parse("2x2")
    e = {t0: 1.0, t1: 1.6, t22: 2.55}
    assert choose_fastest(e, {t0: 1.0, t1: 1.3, t22: 1.5}) == t22  # 1.70 over 1.23
    assert choose_fastest(e, {t0: 1.0, t1: 1.3, t22: 2.2}) == t1  # 1.16 under 1.23
    assert choose_fastest(e, {t0: 1.0, t1: 1.58, t22: 2.5}, margin=1.05) == t0  # 1.01 and 1.02: within the margin


def test_choose_fastest_prefers_fewer_drafts_when_rounds_get_expensive():
    alpha = [0.9, 0.6]
    # cheap drafting (batch 1): two drafts pay off
    assert fastest(alpha, {1: 1.2, 2: 1.4}) == 2
    # verification compute-bound (batch 32): a round costs more than the tokens it yields -> plain decoding
    assert fastest(alpha, {1: 2.0, 2: 2.6}) == 0
    # in between: one draft
    assert fastest(alpha, {1: 1.3, 2: 2.5}) == 1
    # a tie goes to fewer drafts
    assert fastest([1.0], {1: 2.0}) == 0


def test_speedup_ceiling_is_the_best_round_at_floor_costs():
    c = speedup_ceiling([0.97, 0.62], 0.31, 2)
    assert c["by_gamma"][0] == 1.0
    assert c["by_gamma"][1] == pytest.approx(1.97 / 1.31)
    assert c["by_gamma"][2] == pytest.approx((1 + 0.97 + 0.97 * 0.62) / 1.62)
    assert c["gamma"] == 2 and c["max"] == pytest.approx(1.587, abs=1e-3) and c["max"] < 2
    # the cost model, handed the floor costs v = 1, c = r, picks the ceiling's γ (by hand: E(γ) / (1 + γr) is
    # 1.50, 1.09 for [0.5, 0.5] at r 0.3, and 1.81, 2.46, 2.99 for [0.9] * 3 at r 0.05)
    for alpha, r, best in (([0.97, 0.62], 0.31, 2), ([0.5, 0.5], 0.3, 1), ([0.9, 0.9, 0.9], 0.05, 3)):
        c = speedup_ceiling(alpha, r, len(alpha))
        assert fastest(alpha, {g: 1 + g * r for g in range(1, len(alpha) + 1)}) == c["gamma"] == best
    # a perfect drafter with free drafts gains γ+1
    assert speedup_ceiling([1.0], 0.0, 3)["max"] == 4.0


def test_the_ceiling_bounds_every_round_costing_at_least_its_floors():
    """decode.py --eval's speedup_ceiling, E/(1 + γr), is never below the speedup of a round whose verification
    costs v >= 1 plain steps and whose drafts cost c >= r each, for any α (trees alike, one call per depth)."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        g, r = rng.randint(1, 6), rng.uniform(0.01, 1.5)
        alpha = [rng.random() for _ in range(g)]
        v, c = 1 + rng.expovariate(1.0), r * (1 + rng.expovariate(2.0))
        assert E(alpha, g) / (v + g * c) <= ceiling(chain(g), by_position(alpha), r)
    tree, by = parse("2x2"), [[0.5, 0.3], [0.4, 0.2]]
    assert expected_tokens(tree, by) / (1.3 + 2 * 0.2) <= ceiling(tree, by, r=0.2)


def test_companion_a_ceiling_over_the_n_gram_round_s_v_is_no_bound():
    """Companion (issue 50's run: ceiling 0.81 beside a measured 1.11): dividing by the v the n-gram round measured
    (its lookup and bookkeeping included) instead of 1 falls below the MTP round it claims to bound."""
    alpha, r = [0.8], 0.3
    mtp_round = 1.3 + 1 * 0.32  # its verification 1.3 plain steps, its draft 0.32
    measured = E(alpha, 1) / mtp_round
    one = chain(1), by_position(alpha)
    assert round(ceiling(*one, r, verify_cost=1.92), 2) == 0.81 and round(measured, 2) == 1.11
    assert ceiling(*one, r, verify_cost=1.92) < measured <= ceiling(*one, r)


def test_constant_alpha_is_the_closed_form():
    for a in (0.0, 0.3, 0.8):
        for g in range(5):
            assert E([a], g) == pytest.approx((1 - a ** (g + 1)) / (1 - a))
    assert E([1.0], 4) == 5.0


def test_expected_tokens_is_jittable_and_is_the_training_metric():
    e = jax.jit(lambda a: E([a[0], a[1]], 2))(jnp.array([0.5, 0.5]))
    assert float(e) == pytest.approx(1.75)
    assert float(expected_accept_length([jnp.float32(0.9), jnp.float32(0.6)])) == pytest.approx(1 + 0.9 + 0.54)


def test_predicted_speedup_is_expected_tokens_over_the_round_cost():
    assert E([0.9, 0.6], 2) / 1.6 == pytest.approx((1 + 0.9 + 0.54) / 1.6)
    assert ceiling(chain(2), by_position([0.9, 0.6]), 0.3) == pytest.approx(2.44 / (1 + 2 * 0.3))  # 1 + 0.9 + 0.54
    # by hand: γ=1 gives 1.9 / 1.3 = 1.46, γ=2 gives 2.44 / 1.6 = 1.525 (plain: 1)
    assert fastest([0.9, 0.6], {1: 1.3, 2: 1.6}) == 2
    assert fastest([0.9, 0.6], {1: 1.3, 2: 1.7}) == 1  # γ=2: 2.44 / 1.7 = 1.435


# hand count (tests/conftest.py's SMALL config at T = 12): module 24064, head 2048, trunk 39936 FLOPs per row,
# of which attention over the 12 keys is 1536 per block (module and trunk blocks alike): not weights
MODULE, HEAD, TRUNK, ATTN = 24064, 2048, 39936, 1536


@pytest.mark.parametrize("proposer,rows", [
    (MTPChainProposer(chain(1)), (1 * 2, 0)),  # window γ+1 = 2 rows of module 1
    (MTPChainProposer(chain(2)), (2 * 3, 0)),  # modules 1 and 2, 3 rows each
    (MTPChainProposer(chain(3)), (2 * 4, 1)),  # modules 1 and 2 over 4 rows, then module 2 reused for one row
    (MTPChainProposer(chain(3), modules=1), (1 * 4, 2)),  # module 1 over 4 rows, then reused twice
])
def test_mtp_work_ratio_counts_the_window_rows(model_cfg, proposer, rows):
    window_rows, reuse_rows = rows
    G = proposer.tree.size
    want = ((window_rows + reuse_rows) * MODULE + G * HEAD) / (G * (TRUNK + HEAD))
    assert work_ratio(proposer, model_cfg(), 12) == pytest.approx(want)
    # each call reads its module once, whatever its rows: one module and one head per draft
    reads = (MODULE - ATTN + HEAD) / (TRUNK - 2 * ATTN + HEAD)
    assert weight_ratio(proposer, model_cfg(), 12) == pytest.approx(reads)
    assert floor_ratio(proposer, model_cfg(), 12) == pytest.approx(min(want, reads)) == pytest.approx(reads)


def test_draft_model_work_ratio_counts_its_catch_up_and_steps(model_cfg):
    draft = model_cfg(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, mtp_depth=0)
    d_trunk = 2 * 16 * 16 + 2 * 2 * 16 * 8 + 2 * 16 * 16 + 3 * 2 * 16 * 32 + 2 * 2 * 12 * 8 * 2  # one block, T = 12
    d_head = 2 * 16 * 32
    for G in (1, 3):
        prop = DraftModelProposer(chain(G, "model"))
        want = ((2 + G - 1) * d_trunk + G * d_head) / (G * (TRUNK + HEAD))
        assert work_ratio(prop, model_cfg(), 12, draft) == pytest.approx(want)
        reads = (d_trunk - 2 * 2 * 12 * 8 * 2 + d_head) / (TRUNK - 2 * ATTN + HEAD)  # γ calls, weights once each
        assert weight_ratio(prop, model_cfg(), 12, draft) == pytest.approx(reads)
    assert work_ratio(NgramProposer(chain(2, "ngram")), model_cfg(), 12) == 0.0
    assert work_ratio(Plain(), model_cfg(), 12) == 0.0


def test_a_deeper_trunk_makes_each_draft_relatively_cheaper(model_cfg):
    # a module is one block: r ~ 1/L
    r = [work_ratio(MTPChainProposer(chain(1)), model_cfg(n_layers=n), 12) for n in (2, 4, 8)]
    assert r[0] > r[1] > r[2] > 2 / 8


def test_ceiling_takes_a_ratio_per_gamma():
    c = speedup_ceiling([0.9], lambda g: 0.1 * g, 3)
    e = [1, 1.9, 2.71, 3.439]  # 1 + 0.9 + 0.81 + 0.729, term by term
    assert c["by_gamma"] == pytest.approx({g: e[g] / (1 + g * 0.1 * g) for g in range(4)})
