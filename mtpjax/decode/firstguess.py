"""A request shape's first choice, before anything was timed: the cost model on acceptance measured in training.

`num_draft="auto"` times its candidates on the request (mtpjax.decode.autodraft), and a first timing costs
compiling every candidate's loop, so decode.py does not wait on it: it decodes first and measures after. What it
decodes with then is this estimate, not plain decoding: α by draft position from the run's own evaluation
(training's `agreement/mtp_k`), a round of γ drafts costing 1 + γr plain steps with r a draft's floor
(`nn.speed.floor_ratio`: free verification and a draft's cheaper share of a step, the regime where a decode step
waits on memory). It is the ceiling's optimism: where a step is compute-bound (a small model in a CPU's cache) the
measurement that follows corrects it for the next request of that shape.
"""

from __future__ import annotations

import numpy as np

from mtpjax.decode import autodraft
from mtpjax.decode.proposers import make_proposer
from mtpjax.decode.tree import chain_tree
from mtpjax.nn.speed import expected_tokens, floor_ratio


def decode_context(prompts, max_new: int) -> int:
    """Mean context length while decoding these prompts max_new tokens further (for speed.work_ratio)."""
    return int(np.mean([len(p) for p in prompts])) + max_new // 2


def estimate(model, prompts, max_new: int, proposer: str, alpha_by_position, draft=None) -> autodraft.Calibration:
    """The chain the cost model predicts fastest (0: plain) from `alpha_by_position` and each draft's floor r."""
    context = decode_context(prompts, max_new)
    dcfg = None if draft is None else draft.cfg
    chains = [c for c in autodraft.candidates(model, proposer, draft) if isinstance(c, int)]
    cost = {g: 1.0 + (g * floor_ratio(make_proposer(proposer, chain_tree(g)), model.cfg, context, dcfg) if g else 0.0)
            for g in chains}
    alpha = [float(a) for a in alpha_by_position]
    return autodraft.Calibration(num_draft=int(autodraft.choose(alpha, cost)), round_cost=cost,
                                 alpha_by_position=alpha, expected_tokens={g: expected_tokens(alpha, g) for g in cost},
                                 source="estimate")
