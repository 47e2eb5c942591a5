"""A request shape's first choice, before anything was timed: the cost model on acceptance measured in training.

`draft="auto"` times its candidates on the request (mtpjax.decode.autodraft), and a first timing costs
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
from mtpjax.nn.speed import by_position, choose_fastest, expected_tokens, floor_ratio


def decode_context(prompts, max_new: int) -> int:
    """Mean context length while decoding these prompts max_new tokens further (for speed.work_ratio)."""
    return int(np.mean([len(p) for p in prompts])) + max_new // 2


def estimate(model, prompts, max_new: int, proposer: str, alpha_by_position, draft_model=None
             ) -> autodraft.Calibration:
    """The chain the cost model predicts fastest (PLAIN: plain) from `alpha_by_position` and each draft's floor r."""
    context = decode_context(prompts, max_new)
    dcfg = None if draft_model is None else draft_model.cfg
    chains = [t for t in autodraft.candidates(model, proposer, draft_model) if t.is_chain()]
    cost = {t: 1.0 + (t.size * floor_ratio(make_proposer(proposer, t), model.cfg, context, dcfg) if t.size else 0.0)
            for t in chains}
    alpha = [float(a) for a in alpha_by_position]
    expected = {t: expected_tokens(t, by_position(alpha)) for t in cost}
    return autodraft.Calibration(choice=choose_fastest(expected, cost, autodraft.MARGIN), round_cost=cost,
                                 alpha_by_position=alpha, expected_tokens=expected, source="estimate")
