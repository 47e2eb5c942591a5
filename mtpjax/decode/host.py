"""Between the caller and the compiled loop: request checks, the loop's static shapes, inputs, results."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtpjax.decode import stream
from mtpjax.decode.cache import rows
from mtpjax.decode.loop import DecodeState, Loop, Request, execute
from mtpjax.decode.mesh import put
from mtpjax.decode.proposers import PROPOSERS, make_proposer
from mtpjax.decode.sampling import Sampler
from mtpjax.config.specs import Auto, DraftSpec, parse_num_draft, parse_shape
from mtpjax.decode.tree import PLAIN, Hybrid, Tree, TreeError, chain_tree as chain
from mtpjax.errors import MtpjaxError
from mtpjax.nn.model import MTPTransformer

GREEDY = Sampler()  # the default sampler (a frozen dataclass, shared safely)


class DecodeError(MtpjaxError, ValueError):
    """Bad generation request (one line naming the problem and the fix)."""


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)
    shape: Tree | Hybrid | None = None  # what was drafted (auto: the shape it chose), as generate's `shape=` takes it


def shape_of(num_draft: int | str = 0, tree: str | Tree | Hybrid | None = None) -> DraftSpec:
    """The draft a caller spells as num_draft (γ, or "auto") or tree (`2x2`, `2x2+ngram3`, or a Tree/Hybrid): the
    one reading of the Python spellings; DecodeError when both are given or either is malformed."""
    if tree is not None:
        if num_draft not in (0, None):
            raise DecodeError(f"num_draft={num_draft!r} and tree={tree!r} both say how much to draft; give one of them")
        try:
            return parse_shape(tree) if isinstance(tree, str) else tree
        except TreeError as e:
            raise DecodeError(str(e)) from None
    try:
        return parse_num_draft(int(num_draft) if isinstance(num_draft, np.integer) else num_draft)
    except ValueError:
        raise DecodeError(f"num_draft={num_draft!r} must be an integer >= 0 or 'auto'") from None


def check_proposer(model: MTPTransformer, proposer: str, shape: Tree | Hybrid, draft: MTPTransformer | None) -> None:
    """DecodeError if this proposer cannot draft `shape` for this model (the empty tree needs no proposer)."""
    if proposer not in PROPOSERS:
        raise DecodeError(f"proposer={proposer!r} is unknown; use one of {', '.join(map(repr, PROPOSERS))}")
    if draft is not None and proposer != "model":
        raise DecodeError(f"a draft model drafts only with proposer='model', not {proposer!r}")
    kind = PROPOSERS[proposer]
    if not kind.TREES and (isinstance(shape, Hybrid) or not shape.is_chain()):
        raise DecodeError(f"a draft tree is drafted by the MTP modules (proposer mtp or mtp1), not {proposer!r}")
    if shape != PLAIN or proposer == "model":
        problem = kind.of(shape if shape != PLAIN else chain(1)).problem(model, draft)
        if problem:
            raise DecodeError(problem)


def make_loop(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int = 0, proposer: str = "mtp",
              sampler: Sampler = GREEDY, eos_id=None, max_len=None, draft: MTPTransformer | None = None,
              stream: bool = False, tree: str | Tree | Hybrid | None = None) -> Loop:
    """Validate a request and fix the static shapes of its compiled loop: the drafts are a chain of num_draft or
    `tree` (`2x2x1`, a parent list, `+ngramL`; a Tree or Hybrid), read once by shape_of."""
    shape = shape_of(num_draft, tree)
    if isinstance(shape, Auto):
        raise DecodeError("a loop drafts a fixed shape; num_draft='auto' is generate's (it measures and picks one)")
    cfg = model.cfg
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DecodeError("empty prompt: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens={max_new_tokens} must be >= 1")
    check_proposer(model, proposer, shape, draft)
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise DecodeError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    longest = max(len(p) for p in prompts)
    if max_len is not None and longest + max_new_tokens > max_len:
        raise DecodeError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the cache "
                          f"capacity max_len={max_len}; shorten the prompt or raise decode.max_len")
    prop = make_proposer(proposer, shape)
    size = rows(longest, max_new_tokens, len(prop.parents()))
    return Loop(proposer=prop, sampler=sampler, max_new=max_new_tokens, capacity=size.capacity,
                prompt_pad=size.prompt_pad, eos_id=-1 if eos_id is None else int(eos_id), stream=stream)


def request(loop: Loop, prompts, seed: int = 0, budget: int | None = None) -> Request:
    """The traced inputs: padded prompts, lengths, per-row budget (<= loop.max_new, default max_new), key."""
    B = len(prompts)
    tokens_BP = np.zeros((B, loop.prompt_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens_BP[i, : len(p)] = p
    plen_B = np.array([len(p) for p in prompts], np.int32)
    budget_B = np.full((B,), loop.max_new if budget is None else min(max(1, budget), loop.max_new), np.int32)
    return Request(tokens_BP=jnp.asarray(tokens_BP), plen_B=jnp.asarray(plen_B), budget_B=jnp.asarray(budget_B),
                   key=jax.random.key(seed), stream=jnp.int32(stream.NONE))


def execute_request(loop: Loop, model: MTPTransformer, req: Request, draft: MTPTransformer | None = None,
                    on_commit=None) -> DecodeState:
    """Run the compiled loop (compiled once per Loop and model structure) on a request."""
    gt, pt = nnx.split(model)
    gd, pd = nnx.split(draft) if draft is not None else (None, None)
    with stream.registered(on_commit) as sid:
        req = put(model.placement, req.replace(stream=jnp.int32(sid)), req.tokens_BP.shape[0])  # rows over data axes
        st = execute(loop, (gt, gd), (pt, pd), req)
        if on_commit is not None:
            jax.block_until_ready(st)
    return st


def run(model: MTPTransformer, prompts, loop: Loop, seed: int = 0, budget: int | None = None, *,
        draft: MTPTransformer | None = None, on_commit=None) -> DecodeState:
    """Compile (once per loop) and run the whole generation; returns the final DecodeState.

    `budget` (<= loop.max_new) caps the new tokens per row without recompiling. `on_commit(tokens_BY,
    counts_B)` receives each round's commits on the host (the loop must be built with stream=True); it is
    looked up by id at run time, so a new callback never recompiles.
    """
    return execute_request(loop, model, request(loop, prompts, seed, budget), draft, on_commit)


def summarize(st: DecodeState) -> GenerateResult:
    """Tokens per row and acceptance statistics from a final state."""
    seq_BS, n_B, plen_B = np.asarray(st.seq_BS), np.asarray(st.n_B), np.asarray(st.prompt_len_B)
    tokens = [seq_BS[b, plen_B[b]: n_B[b]].tolist() for b in range(len(n_B))]
    rounds = int(np.asarray(st.rounds_B).sum())
    reached_G = np.asarray(st.reached_BG).sum(0)
    accepted_G = np.asarray(st.accepted_BG).sum(0)
    generated = int((n_B - plen_B).sum())
    alpha = [float(a / r) if r else 0.0 for a, r in zip(accepted_G, reached_G)]
    stats = {"rounds": rounds, "generated": generated,
             # the first token comes from the prefill, not from a round
             "tokens_per_round": (generated - len(n_B)) / rounds if rounds else 0.0,
             "acceptance_by_position": alpha, "accepted": accepted_G.tolist(), "reached": reached_G.tolist(),
             "accepted_by_node": np.asarray(st.accepted_nodes_BG).sum(0).tolist()}
    return GenerateResult(tokens=tokens, stats=stats)
