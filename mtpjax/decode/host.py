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
from mtpjax.decode.prompts import check_token_prompts
from mtpjax.decode.proposers import DRAFTERS, make_proposer
from mtpjax.decode.sampling import Sampler
from mtpjax.drafts import FORMS, PLAIN, Auto, DraftError, Tree, chain, parse
from mtpjax.errors import MtpjaxError
from mtpjax.nn.model import MTPTransformer

GREEDY = Sampler()  # the default sampler (a frozen dataclass, shared safely)


class DecodeError(MtpjaxError, ValueError):
    """Bad generation request (one line naming the problem and the fix)."""


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)
    draft: Tree | None = None  # what was drafted (auto: the tree it chose), as generate's `draft=` takes it


def draft_of(draft: Tree | Auto | str | int, proposer: str = "mtp") -> Tree | Auto:
    """The draft a caller gives (a Tree or Auto, or spelled as decode.draft: `auto`, `3`, `2x2+ngram3`) with its
    nodes given to `proposer`: the one reading of the Python spellings; DecodeError when malformed."""
    if proposer not in DRAFTERS:
        raise DecodeError(f"proposer={proposer!r} is unknown; use one of {', '.join(map(repr, DRAFTERS))}")
    if not isinstance(draft, (Tree, Auto)):
        if isinstance(draft, bool) or not isinstance(draft, (str, int, np.integer)):
            raise DecodeError(f"draft={draft!r} is not a draft; give one of {FORMS}")
        if not isinstance(draft, str) and draft < 0:  # str(-1) would read as the parent list "-1": one draft
            raise DecodeError(f"draft={draft} is not a count of drafts; give 0 (plain) or more, or one of {FORMS}")
        try:
            draft = parse(str(draft))
        except DraftError as e:
            raise DecodeError(str(e)) from None
    return draft if isinstance(draft, Auto) else draft.drafted_by(DRAFTERS[proposer].source)


def check_proposer(model: MTPTransformer, proposer: str, tree: Tree, draft_model: MTPTransformer | None) -> None:
    """DecodeError if this proposer cannot draft `tree` for this model (the empty tree needs no proposer)."""
    tree = draft_of(tree, proposer)
    if draft_model is not None and proposer != "model":
        raise DecodeError(f"a draft model drafts only with proposer='model', not {proposer!r}")
    if not DRAFTERS[proposer].trees and not tree.is_chain():
        raise DecodeError(f"a draft tree is drafted by the MTP modules (proposer mtp or mtp1), not {proposer!r}")
    if tree != PLAIN or proposer == "model":
        why = make_proposer(proposer, tree if tree != PLAIN else chain(1)).impossible(model, draft_model)
        if why:
            raise DecodeError(why)


def integer(name: str, value, *, least: int | None = None, none_ok: bool = False) -> int | None:
    """value as an int (a numpy integer too; not a bool, a float or a string), at least `least`; else DecodeError."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DecodeError(f"{name}={value!r} must be an integer{'' if least is None else f' >= {least}'}"
                          f"{' or None' if none_ok else ''}")
    if least is not None and value < least:
        raise DecodeError(f"{name}={value} must be >= {least}")
    if not -(2**63) <= value < 2**63:  # what JAX holds it in (a seed of 10**23 was an OverflowError traceback)
        raise DecodeError(f"{name}={value} must be between -2**63 and 2**63")
    return int(value)


def check_models(model, draft_model=None) -> None:
    """DecodeError unless model (and a draft_model given) is an MTPTransformer (a Generator's is its .model)."""
    for name, m in (("model", model), ("draft_model", draft_model)):
        if not isinstance(m, MTPTransformer) and (name == "model" or m is not None):
            hint = f"; a Generator's model is {name}.model" if hasattr(m, "tokenizer") else ""
            raise DecodeError(f"{name} is a {type(m).__name__}, not a model (mtpjax.load_model(run_dir)[1] or "
                              f"mtpjax.nn.model.build_model(cfg)){hint}")


def check_callback(on_commit) -> None:
    """DecodeError unless on_commit is None or callable."""
    if on_commit is not None and not callable(on_commit):
        raise DecodeError(f"on_commit={on_commit!r:.40} is not callable; pass a function f(tokens_BY, counts_B)")


def check_prompts(cfg, prompts) -> int:
    """The longest prompt's length; PromptError or DecodeError unless `prompts` is a non-empty batch of non-empty
    token-id sequences in the vocabulary."""
    check_token_prompts(prompts)
    if len(prompts) == 0 or any(len(p) == 0 for p in prompts):  # len: a 2-D array has no truth value
        raise DecodeError("empty prompt: every prompt needs at least one token")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
        raise DecodeError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    return max(len(p) for p in prompts)


def make_loop(model: MTPTransformer, prompts, *, max_new_tokens: int, draft: Tree | str | int = PLAIN,
              proposer: str = "mtp", sampler: Sampler = GREEDY, eos_id=None, max_len=None,
              draft_model: MTPTransformer | None = None, stream: bool = False) -> Loop:
    """Validate a request and fix the static shapes of its compiled loop, drafting the tree `draft` (draft_of)."""
    check_models(model, draft_model)
    tree = draft_of(draft, proposer)
    if isinstance(tree, Auto):
        raise DecodeError("a loop drafts a fixed tree; draft='auto' is generate's (it measures and picks one)")
    cfg = model.cfg
    longest = check_prompts(cfg, prompts)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, least=1)
    max_len, eos_id = integer("max_len", max_len, least=1, none_ok=True), integer("eos_id", eos_id, none_ok=True)
    if eos_id is not None and eos_id >= cfg.vocab_size:
        raise DecodeError(f"eos_id={eos_id} is outside the vocabulary [0, {cfg.vocab_size}): it would never stop a row")
    check_proposer(model, proposer, tree, draft_model)
    if max_len is not None and longest + max_new_tokens > max_len:
        raise DecodeError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the cache "
                          f"capacity max_len={max_len}; shorten the prompt or raise max_len (decode.py --max-len, "
                          "the config's decode.max_len)")
    prop = make_proposer(proposer, tree)
    size = rows(longest, max_new_tokens, prop.tree.size)
    return Loop(proposer=prop, sampler=sampler, max_new=max_new_tokens, capacity=size.capacity,
                prompt_pad=size.prompt_pad, eos_id=-1 if eos_id is None else eos_id, stream=stream)


