"""One validation: the training eval (eval.jsonl) and `decode.py --eval` report the same metrics for one checkpoint."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL
from train_helpers import one_line_error, tiny_cfg

from mtpjax.cli.decode import main
from mtpjax.eval.log import read_evals
from mtpjax.config import LossConfig, ModelConfig
from mtpjax.eval.validation import COUNTS, batch_metrics, mean_metrics, model_metrics
from mtpjax.nn.loss import add_expected_lengths
from mtpjax.nn.model import build_model
from mtpjax.parallel.sharding import micro_batches_of
from mtpjax.train.loop import train

STEP = 4  # the step evaluated in training and checkpointed
OVERRIDES = [f"train.steps={STEP}", f"train.eval_every={STEP}", "train.eval_batches=3", f"checkpoint.every={STEP}",
             "checkpoint.async_save=false", "train.num_samples=0", "train.micro_batches=2"]  # eval in 2 parts too


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(cfg, run dir, the training eval's record at STEP, decode.py --eval --json's report on that checkpoint)."""
    tmp = tmp_path_factory.mktemp("validation")
    cfg = tiny_cfg(tmp, *OVERRIDES)
    train(cfg)
    run = tmp / "run"
    out = tmp / "eval.json"
    argv = ["--run-dir", str(run), "--eval", "--eval-prompts", "1", "--prompt-len", "8", "--max-new-tokens", "8",
            "--json", str(out)]  # --eval-batches defaults to the training eval's train.eval_batches
    assert main(argv) == 0
    (rec,) = [e for e in read_evals(run) if e["step"] == STEP]
    return cfg, run, rec, json.loads(out.read_text())


