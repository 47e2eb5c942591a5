"""Synthetic task sources (data.source induction / algorithmic) and their task metrics: determinism by seed, exact
mid-stream resume, held-out instances disjoint from training, the metrics against a hand count, greedy decoding.
Only the metrics' hand counts and a refusal run in the default tier (milliseconds); the rest is slow (CI)."""

import json

import numpy as np
import pytest

from mtpjax.config import DataConfig, load_config
from mtpjax.data import DataError, ByteTokenizer, make_iterator, prepare, synthetic
from mtpjax.eval import task_metrics as tasks

KINDS = ("induction", "algorithmic")


def _cfg(tmp_path, source, **kw):
    kw = {"synthetic_instances": 400, "val_fraction": 0.2, **kw}
    return DataConfig(source=source, cache_dir=str(tmp_path / "cache"), **kw)


def _docs(tokens) -> list[str]:
    """The documents of a byte-level split (EOS, byte 0, after each)."""
    return np.asarray(tokens, np.uint8).tobytes().decode().split("\x00")[:-1]


# ----------------------------------------------------------------------------- the sources


@pytest.mark.slow
@pytest.mark.parametrize("source", KINDS)
def test_the_corpus_is_a_function_of_its_seed(tmp_path, source):
    a = prepare(_cfg(tmp_path / "a", source))
    b = prepare(_cfg(tmp_path / "b", source))
    c = prepare(_cfg(tmp_path / "c", source, synthetic_seed=1))
    for split in ("train", "val"):
        assert np.array_equal(a.tokens(split), b.tokens(split))
    assert a.content_hash == b.content_hash != c.content_hash
    # instance i does not depend on how many are generated
    few = [x.text for x in synthetic.instances(_cfg(tmp_path, source, synthetic_instances=50))]
    assert few == [x.text for x in synthetic.instances(_cfg(tmp_path, source))][:50]


@pytest.mark.slow
def test_instances_read_as_documented():
    story = synthetic.instance("induction", 0, 3, 2)
    names = {t for t, _ in story.segments if t[:1].isupper() and t.isalpha()}
    assert len(names) == 2 and story.text.count(".") == synthetic.SENTENCES
    marked = [t for t, m in story.segments if m]
    assert marked and all(t.islower() and len(t) == synthetic.NAME_LETTERS for t in marked)
    total = sum(story.text.count(n) for n in names)  # every occurrence but each name's first is a repeat
    assert len(marked) == total - 2
    q = synthetic.instance("algorithmic", 0, 3, 3)
    (question, m0), (answer, m1) = q.segments
    a, b = (int(x) for x in question[:-1].split("+"))
    assert len(question) == 8 and not m0 and m1 and int(answer) == a + b and q.key == question


@pytest.mark.slow
@pytest.mark.parametrize("source", KINDS)
def test_the_stream_resumes_mid_stream_exactly(tmp_path, source):
    p = prepare(_cfg(tmp_path, source))
    kw = {"split": "train", "seq_len": 32, "batch_size": 4, "seed": 3}
    it = make_iterator(p, **kw)
    ref = [next(it) for _ in range(7)]
    first = make_iterator(p, **kw)
    for _ in range(3):
        next(first)
    resumed = make_iterator(p, **kw)
    resumed.set_state(json.loads(json.dumps(first.get_state())))
    for want in ref[3:]:
        got = next(resumed)
        assert all(np.array_equal(want[k], got[k]) for k in ("tokens", "segment_ids"))


def _overlap(tmp_path) -> set:
    # 1-digit sums: 100 distinct questions among 400 instances, so most are generated several times
    p = prepare(_cfg(tmp_path, "algorithmic", synthetic_difficulty=1))
    return set(_docs(p.tokens("train"))) & set(_docs(p.tokens("val")))


@pytest.mark.slow
def test_held_out_instances_never_occur_in_training(tmp_path):
    assert _overlap(tmp_path) == set()
    cfg = _cfg(tmp_path, "algorithmic", synthetic_difficulty=1)
    p = prepare(cfg)
    batch = synthetic.task_batch(cfg, p.tokenizer, 500, 16)  # the task metric's instances: every held-out one
    held = {ByteTokenizer().decode(r) for r in batch.tokens_BT}
    assert held and held <= set(_docs(p.tokens("val"))) and not held & set(_docs(p.tokens("train")))
    assert len(held) == len(batch.tokens_BT)  # distinct instances


def test_too_few_instances_for_both_splits_are_refused(tmp_path):
    """Cutting a stream of instances into train and val would put training instances into validation."""
    with pytest.raises(DataError, match="^the algorithmic corpus of 2 instances left the val split empty; raise "
                                        "data.synthetic_instances$"):
        prepare(_cfg(tmp_path, "algorithmic", synthetic_instances=2))
    assert not list((tmp_path / "cache").rglob("*.npy"))  # nothing half-written is left as a corpus


