"""`generate`: the one call that checks a request, picks what to draft (if asked to), streams, and returns tokens
and stats."""

from __future__ import annotations

import functools

from mtpjax.decode import autodraft, firstguess
from mtpjax.decode.host import DecodeError, GenerateResult, check_proposer, make_loop, run, shape_of, summarize
from mtpjax.decode.prompts import check_token_prompts
from mtpjax.decode.sampling import make_sampler
from mtpjax.decode.tree import Auto, DraftSpec, Hybrid, Tree, acceptance_by_depth_rank, chain_tree
from mtpjax.nn.model import MTPTransformer


def generate(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int | str = 0, proposer: str = "mtp",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, max_len: int | None = None, on_commit=None,
             calibrations: autodraft.SavedCalibrations | None = None,
             draft: MTPTransformer | None = None, progress=None, plain_first: bool = False,
             tree: str | Tree | Hybrid | None = None, shape: DraftSpec | None = None,
             first_guess=None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt (lists of token ids of any lengths), speculatively if it drafts.

    What to draft is `shape` (a Tree, a Hybrid or Auto: config.specs), or spelled as num_draft (γ, or "auto") or
    tree (`2x2x1`, a parent list `-1,-1,0,0`, `+ngramL`: n-gram lookup's L drafts as one more branch), read once by
    host.shape_of. proposer: "mtp" (module k drafts depth k), "mtp1" (module 1 drafts every depth), "ngram" (prompt
    lookup) or "model" (`draft`, a model of the same vocabulary); trees are the MTP modules'. Auto measures plain,
    chains and the small trees of autodraft.TREES on these prompts and uses the fastest by the cost model;
    stats["num_draft"] (and stats["tree"] for a tree) says which, stats["calibration"] why. `calibrations`: saved
    measurements to reuse and extend; `progress(text)` hears what is measured. plain_first: a request shape with no
    measurement yet decodes first and is measured after (stats["calibration"]["source"] "after"): plain, or with
    first_guess (α by draft position, e.g. training's agreement) the chain the cost model predicts fastest
    (mtpjax.decode.firstguess; stats["first_guess"]). `on_commit(tokens_BY, counts_B)` hears each round's commits.
    """
    check_token_prompts(prompts)
    try:
        sampler = make_sampler(temperature, top_k, top_p)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    shape = shape_of(num_draft, tree) if shape is None else shape

    def loop_for(s: Tree | Hybrid):
        return make_loop(model, prompts, max_new_tokens=max_new_tokens, proposer=proposer, sampler=sampler,
                         eos_id=eos_id, max_len=max_len, draft=draft, stream=on_commit is not None, tree=s)

    def by_candidate(c: int | str):  # auto's candidates as its calibration records spell them
        return loop_for(autodraft.shape(c))

    resolve = functools.partial(autodraft.resolve, model, prompts, by_candidate, proposer, seed, calibrations,
                                draft=draft, progress=progress)
    cal, after = None, False
    if isinstance(shape, Auto):
        check_proposer(model, proposer, chain_tree(1), draft)
        guess = None if first_guess is None else (
            lambda: firstguess.estimate(model, prompts, max_new_tokens, proposer, first_guess, draft))
        choice, cal = resolve(measure=not plain_first, guess=guess)
        shape, after = autodraft.shape(choice), cal is None or cal.source == "estimate"
    loop = loop_for(shape)
    res = summarize(run(model, prompts, loop, seed, draft=draft, on_commit=on_commit))
    if after:  # measured now that the output is out, for the next request of this shape
        if cal is not None:
            res.stats["first_guess"] = cal.as_dict()
        _, cal = resolve()
    return _described(res, loop, shape, cal, after)


def _described(res: GenerateResult, loop, shape: Tree | Hybrid, cal, after: bool) -> GenerateResult:
    """res with what was drafted (a tree's acceptance by depth and rank) and, when auto chose, why."""
    res.shape = shape
    res.stats["num_draft"] = loop.num_draft
    if isinstance(shape, Hybrid) or not shape.is_chain():
        by = acceptance_by_depth_rank(loop.tree, res.stats["accepted_by_node"], res.stats["reached"])
        res.stats.update(tree=loop.proposer.name(), acceptance_by_depth_rank=by)
    if cal is not None:
        res.stats["calibration"] = {**cal.as_dict(), **({"source": "after"} if after else {})}
    return res
