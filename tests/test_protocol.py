"""The proposer contract (mtpjax.decode.protocol): every proposer keeps it; the loop refuses what it cannot verify."""

import dataclasses
import inspect

import pytest

from mtpjax.decode.host import make_loop
from mtpjax.decode.proposers import PROPOSERS, MTPProposer, Plain
from mtpjax.decode.protocol import Proposer, chain
from mtpjax.nn.flops import TokenFlops, flops_per_token
from mtpjax.nn.model import build_model

CONTRACT = [n for n, f in inspect.getmembers(Proposer, inspect.isfunction) if not n.startswith("_")]


@pytest.mark.parametrize("make", [*PROPOSERS.values(), lambda g: Plain()])
def test_every_proposer_implements_the_contract_and_drafts_chains(make):
    p = make(3)
    assert {"problem", "most_drafts", "start", "step", "parents", "draft_flops", "draft_reads"} <= set(CONTRACT)
    for name in set(CONTRACT) - {"parents"}:  # written by the proposer, not the protocol's empty stub
        assert getattr(type(p), name) is not getattr(Proposer, name), name
    assert p.parents() == chain(p.num_draft) and chain(3) == (-1, 0, 1)
    hash(p)  # static: part of the compiled loop's hash


@dataclasses.dataclass(frozen=True)
class TwoRoots(MTPProposer):
    """Two alternatives for the next token: a tree, not a chain."""

    def parents(self) -> tuple[int, ...]:
        return (-1, -1)


@pytest.mark.parametrize("proposer", [MTPProposer(2), TwoRoots(2)])
def test_the_loop_verifies_chains_and_refuses_trees(model_cfg, proposer):
    """A tree draft is refused in one line before anything compiles; the same γ as a chain (companion) is taken."""
    model = build_model(model_cfg())
    loop = make_loop(model, [[1, 2, 3]], max_new_tokens=4, num_draft=2)
    if proposer.parents() == chain(2):
        assert dataclasses.replace(loop, proposer=proposer).proposer == proposer
    else:
        with pytest.raises(ValueError, match="verifies chains only"):
            dataclasses.replace(loop, proposer=proposer)


def test_draft_costs_read_the_typed_record(model_cfg):
    """TokenFlops holds flops_per_token's counts under names; an MTP round's work is counted from them."""
    cfg = model_cfg()
    f, d = TokenFlops.of(cfg, 12), flops_per_token(cfg, 12)
    assert (f.trunk, f.trunk_matmul, f.module, f.module_matmul, f.head, f.mtp_depth) == (
        d["trunk"], d["trunk_matmul"], d["mtp_module"], d["mtp_module_matmul"], d["head"], cfg.mtp_depth)
    assert MTPProposer(2).draft_flops(f, None) == 2 * 3 * f.module + 2 * f.head  # two modules over 3 rows each
