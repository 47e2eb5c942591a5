"""Weighted mixtures, the global stream read by rows, multi-process preparation, inspect, and runtime data keys."""

import json
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import record_builds

from mtpjax.config import ConfigError, DataConfig, MixtureSource, load_config
from mtpjax.data import (
    ByteTokenizer,
    DataError,
    PreparedData,
    PreparedMixture,
    hosts,
    local_rows,
    make_iterator,
    prepare,
    prepare_on_hosts,
)
from mtpjax.cli.data import main as cli_main

SEQ = 4


def _part(first_token: int, n_windows: int) -> PreparedData:
    """A source whose window w holds only the token first_token + w (no EOS): a row names its source and window."""
    toks = np.repeat(np.arange(first_token, first_token + n_windows), SEQ).astype(np.uint16)
    return PreparedData(Path("/nonexistent"), {"content_hash": f"h{first_token}"}, ByteTokenizer(), toks,
                        toks[:SEQ * 2])


def _mix(weights, sizes=(50, 30, 20)) -> PreparedMixture:
    names = ["a", "b", "c"][:len(weights)]
    total = sum(weights)
    return PreparedMixture(names, [w / total for w in weights],
                           [_part(1 + 100 * k, sizes[k]) for k in range(len(names))])


def _src(batch) -> np.ndarray:
    return (batch["tokens"][:, 0] - 1) // 100


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in ("tokens", "segment_ids"))


KW = {"split": "train", "seq_len": SEQ, "batch_size": 16, "seed": 3}


# ----------------------------------------------------------------------------- the sampler


def test_windows_come_in_the_ratio_of_the_weights():
    it = make_iterator(_mix([0.8, 0.2]), **KW)
    batches = _take(it, 250)
    src = np.concatenate([_src(b) for b in batches])
    assert abs((src == 0).mean() - 0.8) <= 0.02 and abs((src == 1).mean() - 0.2) <= 0.02
    for s in (1, 7, 100, 250):  # after any prefix each source is within one window of its share
        counts = np.bincount(np.concatenate([_src(b) for b in batches[:s]]), minlength=2)
        assert np.all(np.abs(counts - np.array([0.8, 0.2]) * 16 * s) < 1)
    assert it.get_state()["taken"] == [3200, 800]
    rows = [tuple(_src(b)) for b in batches[:20]]
    assert len(set(rows)) > 10  # rows are permuted per batch: no row is tied to one source


def test_each_source_repeats_whole_epochs_of_its_windows():
    # a gives 8 windows to each batch of 16 and has 8: every batch holds one whole epoch of a
    for b in _take(make_iterator(_mix([0.5, 0.5], sizes=(8, 40)), **KW), 20):
        assert sorted(int(t) - 1 for t in b["tokens"][:, 0] if t < 100) == list(range(8))


def test_adding_a_source_keeps_the_order_of_the_others():
    def windows_of_a(mix):  # a has half of every batch in both mixtures: the same windows, batch by batch
        return [sorted(int(t) for t in b["tokens"][:, 0] if t < 100) for b in _take(make_iterator(mix, **KW), 30)]

    two, three = windows_of_a(_mix([0.5, 0.5])), windows_of_a(_mix([0.5, 0.3, 0.2]))
    assert two == three and all(len(w) == 8 for w in two)


def test_state_resumes_exactly_with_any_prefetch_and_rows():
    mix = _mix([0.6, 0.3, 0.1])
    it = make_iterator(mix, **KW)
    _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    ref = _take(it, 12)
    for workers, rows in ((0, None), (3, None), (2, [9, 1, 4])):
        again = make_iterator(mix, **KW, num_workers=workers, rows=rows)
        _take(again, 2)  # a different position, with batches prefetched: set_state replaces both
        again.set_state(state)
        want = ref if rows is None else [{k: b[k][rows] for k in b} for b in ref]
        assert _same(_take(again, 12), want)
        assert again.get_state()["taken"] == it.get_state()["taken"]


def test_processes_reading_their_rows_see_one_global_batch():
    mix = _mix([0.7, 0.3])
    whole = _take(make_iterator(mix, **KW), 10)
    parts = [_take(make_iterator(mix, **KW, rows=list(range(r, r + 4))), 10) for r in (0, 4, 8, 12)]
    glued = [{k: np.concatenate([p[i][k] for p in parts]) for k in whole[0]} for i in range(10)]
    assert _same(whole, glued)