def test_decode_eval_reports_the_training_evals_metrics(evaluated):
    """Same checkpoint, same validation batches: every metric the training eval wrote, decode.py --eval reports."""
    _, _, rec, rep = evaluated
    assert rep["step"] == STEP
    train_eval = {k: v for k, v in rec.items() if k != "step"}
    for k in ("loss/main", "loss/mtp_2", "agreement/mtp_2", "accept_prob/mtp_1", "accept_prob/mtp_2",
              "expected_accept_length", "expected_accept_length_sampled", "bits_per_byte"):
        assert k in train_eval, k
    assert set(rep["validation"]) == set(train_eval)
    for k, v in train_eval.items():
        assert rep["validation"][k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_companion_per_batch_averaged_lengths_differ(evaluated):
    """The old rule (the mean of per-batch expected lengths, unweighted) gives another number on the same batches,
    so the equality above holds only because both paths take the lengths from the token-weighted mean rates."""
    from mtpjax.data import first_batches, prepare
    from mtpjax.train.checkpoint import load_model

    cfg, run, rec, _ = evaluated
    _, model, _ = load_model(run, STEP)
    batches = first_batches(prepare(cfg.data), 3, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                            seed=cfg.train.seed)
    per = model_metrics(model, batches, step=STEP, loss_cfg=cfg.loss, micro_batches=cfg.train.micro_batches)
    assert mean_metrics(per)["expected_accept_length"] == pytest.approx(rec["expected_accept_length"], rel=1e-6)
    rates = [{k: float(v) for k, v in m.items() if k != COUNTS} for m in per]
    lengths = [float(add_expected_lengths(r, 2)["expected_accept_length"]) for r in rates]
    assert len(set(lengths)) > 1  # batches that differ: otherwise any averaging agrees
    assert abs(np.mean(lengths) - rec["expected_accept_length"]) > 1e-5


def test_eval_batches_below_one_is_one_line_exit_2(evaluated, capsys):
    _, run, _, _ = evaluated
    assert "--eval-batches 0 must be >= 1" in one_line_error(capsys, main, ["--run-dir", str(run), "--eval",
                                                                             "--eval-batches", "0"])


def test_means_are_token_weighted_and_lengths_come_from_the_means():
    """Each metric is weighted by its own depth's valid targets (loss/total by the main head's); a depth with no
    target in a batch takes no weight there; the expected length is E(γ) of the mean rates."""
    per = [{"loss/main": 1.0, "loss/total": 2.0, "agreement/mtp_1": 0.5, "agreement/mtp_2": 0.5, COUNTS: [10, 9, 8]},
           {"loss/main": 3.0, "loss/total": 4.0, "agreement/mtp_1": 1.0, "agreement/mtp_2": 0.0, COUNTS: [30, 27, 0]}]
    m = mean_metrics(per)
    assert m["loss/main"] == pytest.approx((10 * 1.0 + 30 * 3.0) / 40)
    assert m["loss/total"] == pytest.approx((10 * 2.0 + 30 * 4.0) / 40)
    assert m["agreement/mtp_1"] == pytest.approx((9 * 0.5 + 27 * 1.0) / 36)
    assert m["agreement/mtp_2"] == pytest.approx(0.5)
    assert m["expected_accept_length"] == pytest.approx(1 + 0.875 + 0.875 * 0.5)


def test_unrolled_applications_are_weighted_by_their_own_targets():
    """loss.mtp_unroll's `*/unroll_u` metrics take token_counts' columns after the depths and draft no round."""
    per = [{"loss/main": 1.0, "agreement/mtp_1": 0.5, "loss/unroll_1": 2.0, COUNTS: [4, 3, 1]},
           {"loss/main": 1.0, "agreement/mtp_1": 0.5, "loss/unroll_1": 6.0, COUNTS: [4, 3, 3]}]
    m = mean_metrics(per)
    assert m["loss/unroll_1"] == pytest.approx((1 * 2.0 + 3 * 6.0) / 4)
    assert m["expected_accept_length"] == pytest.approx(1.5)  # one depth: 1 + agreement/mtp_1


def _padded_batch(rows: int = 8, T: int = 16):
    """Tokens and segment ids whose rows hold different numbers of real tokens (some none), so micro-batches of
    rows a, a+A, ... count different valid targets."""
    rng = np.random.default_rng(0)
    tok = rng.integers(1, SMALL["vocab_size"], (rows, T)).astype(np.int32)
    real = [T, T, 3, 0, T, 9, T, 5][:rows]
    seg = np.array([[1 if t < n else 0 for t in range(T)] for n in real], np.int32)
    return jnp.asarray(tok), jnp.asarray(seg)


def _metrics_in_parts(parts: int) -> dict:
    model = build_model(ModelConfig(**SMALL), seed=0)
    tok, seg = _padded_batch()
    fn = jax.jit(lambda t, s: batch_metrics(model, t, s, step=0, loss_cfg=LossConfig(), micro_batches=parts))
    return jax.device_get(fn(tok, seg))


@pytest.mark.parametrize("parts", [2, 4])
def test_an_eval_in_micro_batches_equals_the_whole_batch_s(parts):
    """The eval step in the train step's micro-batches (its memory) reports the whole batch's metrics: each part's
    mean weighted by its own valid targets per depth, the counts summed."""
    whole, split = _metrics_in_parts(1), _metrics_in_parts(parts)
    assert set(split) == set(whole)
    np.testing.assert_array_equal(split[COUNTS], whole[COUNTS])
    for k in whole:
        assert split[k] == pytest.approx(whole[k], rel=1e-6, abs=1e-7), k


def test_companion_micro_batches_averaged_alike_differ():
    """The parts' plain mean (each part weighing the same, whatever its valid targets) is another number, so the
    equality above holds only because the parts are token-weighted."""
    model = build_model(ModelConfig(**SMALL), seed=0)
    tok, seg = _padded_batch()
    parts = [jax.device_get(batch_metrics(model, micro_batches_of(tok, 2)[a], micro_batches_of(seg, 2)[a], step=0,
                                          loss_cfg=LossConfig())) for a in range(2)]
    whole = _metrics_in_parts(1)
    assert parts[0][COUNTS][0] != parts[1][COUNTS][0]
    assert abs((parts[0]["loss/main"] + parts[1]["loss/main"]) / 2 - whole["loss/main"]) > 1e-3
