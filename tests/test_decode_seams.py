"""The decoder's seams: the proposer contract (mtpjax.decode.protocol) and the one rule sizing its caches."""

import dataclasses
import inspect

import jax
import pytest
from flax import nnx

from mtpjax.decode.cache import AttentionCaches, cache_bytes, rows
from mtpjax.decode.host import make_loop, request
from mtpjax.decode.mtp_proposers import MTPChainProposer
from mtpjax.decode.proposers import DRAFTERS, Plain
from mtpjax.decode.protocol import Models, Proposer
from mtpjax.drafts import chain
from mtpjax.nn.flops import TokenFlops, flops_per_token
from mtpjax.nn.model import build_model

CONTRACT = [n for n, f in inspect.getmembers(Proposer, inspect.isfunction) if not n.startswith("_")]


@pytest.mark.parametrize("make", [*(lambda g, k=k: k.proposer(chain(g, k.source)) for k in DRAFTERS.values()),
                                  lambda g: Plain()])
def test_every_proposer_implements_the_contract_and_drafts_chains(make):
    p = make(3)
    assert {"impossible", "start", "step", "draft_flops", "draft_reads"} <= set(CONTRACT)
    for name in set(CONTRACT):  # written by the proposer, not the protocol's empty stub
        assert getattr(type(p), name) is not getattr(Proposer, name), name
    assert p.tree.is_chain() and chain(3).parents == (-1, 0, 1)
    hash(p)  # static: part of the compiled loop's hash


def test_the_loop_verifies_the_tree_parents_describes(model_cfg):
    """The loop verifies whatever tree its proposer drafts: a chain for the chain proposers, a tree's nodes for
    decode.draft, whose rows the one capacity rule counts."""
    model = build_model(model_cfg())
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=4, draft=2)
    assert loop.tree == chain(2) and loop.tree.is_chain()
    tree = make_loop(model, [[1, 2, 3]], max_new_tokens=4, draft="2x2x1")
    assert tree.tree == tree.proposer.tree and tree.tree.size == 10 and not tree.tree.is_chain()
    assert tree.capacity == rows(3, 4, 10).capacity


def test_draft_costs_read_the_typed_record(model_cfg):
    """TokenFlops holds flops_per_token's counts under names; an MTP round's work is counted from them."""
    cfg = model_cfg()
    f, d = TokenFlops.per_token(cfg, 12), flops_per_token(cfg, 12)
    assert (f.trunk, f.trunk_matmul, f.module, f.module_matmul, f.head, f.mtp_depth) == (
        d["trunk"], d["trunk_matmul"], d["mtp_module"], d["mtp_module_matmul"], d["head"], cfg.mtp_depth)
    # two modules over 3 rows each
    assert MTPChainProposer(chain(2)).draft_flops(f, None) == 2 * 3 * f.module + 2 * f.head


def _allocated_bytes(model, loop, prompts) -> int:
    """Bytes of the caches a generation's prefill allocates: the trunk's and the proposer's state."""
    graphdef, params = nnx.split(model)
    req = request(loop, prompts)
    st = jax.eval_shape(lambda p, r: loop.prefill(Models(nnx.merge(graphdef, p)), r), params, req)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((st.trunk, st.proposer)))


MLA = dict(attention_kind="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=8)


@pytest.mark.parametrize("mtp_depth,draft,attention", [(2, 2, {}), (2, 3, {}), (0, 0, {}), (2, 2, MLA),
                                                       (2, "3x3x1", {})])
def test_one_rule_sizes_the_caches_the_loop_allocates(model_cfg, mtp_depth, draft, attention):
    """make_loop's capacity and decode.py's memory check come from cache.rows and cache.cache_bytes, which count
    exactly what the loop allocates (trunk keys/values, each module's, the trunk's hidden rows MTP drafting keeps)."""
    model = build_model(model_cfg(mtp_depth=mtp_depth, **attention))
    prompts = [[1, 2, 3], [4] * 20]
    loop = make_loop(model, prompts, max_new_tokens=7, draft=draft, proposer="mtp" if mtp_depth else "ngram")
    size = rows(20, 7, loop.tree.size)
    assert (loop.prompt_pad, loop.capacity) == (size.prompt_pad, size.capacity) == (32, 128 if draft == "3x3x1" else 64)
    assert _allocated_bytes(model, loop, prompts) == cache_bytes(model.cfg, 2, loop.capacity)


def test_companion_a_layout_that_forgets_a_part_misses_the_allocation(model_cfg):
    """Counting the trunk's keys and values alone (modules and hidden rows forgotten) misses what is allocated."""

    @dataclasses.dataclass(frozen=True)
    class TrunkOnly(AttentionCaches):
        def bytes_per_row(self, cfg) -> int:
            return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.resolved_head_dim * 4

    model = build_model(model_cfg())
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=7, draft=2)
    assert _allocated_bytes(model, loop, [[1, 2, 3]]) != cache_bytes(model.cfg, 1, loop.capacity, TrunkOnly())