def test_state_of_another_mixture_or_an_older_version_is_refused():
    state = make_iterator(_mix([0.8, 0.2]), **KW).get_state()
    with pytest.raises(DataError, match=r"saved with sources=.*0\.8.*\(now .*0\.5"):
        make_iterator(_mix([0.5, 0.5]), **KW).set_state(state)
    with pytest.raises(DataError, match="older mtpjax"):
        make_iterator(_mix([0.8, 0.2]), **KW).set_state({"next_index": 3})


def test_finite_epochs_stop_when_a_source_runs_out():
    it = make_iterator(_mix([0.5, 0.5], sizes=(16, 100)), **{**KW, "shuffle": False}, num_epochs=1)
    batches = list(it)
    assert len(batches) == 2 and sum(int((_src(b) == 0).sum()) for b in batches) == 16


def test_a_source_smaller_than_one_window():
    mix = PreparedMixture(["a", "tiny"], [0.5, 0.5], [_part(1, 10), PreparedData(
        Path("/x"), {"content_hash": "t"}, ByteTokenizer(), np.ones(3, np.uint16), np.ones(3, np.uint16))])
    with pytest.raises(DataError, match="source 'tiny' has 3 tokens, less than one window of data.seq_len=4"):
        make_iterator(mix, **KW)


# ----------------------------------------------------------------------------- mixtures from the config


def _write_sources(tmp_path):
    (tmp_path / "web").mkdir()
    (tmp_path / "code").mkdir()
    for i in range(12):
        (tmp_path / "web" / f"w{i}.txt").write_text(f"web page {i} " * 40)
        (tmp_path / "code" / f"c{i}.txt").write_text(f"def f{i}(): return {i}\n" * 30)
    return [f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "data.val_fraction=0.2",
            (f"data.mixture=[{{name: web, paths: [{tmp_path / 'web'}], weight: 0.8}}, "
             f"{{name: code, paths: [{tmp_path / 'code'}], weight: 0.2}}]")]


def test_each_source_is_prepared_and_cached_on_its_own(tmp_path, corpus_builds):
    cfg = load_config(None, _write_sources(tmp_path))
    mix = prepare(cfg.data)
    assert len(corpus_builds) == 2  # one build per source
    assert isinstance(mix, PreparedMixture) and mix.names == ["web", "code"] and mix.weights == [0.8, 0.2]
    assert mix.part("web").dir != mix.part("code").dir
    reweighed = cfg.data.model_copy(update={"mixture": (MixtureSource("web", "text", (str(tmp_path / "web"),), 1.0),
                                                        MixtureSource("code", "text", (str(tmp_path / "code"),), 3.0))})
    again = prepare(reweighed)  # new weights: the same cache entries, no re-tokenizing
    assert len(corpus_builds) == 2
    assert [p.dir for p in again.parts] == [p.dir for p in mix.parts] and again.weights == [0.25, 0.75]
    assert again.content_hash != mix.content_hash
    batch = next(make_iterator(mix, split="train", seq_len=32, batch_size=10, seed=0))
    texts = [mix.tokenizer.decode(r) for r in batch["tokens"]]
    assert sum("web page" in t for t in texts) == 8 and sum("def f" in t for t in texts) == 2


def test_inspect_shows_documents_and_decoded_windows_per_source(tmp_path, capsys):
    assert cli_main(["inspect", *_write_sources(tmp_path), "train.batch_size=10", "--windows", "1"]) == 0
    out = capsys.readouterr().out
    assert "first batch: web 8 rows, code 2 rows" in out
    assert "source 'web' (weight 0.800)" in out and "source 'code' (weight 0.200)" in out
    assert "doc 1 (" in out and "segment 1: " in out and "+ EOS" in out and "'web page" in out and "'def f" in out


