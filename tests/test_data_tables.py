"""Parquet / Arrow sources, data.text_field, worker-process preparation, and their bad-input paths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyarrow import feather
from train_helpers import WORKER_LOG, dying_worker, started_worker

from mtpjax.config import DataConfig
from mtpjax.data import DataError, cache_path, encode, prepare, sources, train_bpe

ROOT = Path(__file__).resolve().parents[1]
TINY_VAL = 1e-9  # no document hashes below this: the split is a tail cut, the same for any key naming

DOCS = [f"document {i}: {'ünïcode ✓ ' * (i % 3)}" + "text " * (i % 7) for i in range(40)]


def _cfg(tmp_path, **kw):
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def _jsonl(path: Path, docs, field="text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def _tokens(p) -> np.ndarray:
    return np.concatenate([p.train_tokens, p.val_tokens])


def _with_gaps(docs):
    """The documents with nulls and empty strings between them (neither is a document)."""
    out = []
    for i, d in enumerate(docs):
        out.append(d)
        if i % 5 == 0:
            out += [None, ""]
    return out


def _entries(tmp_path) -> list[str]:
    c = tmp_path / "cache"
    return sorted(p.name for p in c.iterdir()) if c.exists() else []


# ----------------------------------------------------------------------------- equality with JSON lines


def test_parquet_row_groups_nulls_and_extra_columns_tokenize_like_json_lines(tmp_path):
    rows = _with_gaps(DOCS)
    table = pa.table({"id": list(range(len(rows))), "text": rows, "other": ["x"] * len(rows)})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    assert pq.ParquetFile(tmp_path / "d.parquet").metadata.num_row_groups > 5
    p = prepare(_cfg(tmp_path, source="parquet", paths=(str(tmp_path / "d.parquet"),), val_fraction=TINY_VAL))
    ref = prepare(_cfg(tmp_path, source="text", paths=(str(_jsonl(tmp_path / "d.jsonl", DOCS)),),
                       val_fraction=TINY_VAL))
    np.testing.assert_array_equal(p.train_tokens, ref.train_tokens)
    np.testing.assert_array_equal(p.val_tokens, ref.val_tokens)
    assert p.meta["text_field"] == "text" and p.tokenizer.decode(_tokens(p)) == "".join(DOCS)


def test_binary_column_with_non_utf8_bytes_warns_once_and_replaces(tmp_path):
    raw = [d.encode() for d in DOCS[:10]] + [b"caf\xe9 au lait", None, b"\xff\xfe broken"]
    pq.write_table(pa.table({"body": pa.array(raw, pa.binary())}), tmp_path / "b.parquet", row_group_size=4)
    with pytest.warns(UserWarning, match=r"1 file\(s\) are not valid UTF-8") as rec:
        p = prepare(_cfg(tmp_path, source="parquet", paths=(str(tmp_path / "b.parquet"),), text_field="body",
                         val_fraction=TINY_VAL))
    assert len([w for w in rec if "UTF-8" in str(w.message)]) == 1
    texts = DOCS[:10] + ["caf\ufffd au lait", "\ufffd\ufffd broken"]
    ref = prepare(_cfg(tmp_path, source="text", paths=(str(_jsonl(tmp_path / "b.jsonl", texts, "body")),),
                       text_field="body", val_fraction=TINY_VAL))
    np.testing.assert_array_equal(_tokens(p), _tokens(ref))


def test_string_column_holding_invalid_utf8_is_decoded_with_replacement(tmp_path):
    bad = pa.array([b"ok", b"caf\xe9"], pa.binary())
    col = pa.Array.from_buffers(pa.string(), 2, bad.buffers()[:3])  # a writer that skipped validation
    pq.write_table(pa.table({"text": col}), tmp_path / "s.parquet")
    with pytest.warns(UserWarning, match="not valid UTF-8"):
        p = prepare(_cfg(tmp_path, source="parquet", paths=(str(tmp_path / "s.parquet"),)))
    assert p.tokenizer.decode(_tokens(p)) == "okcaf\ufffd"


def test_arrow_ipc_file_stream_and_dictionary_column_tokenize_like_parquet(tmp_path):
    rows = _with_gaps(DOCS)
    table = pa.table({"text": pa.array(rows).dictionary_encode()})
    feather.write_feather(table, tmp_path / "f.feather", chunksize=6)  # Feather v2 = IPC file, several batches
    stream = tmp_path / "data-00000-of-00001.arrow"  # the IPC stream format datasets saves
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=9):
            w.write_batch(b)
    pq.write_table(pa.table({"text": rows}), tmp_path / "p.parquet", row_group_size=5)
    got = {}
    for name, source in (("f.feather", "arrow"), ("data-00000-of-00001.arrow", "arrow"), ("p.parquet", "parquet")):
        got[name] = prepare(_cfg(tmp_path, source=source, paths=(str(tmp_path / name),), val_fraction=TINY_VAL))
    for p in got.values():
        np.testing.assert_array_equal(_tokens(p), _tokens(got["p.parquet"]))
    assert got["f.feather"].tokenizer.decode(_tokens(got["f.feather"])) == "".join(DOCS)


def test_table_rows_split_by_hash_of_file_and_row(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    pq.write_table(pa.table({"text": DOCS[:20]}), d / "a.parquet", row_group_size=6)
    pq.write_table(pa.table({"text": [None] + DOCS[20:]}), d / "b.parquet", row_group_size=6)
    p = prepare(_cfg(tmp_path, source="parquet", paths=(str(d),), val_fraction=0.3))
    keys = [(f"a.parquet:{i + 1}", t) for i, t in enumerate(DOCS[:20])] + \
           [(f"b.parquet:{i + 2}", t) for i, t in enumerate(DOCS[20:])]
    want_val = "".join(t for k, t in keys if sources.is_val(k, 0.3))
    assert p.meta["split"] == "hash" and 0 < p.meta["val"]["docs"] < 40
    assert p.tokenizer.decode(p.val_tokens) == want_val
    assert p.tokenizer.decode(p.train_tokens) == "".join(t for k, t in keys if not sources.is_val(k, 0.3))


def test_json_lines_read_the_text_field_and_skip_nulls(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"body": "one"}\n{"body": null}\n\n{"body": "", "x": 1}\n{"body": "two\u2028still two"}\n')
    p = prepare(_cfg(tmp_path, source="text", paths=(str(f),), text_field="body"))
    assert p.tokenizer.decode(_tokens(p)) == "onetwo\u2028still two"
    with pytest.raises(DataError, match=r'a.jsonl:1 is not a JSON object with a string "text" field.*data.text_field'):
        prepare(_cfg(tmp_path, source="text", paths=(str(f),)))


def test_all_documents_in_validation_still_split_by_tail(tmp_path):
    f = _jsonl(tmp_path / "one.jsonl", ["abcdefghij" * 10])
    key = "one.jsonl:1"
    frac = 0.999 if sources.is_val(key, 0.999) else pytest.skip("the key does not hash into val")
    p = prepare(_cfg(tmp_path, source="text", paths=(str(f),), val_fraction=frac))
    assert p.meta["split"] == "tail" and len(p.train_tokens) == 1
    np.testing.assert_array_equal(_tokens(p), list(b"abcdefghij" * 10) + [0])


# ----------------------------------------------------------------------------- worker processes


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return str(train_bpe(iter(DOCS * 3), 300).save(d) / "tokenizer.json")


@pytest.mark.parametrize("tokenizer", ["byte", "hf", "bpe"])
def test_worker_processes_write_identical_arrays(tmp_path, monkeypatch, hf_tokenizer, tokenizer):
    monkeypatch.setattr(encode, "TASK_BYTES", 300)  # many small tasks, so that workers interleave
    monkeypatch.setattr(encode, "_init_worker", started_worker)  # each worker process notes its id
    d = tmp_path / "mixed"
    d.mkdir()
    for i in range(6):
        (d / f"t{i}.txt").write_text(DOCS[i] * 5)
    _jsonl(d / "lines.jsonl", DOCS[6:])
    pq.write_table(pa.table({"text": _with_gaps(DOCS)}), tmp_path / "p.parquet", row_group_size=3)
    spec = hf_tokenizer if tokenizer == "hf" else tokenizer  # bpe: trained here, loaded by the workers
    for source, path in (("text", d), ("parquet", tmp_path / "p.parquet")):
        kw = {"source": source, "paths": (str(path),), "tokenizer": spec, "val_fraction": 0.3, "bpe_vocab_size": 300}
        here = prepare(_cfg(tmp_path, **kw))
        cfg = _cfg(tmp_path / "w", **kw, prepare_workers=2)
        assert len(encode.tasks_of(sources.units(source, _files(cfg), "text"))) >= 4
        assert cache_path(cfg).name == here.dir.name  # worker counts are not part of the cache key
        started = tmp_path / f"workers-{source}"
        started.mkdir()
        monkeypatch.setenv(WORKER_LOG, str(started))
        there = prepare(cfg)
        pids = {int(p.name) for p in started.iterdir()}
        assert len(pids) == 2 and os.getpid() not in pids  # both worker processes started, not this one
        np.testing.assert_array_equal(there.train_tokens, here.train_tokens)
        np.testing.assert_array_equal(there.val_tokens, here.val_tokens)
        assert there.meta["content_hash"] == here.meta["content_hash"]
        assert {s: there.meta[s] for s in ("train", "val")} == {s: here.meta[s] for s in ("train", "val")}


def _files(cfg):
    from mtpjax.data.corpus import _files

    return _files(cfg)


def test_a_worker_process_that_dies_is_one_line_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "_init_worker", dying_worker)
    monkeypatch.setattr(encode, "TASK_BYTES", 10)  # more than one task: the work goes to the worker processes
    (tmp_path / "a.txt").write_text("some text " * 5)
    (tmp_path / "b.txt").write_text("more text " * 5)
    with pytest.raises(DataError, match="^a data.prepare_workers process died .*; lower data.prepare_workers or set "
                                        "it to 0$"):
        prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path),), prepare_workers=2))
    assert _entries(tmp_path) == []


def test_worker_error_is_the_same_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "TASK_BYTES", 10)
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "fine"}\n' * 5 + '{"body": "x"}\n')
    (tmp_path / "b.txt").write_text("more text")
    cfg = _cfg(tmp_path, source="text", paths=(str(tmp_path / "b.txt"), str(f)), prepare_workers=2)
    with pytest.raises(DataError, match=r"a.jsonl:6 is not a JSON object"):
        prepare(cfg)
    assert _entries(tmp_path) == []  # neither a cache entry nor a temp dir


def test_progress_bar_counts_bytes_and_shows_tokens_per_second(capsys):
    bar = encode.Progress(True, 1000, "prepare")
    bar.advance(400, 1234)
    bar.bar.refresh()
    bar.close()
    err = capsys.readouterr().err
    assert "400" in err and "1,234 tokens" in err and "tok/s" in err


# ----------------------------------------------------------------------------- bad input: one line, exit 2, no cache


def _cli(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mtpjax.data", "prepare", f"data.cache_dir={tmp_path / 'cache'}",
                           *overrides], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)


def _damaged_pages(t: Path) -> None:
    """A Parquet file whose footer reads but whose first data pages are overwritten: it fails while being read."""
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(200)]}), t / "a.parquet")
    raw = bytearray((t / "a.parquet").read_bytes())
    raw[4:200] = b"\xff" * 196
    (t / "a.parquet").write_bytes(raw)


@pytest.mark.parametrize("make, overrides, message", [
    (lambda t: pq.write_table(pa.table({"id": [1], "body": ["x"]}), t / "a.parquet"), [],
     "has no column 'text' (columns: id, body); set data.text_field to its text column"),
    (lambda t: pq.write_table(pa.table({"text": [1, 2]}), t / "a.parquet"), [],
     "column 'text' of '{t}/a.parquet' holds int64, not text; set data.text_field to a string column"),
    (lambda t: (t / "a.parquet").write_bytes(b"PAR1 this is not parquet"), [],
     "'{t}/a.parquet' is not a readable Parquet file (Parquet magic bytes not found in footer."),
    (lambda t: pq.write_table(pa.table({"text": pa.array([None, ""], pa.string())}), t / "a.parquet"), [],
     "hold no data (1 file(s), all empty); point data.paths at non-empty files"),
    (lambda t: (t / "a.parquet").mkdir(), [], "has no .parquet files; fix data.paths"),
    (lambda t: (t / "a.parquet").write_bytes(b"junk"), ["data.source=arrow"],
     "is not a readable Arrow IPC / Feather v2 file"),
    (_damaged_pages, [], "error: '{t}/a.parquet' could not be read ("),
])
def test_bad_tables_are_one_line_exit_2_and_leave_no_cache(tmp_path, make, overrides, message):
    make(tmp_path)
    p = _cli(tmp_path, "data.source=parquet", f"data.paths=[{tmp_path / 'a.parquet'}]", *overrides)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert message.format(t=tmp_path) in err[0]
    assert _entries(tmp_path) == []


def test_data_bench_smoke():
    sys.path.insert(0, str(ROOT))
    from bench.data_bench import run

    res = run(0.05, "byte", [0], 1)
    assert set(res["rows"]) == {"encoder", "read", "prepare_w0"} and res["tokens"] > 0
    assert all(r["tokens_per_s"] > 0 and r["vs_encoder"] > 0 for r in res["rows"].values())
