"""`generate`: the one call that checks a request, picks what to draft (if asked to), streams, and returns tokens
and stats."""

from __future__ import annotations

from mtpjax.decode import autodraft
from mtpjax.decode.host import DecodeError, GenerateResult, check_proposer, make_loop, run, shape_of, summarize
from mtpjax.decode.sampling import make_sampler
from mtpjax.decode.tree import Auto, DraftSpec, Hybrid, Tree, acceptance_by_depth_rank, chain_tree
from mtpjax.nn.model import MTPTransformer


def generate(model: MTPTransformer, prompts, *, max_new_tokens: int, num_draft: int | str = 0, proposer: str = "mtp",
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             eos_id: int | None = None, max_len: int | None = None, on_commit=None,
             calibrations: autodraft.SavedCalibrations | None = None,
             draft: MTPTransformer | None = None, progress=None, plain_first: bool = False,
             tree: str | Tree | Hybrid | None = None, shape: DraftSpec | None = None) -> GenerateResult:
    """Generate up to max_new_tokens per prompt (lists of token ids of any lengths), speculatively if it drafts.

    What to draft is `shape` (a Tree, a Hybrid or Auto: config.specs), or spelled as num_draft (γ, or "auto") or
    tree (`2x2x1`, a parent list `-1,-1,0,0`, `+ngramL`: n-gram lookup's L drafts as one more branch), read once by
    host.shape_of. proposer: "mtp" (module k drafts depth k), "mtp1" (module 1 drafts every depth), "ngram" (prompt
    lookup) or "model" (`draft`, a model of the same vocabulary); trees are the MTP modules'. Auto measures plain,
    chains and the small trees of autodraft.TREES on these prompts and uses the fastest by the cost model;
    stats["num_draft"] (and stats["tree"] for a tree) says which, stats["calibration"] why. `calibrations`: saved
    measurements to reuse and extend; `progress(text)` hears what is measured. plain_first: a request shape with no
    measurement yet decodes plain and is measured after (stats["calibration"]["source"] "after"), so no request
    waits on a probe. `on_commit(tokens_BY, counts_B)` receives each round's commits on the host (streaming)
    without recompiling.
    """
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

    cal, after = None, False
    if isinstance(shape, Auto):
        check_proposer(model, proposer, chain_tree(1), draft)
        choice, cal = autodraft.resolve(model, prompts, by_candidate, proposer, seed, calibrations, draft=draft,
                                        progress=progress, measure=not plain_first)
        shape, after = autodraft.shape(choice), cal is None
    loop = loop_for(shape)
    res = summarize(run(model, prompts, loop, seed, draft=draft, on_commit=on_commit))
    res.stats["num_draft"] = loop.num_draft
    if isinstance(shape, Hybrid) or not shape.is_chain():
        by = acceptance_by_depth_rank(loop.tree, res.stats["accepted_by_node"], res.stats["reached"])
        res.stats.update(tree=loop.proposer.name(), acceptance_by_depth_rank=by)
    if after:  # measured now that the output is out, for the next request of this shape
        _, cal = autodraft.resolve(model, prompts, by_candidate, proposer, seed, calibrations, draft=draft,
                                   progress=progress)
    if cal is not None:
        res.stats["calibration"] = {**cal.as_dict(), **({"source": "after"} if after else {})}
    return res