@pytest.mark.parametrize("override, message", [
    ("data.mixture=[{name: a, paths: [x], weight: 0}]", "data.mixture[0].weight' = 0.0 is invalid: must be > 0"),
    ("data.mixture=[{name: a, paths: [x]}, {name: a, paths: [y]}]",
     "data.mixture[1].name' = 'a' is invalid: is repeated"),
    ("data.mixture=[{name: a, paths: [x], colour: red}]", "unknown config key 'data.mixture[0].colour'"),
    ("data.mixture=[{name: a, source: parquet, paths: [{t}/missing.parquet]}]",
     "data.mixture source 'a': data path '{t}/missing.parquet' does not exist"),
    ("data.mixture=[{name: a, paths: [{t}/empty]}]", "data.mixture source 'a': data.paths ['{t}/empty'] hold no data"),
])
def test_bad_mixtures_are_one_line_exit_2(tmp_path, capsys, override, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    rc = cli_main(["prepare", f"data.cache_dir={tmp_path / 'cache'}", override.replace("{t}", str(tmp_path))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message.replace("{t}", str(tmp_path)) in err[0], err
    cache = tmp_path / "cache"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_mixture_with_a_trained_bpe_is_refused():
    with pytest.raises(ConfigError, match="a mixture needs one fixed tokenizer"):
        load_config(None, ["data.tokenizer=bpe", "data.mixture=[{name: a, paths: [x]}]"])
    with pytest.raises(ConfigError, match="data.paths.*must be empty when data.mixture is set"):
        load_config(None, ["data.source=text", "data.paths=[y]", "data.mixture=[{name: a, paths: [x]}]"])
    # a mixture's entries name their own source and text field: the top-level ones would be silently ignored
    for key, value in (("source", "text"), ("text_field", "body")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"data.{key}={value}", "data.mixture=[{name: a, source: text, paths: [x]}]"])
        assert str(e.value) == (f"config key 'data.{key}' = '{value}' is invalid: is replaced by data.mixture (each "
                                "source sets its own); leave it out")


# ----------------------------------------------------------------------------- rows and several processes


def test_local_rows_follow_the_devices_blocks():
    import jax

    from mtpjax.config import MeshConfig
    from mtpjax.parallel.sharding import batch_sharding, make_mesh

    n = jax.device_count()
    np.testing.assert_array_equal(local_rows(batch_sharding(make_mesh(MeshConfig(data=n))), 4 * n), np.arange(4 * n))

    class Blocks:  # what a process holding rows 6-7 and 2-3 of 8 sees (two devices, any order)
        def addressable_devices_indices_map(self, shape):
            return {"d0": (slice(6, 8), slice(None)), "d1": (slice(2, 4), slice(None))}

    np.testing.assert_array_equal(local_rows(Blocks(), 8), [2, 3, 6, 7])


class FakeCoordinator:
    """The coordination service's key-value store: a blocking get waits on an event (a condition variable)."""

    def __init__(self):
        self.kv, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError("DEADLINE_EXCEEDED")
            return self.kv[key]

    class View:
        def __init__(self, store):
            self.key_value_set, self.blocking_key_value_get = store.key_value_set, store.blocking_key_value_get


def _on_two_processes(cfg, monkeypatch, shared=True):
    """prepare_on_hosts in two threads standing for processes 0 and 1; ({index: result or error}, builds).

    Not shared: process 1 has its own data.cache_dir, where it cannot see process 0's probe file.
    """
    builds = record_builds(monkeypatch)
    if not shared:
        monkeypatch.setattr(hosts, "_probe_visible", lambda path: False)
    store, out, ns = FakeCoordinator(), {}, f"test/{uuid.uuid4().hex}"

    def run(i):
        client = FakeCoordinator.View(store)  # each process has its own client of one store
        mine = cfg if shared or i == 0 else cfg.model_copy(update={"cache_dir": cfg.cache_dir + "-host1"})
        try:
            out[i] = prepare_on_hosts(mine, progress=False, index=i, count=2, client=client, namespace=ns)
        except DataError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"p{i}") for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, builds


def test_one_process_prepares_a_shared_cache_while_the_other_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(hosts, "_WAIT_MS", 1)  # waits time out and are repeated until the event
    (tmp_path / "a.txt").write_text("shared corpus " * 200)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "a.txt"),), cache_dir=str(tmp_path / "cache"))
    out, builds = _on_two_processes(cfg, monkeypatch)
    assert builds == ["p0"] and out[0].dir == out[1].dir and out[0].content_hash == out[1].content_hash
    assert not list((tmp_path / "cache").glob(".probe-*"))


