"""`generate`: the one call that checks a request, picks γ (if asked to), streams, and returns tokens and stats."""

from __future__ import annotations

import numpy as np

from mtpjax.decode import autodraft, firstguess
from mtpjax.decode.host import DecodeError, GenerateResult, check_proposer, make_loop, run, summarize
from mtpjax.decode.prompts import check_token_prompts
from mtpjax.decode.sampling import make_sampler
from mtpjax.decode.tree import Tree, acceptance_by_depth_rank
from mtpjax.nn.model import MTPTransformer


def generate(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int | str = 0, proposer: str = "mtp",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, max_len: int | None = None, on_commit=None,
             calibrations: autodraft.SavedCalibrations | None = None,
             draft: MTPTransformer | None = None, progress=None, plain_first: bool = False,
             tree: str | Tree | None = None, first_guess=None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt (lists of token ids of any lengths), speculatively if num_draft>0.

    proposer: "mtp" (the model's MTP modules, module k drafting token k), "mtp1" (module 1 drafting every
    token), "ngram" (prompt lookup) or "model" (`draft`, an independent model with the same vocabulary).
    num_draft="auto" measures every candidate (plain, chains of γ, and for the MTP modules the small trees of
    autodraft.TREES) on these prompts and uses the fastest by the cost model (mtpjax.decode.autodraft);
    stats["num_draft"] (and stats["tree"] when a tree won) says which, stats["calibration"] why. With
    `calibrations`, a measurement saved there for this machine and request shape is reused, and a new one is
    saved; `progress(text)` hears what a calibration measures. plain_first:
    a request shape with no measurement yet decodes first and is measured after (stats["calibration"]["source"]
    is "after"; the next request of that shape uses it), so a first request never waits on a probe; it decodes
    plain, or with first_guess (α by draft position, e.g. training's agreement) the chain the cost model predicts
    fastest (mtpjax.decode.firstguess; stats["first_guess"] says which and why).
    tree: a static draft tree instead of a chain (`2x2x1`: children per node at each depth, or a parent list
    `-1,-1,0,0`), drafted by the MTP modules, `+ngramL` adding n-gram lookup's L drafts as one more branch
    (hybrid); stats["tree"] names it.
    `on_commit(tokens_BY, counts_B)` receives every round's
    committed tokens on the host (streaming); it never causes a recompilation.
    """
    check_token_prompts(prompts)
    try:
        sampler = make_sampler(temperature, top_k, top_p)
    except ValueError as e:
        raise DecodeError(str(e)) from None

    def loop_for(g: int | str):  # a chain's γ, or (auto's candidates) a tree's shape
        shape = g if isinstance(g, str) else tree
        return make_loop(model, prompts, max_new_tokens=max_new_tokens, num_draft=0 if isinstance(g, str) else g,
                         proposer=proposer, sampler=sampler, eos_id=eos_id, max_len=max_len, draft=draft,
                         stream=on_commit is not None, tree=shape)

    cal, after, first = None, False, None
    if num_draft == "auto":
        if tree is not None:
            raise DecodeError(f"num_draft='auto' and tree={tree!r} both say how much to draft; give one of them")
        check_proposer(model, proposer, 1, draft)
        guess = None if first_guess is None else (
            lambda: firstguess.estimate(model, prompts, max_new_tokens, proposer, first_guess, draft))
        num_draft, cal = autodraft.resolve(model, prompts, loop_for, proposer, seed, calibrations, draft=draft,
                                            progress=progress, measure=not plain_first, guess=guess)
        after, first = cal is None or cal.source == "estimate", cal
    elif isinstance(num_draft, bool) or not isinstance(num_draft, (int, np.integer)):
        raise DecodeError(f"num_draft={num_draft!r} must be an integer >= 0 or 'auto'")
    loop = loop_for(num_draft if isinstance(num_draft, str) else int(num_draft))
    res = summarize(run(model, prompts, loop, seed, draft=draft, on_commit=on_commit))
    res.stats["num_draft"] = loop.num_draft
    if tree is not None or isinstance(num_draft, str):
        by = acceptance_by_depth_rank(loop.tree, res.stats["accepted_by_node"], res.stats["reached"])
        res.stats.update(tree=loop.proposer.name(), acceptance_by_depth_rank=by)
    if after and first is not None:
        res.stats["first_guess"] = first.as_dict()
    if after:  # measured now that the output is out, for the next request of this shape
        _, cal = autodraft.resolve(model, prompts, loop_for, proposer, seed, calibrations, draft=draft,
                                   progress=progress)
    if cal is not None:
        res.stats["calibration"] = {**cal.as_dict(), **({"source": "after"} if after else {})}
    return res