@pytest.mark.slow
def test_companion_a_split_by_instance_number_would_leak_held_out_instances(tmp_path, monkeypatch):
    """What the test above guards: splitting by position, not by the instance, puts repeats on both sides."""
    counter = iter(range(10**6))
    monkeypatch.setattr(synthetic, "split_of", lambda x, f: "val" if next(counter) % 5 == 0 else "train")
    assert _overlap(tmp_path)


@pytest.mark.slow
def test_bad_synthetic_settings_are_one_line(tmp_path):
    with pytest.raises(DataError, match="raise data.synthetic_instances"):
        prepare(_cfg(tmp_path, "algorithmic", synthetic_instances=1))
    with pytest.raises(DataError, match="induction stories have 1..8 names"):
        prepare(_cfg(tmp_path, "induction", synthetic_difficulty=9))
    with pytest.raises(DataError, match="algorithmic operands have 1..18 digits"):  # was numpy's traceback
        prepare(_cfg(tmp_path, "algorithmic", synthetic_difficulty=19))
    cfg = load_config(None, ["data.source=induction"])  # no data.paths needed
    assert cfg.data.source == "induction" and cfg.data.paths == ()


# ----------------------------------------------------------------------------- the metrics


# three rows of 5 positions; the marks (1) are scored; pred[:, p-1] predicts tokens[:, p]
TOKENS = np.array([[5, 1, 2, 3, 0], [5, 1, 2, 3, 0], [7, 7, 7, 7, 7]])
MASK = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
PRED = np.array([[9, 2, 3, 9, 9], [1, 9, 9, 9, 9], [7, 7, 7, 7, 7]])
# row 0: targets 2, 3, 0 at predictions 2, 3, 9 -> 2 of 3; row 1: targets 1, 2 at 1, 9 -> 1 of 2; row 2: no mark
HAND = {"induction": 3 / 5, "algorithmic": 0 / 2}


@pytest.mark.parametrize("kind", KINDS)
def test_the_metric_equals_a_hand_count(kind):
    assert tasks.METRICS[kind](PRED, TOKENS, MASK) == pytest.approx(HAND[kind])
    right = PRED.copy()
    right[0, 3], right[1, 1] = 0, 2  # every marked token predicted
    assert tasks.METRICS[kind](right, TOKENS, MASK) == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_companion_scoring_every_position_would_change_the_count(kind):
    """What the test above guards: only the marked positions count."""
    assert tasks.METRICS[kind](PRED, TOKENS, np.ones_like(MASK)) != pytest.approx(HAND[kind])


@pytest.mark.slow
def test_exact_match_equals_greedy_decoding(tmp_path):
    """The teacher-forced exact match is what mtpjax.decode.generate's greedy answers give, row by row."""
    from mtpjax.decode import generate
    from mtpjax.nn.model import build_model

    cfg = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=64", "model.mtp_depth=0", "data.source=algorithmic",
                             "data.synthetic_difficulty=1", "data.synthetic_instances=400", "data.val_fraction=0.2"])
    tok = ByteTokenizer()
    batch = synthetic.task_batch(cfg.data, tok, 16, 16)
    model = build_model(cfg, seed=0)
    tokens = batch.tokens_BT.copy()
    greedy = []
    for r in range(len(tokens)):
        cols = np.nonzero(batch.mask_BT[r])[0]
        out = generate(model, [tokens[r, :cols[0]].tolist()], max_new_tokens=len(cols), draft=0).tokens[0]
        if r % 2 == 0:  # even rows: the model's greedy answer becomes the reference, so both outcomes occur
            tokens[r, cols] = out[:len(cols)]
        greedy.append(list(out[:len(cols)]) == tokens[r, cols].tolist())
    em = tasks.exact_match(tasks.main_head_argmax(model, tokens), tokens, batch.mask_BT)
    assert em == pytest.approx(np.mean(greedy)) and 0 < em < 1


@pytest.mark.slow
@pytest.mark.parametrize("source", ["algorithmic"])  # induction takes the same path to another metric name
def test_the_training_eval_and_decode_eval_report_the_task_metric(tmp_path, source):
    """eval.jsonl and TensorBoard (eval/task/...) at a training eval, and decode.py --eval on that checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from train_helpers import tiny_cfg

    from mtpjax.cli.decode import main
    from mtpjax.eval.log import read_evals
    from mtpjax.train.loop import train

    cfg = tiny_cfg(tmp_path, "train.steps=2", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2",
                   "checkpoint.async_save=false", "train.num_samples=0", f"data.source={source}",
                   "data.synthetic_instances=300", "data.val_fraction=0.2", "data.task_instances=8",
                   "model.vocab_size=256")
    train(cfg)
    key = tasks.NAMES[source]
    (rec,) = read_evals(tmp_path / "run")
    assert 0 <= rec[key] <= 1
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars(f"eval/{key}")} == {2: pytest.approx(rec[key])}
    out = tmp_path / "eval.json"
    # a sum is ~9 tokens: held-out prompt and continuation must fit in one
    argv = ["--run-dir", str(tmp_path / "run"), "--eval", "--eval-prompts", "1", "--prompt-len", "4",
            "--max-new-tokens", "2", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["validation"][key] == pytest.approx(rec[key], abs=1e-7)