def test_a_cache_not_shared_with_process_0_is_prepared_on_that_host_too(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("local corpus " * 200)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "a.txt"),), cache_dir=str(tmp_path / "cache"))
    out, builds = _on_two_processes(cfg, monkeypatch, shared=False)
    assert sorted(builds) == ["p0", "p1"] and out[0].dir != out[1].dir
    assert out[0].content_hash == out[1].content_hash
    assert "process 1: data.cache_dir is not shared with process 0" in capsys.readouterr().err


def test_an_error_on_process_0_stops_every_process_with_its_line(tmp_path, monkeypatch):
    cfg = DataConfig(source="text", paths=(str(tmp_path / "missing"),), cache_dir=str(tmp_path / "cache"))
    out, builds = _on_two_processes(cfg, monkeypatch)
    assert builds == [] and str(out[0]) == str(out[1]) and "does not exist" in str(out[1])


def test_different_files_on_two_hosts_are_an_error(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("host zero " * 100)
    cfg = DataConfig(source="text", paths=(str(tmp_path / "a.txt"),), cache_dir=str(tmp_path / "cache"))
    from mtpjax.data import corpus

    real = corpus.prepare

    def per_host(data_cfg, progress=False):  # process 1's copy of the file differs
        if threading.current_thread().name == "p1":
            (tmp_path / "b.txt").write_text("host one " * 100)
            data_cfg = data_cfg.model_copy(update={"paths": (str(tmp_path / "b.txt"),)})
        return real(data_cfg, progress=progress)

    monkeypatch.setattr(corpus, "prepare", per_host)
    out, _ = _on_two_processes(cfg, monkeypatch, shared=False)
    assert "process 1 prepared a different corpus than process 0" in str(out[1])


# ----------------------------------------------------------------------------- settings that may change on resume


def test_runtime_data_keys_may_change_on_resume_and_others_may_not(tmp_path):
    from mtpjax.train.rundir import RunDirError, check_identity

    base = ["data.source=text", "data.paths=[a.txt]", f"train.run_dir={tmp_path / 'run'}"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(load_config(None, base).to_yaml())
    check_identity(load_config(None, base + ["data.num_workers=4", "data.prepare_workers=8",
                                             f"data.cache_dir={tmp_path / 'elsewhere'}"]))  # the same run
    with pytest.raises(RunDirError, match="data.text_field: 'text' -> 'body'"):
        check_identity(load_config(None, base + ["data.text_field=body"]))


# ----------------------------------------------------------------------------- a mixture run


@pytest.mark.slow
def test_mixture_run_resumes_bit_identical_and_logs_every_source(tmp_path):
    """8 steps straight == 4, stop, 4 more on a 0.8/0.2 mixture; eval/<name>/... in TensorBoard."""
    import sys

    import jax
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sys.path.insert(0, str(Path(__file__).parent))
    from train_helpers import tiny_cfg

    from mtpjax.train.checkpoint import load_model
    from mtpjax.train.loop import train

    mix = _write_sources(tmp_path)[2:]  # seq_len and val_fraction come from the tiny config
    alone = ["data.paths=[]", "data.source=stdlib"]  # the tiny config's own source, which the mixture replaces
    straight = train(tiny_cfg(tmp_path, *alone, *mix, run="a"))
    cfg_b = tiny_cfg(tmp_path, *alone, *mix, "data.num_workers=2", run="b")
    first, second = train(cfg_b, max_steps=4), train(cfg_b)
    np.testing.assert_array_equal(np.array(first["history"] + second["history"]), np.array(straight["history"]))
    for name in ("web", "code"):
        assert second[f"eval/{name}/loss/main"] == straight[f"eval/{name}/loss/main"] > 0
    _, ma, _ = load_model(tmp_path / "a")
    _, mb, _ = load_model(tmp_path / "b")
    for a, b in zip(jax.tree.leaves(ma), jax.tree.leaves(mb)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    acc = EventAccumulator(str(tmp_path / "a" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/loss/main", "eval/web/loss/main", "eval/code/loss/main", "eval/web/loss/mtp_1",
            "eval/code/agreement/mtp_2"} <= tags