def request(loop: Loop, prompts, seed: int = 0, budget: int | None = None) -> Request:
    """The traced inputs: padded prompts, lengths, per-row budget (<= loop.max_new, default max_new), key."""
    B, seed, budget = len(prompts), integer("seed", seed), integer("budget", budget, least=1, none_ok=True)
    tokens_BP = np.zeros((B, loop.prompt_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens_BP[i, : len(p)] = p
    plen_B = np.array([len(p) for p in prompts], np.int32)
    budget_B = np.full((B,), loop.max_new if budget is None else min(budget, loop.max_new), np.int32)
    return Request(tokens_BP=jnp.asarray(tokens_BP), plen_B=jnp.asarray(plen_B), budget_B=jnp.asarray(budget_B),
                   key=jax.random.key(seed), stream=jnp.int32(stream.NONE))


def execute_request(loop: Loop, model: MTPTransformer, req: Request, draft_model: MTPTransformer | None = None,
                    on_commit=None) -> DecodeState:
    """Run the compiled loop (compiled once per Loop and model structure) on a request."""
    check_callback(on_commit)
    gt, pt = nnx.split(model)
    gd, pd = nnx.split(draft_model) if draft_model is not None else (None, None)
    with stream.registered(on_commit) as sid:
        req = put(model.placement, req.replace(stream=jnp.int32(sid)), req.tokens_BP.shape[0])  # rows over data axes
        st = execute(loop, (gt, gd), (pt, pd), req)
        if on_commit is not None:
            jax.block_until_ready(st)
    return st


def run(model: MTPTransformer, prompts, loop: Loop, seed: int = 0, budget: int | None = None, *,
        draft_model: MTPTransformer | None = None, on_commit=None) -> DecodeState:
    """Compile (once per loop) and run the whole generation; returns the final DecodeState.

    `budget` (<= loop.max_new) caps the new tokens per row without recompiling. `on_commit(tokens_BY,
    counts_B)` receives each round's commits on the host (the loop must be built with stream=True); it is
    looked up by id at run time, so a new callback never recompiles.
    """
    if check_prompts(model.cfg, prompts) > loop.prompt_pad:
        raise DecodeError(f"a prompt of {max(map(len, prompts))} tokens is longer than this loop takes "
                          f"({loop.prompt_pad}); build a loop for these prompts: make_loop(model, prompts, ...)")
    if on_commit is not None and not loop.stream:
        raise DecodeError("on_commit needs a loop that emits its commits: build it with make_loop(..., stream=True)")
    return execute_request(loop, model, request(loop, prompts, seed, budget), draft_model, on_commit)


def summarize(st: DecodeState, tree: Tree) -> GenerateResult:
    """Tokens per row and acceptance statistics from a final state of a loop drafting `tree`: by node (the state's
    one counter), by depth (a depth's nodes summed), and the rounds that reached each depth (all, for the first;
    those that accepted the depth above, for the rest)."""
    seq_BS, n_B, plen_B = np.asarray(st.seq_BS), np.asarray(st.n_B), np.asarray(st.prompt_len_B)
    tokens = [seq_BS[b, plen_B[b]: n_B[b]].tolist() for b in range(len(n_B))]
    rounds = int(np.asarray(st.rounds_B).sum())
    by_node = np.asarray(st.accepted_BG).sum(0)
    accepted = [int(sum(by_node[v] for v in tree.at_depth(d, d))) for d in range(1, tree.max_depth + 1)]
    reached = [rounds, *accepted[:-1]][: len(accepted)]
    generated = int((n_B - plen_B).sum())
    alpha = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    stats = {"rounds": rounds, "generated": generated,
             # the first token comes from the prefill, not from a round
             "tokens_per_round": (generated - len(n_B)) / rounds if rounds else 0.0,
             "acceptance_by_position": alpha, "accepted": accepted, "reached": reached,
             "accepted_by_node": by_node.tolist()}
    return GenerateResult(tokens=tokens, stats=stats)
