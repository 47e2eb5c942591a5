"""Task metrics of the synthetic sources (mtpjax.data.synthetic) on held-out instances, from the main head.

- induction: accuracy of the main head's argmax on the marked tokens (a repeated name's letters after its first),
  each predicted from the true text before it;
- algorithmic: exact match of the answer by greedy decoding. Greedy decoding reproduces the answer and the end
  of document after it iff at each of those marked positions the argmax after the true prefix is the true token
  (by induction on the position), so one teacher-forced forward pass gives it; tests/test_tasks.py checks it
  against mtpjax.decode.generate.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

NAMES = {"induction": "task/induction_accuracy", "algorithmic": "task/exact_match"}


def hits(pred_BT: np.ndarray, tokens_BT: np.ndarray, mask_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(correct, scored) per target position: pred_BT[:, p-1] is the prediction of tokens_BT[:, p]."""
    correct = np.asarray(pred_BT)[:, :-1] == np.asarray(tokens_BT)[:, 1:]
    return correct, np.asarray(mask_BT, bool)[:, 1:]


def induction_accuracy(pred_BT, tokens_BT, mask_BT) -> float:
    """Fraction of the marked tokens the argmax predicts."""
    correct, scored = hits(pred_BT, tokens_BT, mask_BT)
    return float((correct & scored).sum() / max(1, scored.sum()))


def exact_match(pred_BT, tokens_BT, mask_BT) -> float:
    """Fraction of the rows (with a marked token) whose every marked token the argmax predicts."""
    correct, scored = hits(pred_BT, tokens_BT, mask_BT)
    rows = scored.any(axis=1)
    return float((correct | ~scored).all(axis=1)[rows].mean()) if rows.any() else 0.0


METRICS = {"induction": induction_accuracy, "algorithmic": exact_match}


@nnx.jit
def _argmax(model, tokens_BT):
    h_BTD, _ = model.trunk(tokens_BT)
    return model.logits(model.final_norm(h_BTD)).argmax(-1)


def main_head_argmax(model, tokens_BT: np.ndarray) -> np.ndarray:
    """The main head's argmax at every position of every row (one jitted trunk forward)."""
    return np.asarray(_argmax(model, tokens_BT))


def task_metrics(model, batch) -> dict[str, float]:
    """{'task/...': value} of a synthetic TaskBatch (empty for None)."""
    if batch is None:
        return {}
    pred_BT = main_head_argmax(model, batch.tokens_BT)
    return {NAMES[batch.kind]: METRICS[batch.kind](pred_BT, batch.tokens_BT, batch.mask_BT)}
