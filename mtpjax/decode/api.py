"""`generate`: the one call that checks a request, picks what to draft (if asked to), streams, and returns tokens
and stats."""

from __future__ import annotations

import functools
import numbers

from mtpjax.decode import autodraft, firstguess
from mtpjax.decode.host import (DecodeError, GenerateResult, check_callback, check_models, check_proposer, draft_of,
                                make_loop, run, summarize)
from mtpjax.decode.prompts import check_token_prompts
from mtpjax.decode.sampling import make_sampler
from mtpjax.decode.tree import acceptance_by_depth_rank
from mtpjax.drafts import PLAIN, Auto, Tree, chain
from mtpjax.nn.model import MTPTransformer


def generate(model: MTPTransformer, prompts, *, max_new_tokens: int, draft: Tree | Auto | str | int = PLAIN,
             proposer: str = "mtp", temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, eos_id: int | None = None, max_len: int | None = None, on_commit=None,
             calibrations: autodraft.SavedCalibrations | None = None, draft_model: MTPTransformer | None = None,
             progress=None, plain_first: bool = False, first_guess=None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt (lists of token ids of any lengths), speculatively if it drafts.

    What to draft is `draft`: a mtpjax.drafts Tree or Auto, or spelled as decode.draft is (`0` plain, `3` a chain,
    `2x2x1`, `-1,-1,0,0`, `2x2+ngram3`, `auto`), read once by host.draft_of. proposer: "mtp" (module k drafts depth
    k), "mtp1" (module 1 drafts every depth), "ngram" (prompt lookup) or "model" (`draft_model`, a model of the same
    vocabulary); trees are the MTP modules'. Auto measures plain, chains and the small trees of autodraft.PROBED_TREES
    on these prompts and uses the fastest by the cost model; res.draft and stats["draft"] say which,
    stats["calibration"] why. `calibrations`: saved measurements to reuse and extend; `progress(text)` hears what is
    measured. plain_first: a request shape with no measurement yet decodes first and is measured after
    (stats["calibration"]["source"] "after"): plain, or with first_guess (α by draft position, e.g. training's
    agreement) the chain the cost model predicts fastest (mtpjax.decode.firstguess; stats["first_guess"]).
    `on_commit(tokens_BY, counts_B)` hears each round's commits.
    """
    check_token_prompts(prompts)
    check_models(model, draft_model)
    check_callback(on_commit)
    _check_auto_arguments(calibrations, progress, first_guess)
    try:
        sampler = make_sampler(temperature, top_k, top_p)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    tree = draft_of(draft, proposer)

    def loop_for(t: Tree):
        return make_loop(model, prompts, max_new_tokens=max_new_tokens, proposer=proposer, sampler=sampler,
                         eos_id=eos_id, max_len=max_len, draft_model=draft_model, stream=on_commit is not None,
                         draft=t)

    resolve = functools.partial(autodraft.resolve, model, prompts, loop_for, proposer, seed, calibrations,
                                draft_model=draft_model, progress=progress)
    cal, after = None, False
    if isinstance(tree, Auto):
        check_proposer(model, proposer, chain(1), draft_model)
        guess = None if first_guess is None else (
            lambda: firstguess.estimate(model, prompts, max_new_tokens, proposer, first_guess, draft_model))
        tree, cal = resolve(measure=not plain_first, guess=guess)
        after = cal is None or cal.source == "estimate"
    loop = loop_for(tree)
    res = summarize(run(model, prompts, loop, seed, draft_model=draft_model, on_commit=on_commit), loop.tree)
    if after:  # measured now that the output is out, for the next request of this shape
        if cal is not None:
            res.stats["first_guess"] = cal.as_dict()
        _, cal = resolve()
    return _described(res, loop, cal, after)


def _check_auto_arguments(calibrations, progress, first_guess) -> None:
    """DecodeError unless calibrations is a SavedCalibrations, progress callable and first_guess rates in [0, 1]
    (each may be None)."""
    if calibrations is not None and not isinstance(calibrations, autodraft.SavedCalibrations):
        raise DecodeError(f"calibrations={calibrations!r:.40} is not a mtpjax.decode.autodraft.SavedCalibrations("
                          "path, tag)")
    if progress is not None and not callable(progress):
        raise DecodeError(f"progress={progress!r:.40} is not callable; pass a function f(text)")
    rates = first_guess if isinstance(first_guess, (list, tuple)) else None
    if first_guess is not None and (rates is None or not all(
            isinstance(a, numbers.Real) and not isinstance(a, bool) and 0 <= a <= 1 for a in rates)):
        raise DecodeError(f"first_guess={first_guess!r:.40} must be a list of acceptance rates in [0, 1] by draft "
                          "position, e.g. [0.6, 0.4]")


def _described(res: GenerateResult, loop, cal, after: bool) -> GenerateResult:
    """res with what was drafted (a tree's acceptance by depth and rank) and, when auto chose, why."""
    res.draft = loop.tree
    res.stats["draft"] = loop.tree.name()
    res.stats["drafts"] = loop.tree.size
    if not loop.tree.is_chain():
        res.stats["acceptance_by_depth_rank"] = acceptance_by_depth_rank(loop.tree, res.stats["accepted_by_node"],
                                                                         res.stats["reached"])
    if cal is not None:
        res.stats["calibration"] = {**cal.as_dict(), **({"source": "after"} if after else {})}
    return res
