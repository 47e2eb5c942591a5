"""Data package: packing, determinism, shards, iterator state, splits, sources, tokenizers, cache, CLI, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtpjax.config import ConfigError, DataConfig
from mtpjax.data import (
    ByteTokenizer,
    DataError,
    PreparedData,
    check_vocab,
    load_tokenizer,
    make_iterator,
    prepare,
    segment_ids,
    sources,
    tokenizer_from_dir,
    train_bpe,
)
from mtpjax.cli.data import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def _prepared(train, val=(1, 2, 3, 0), tok=None, tmp=Path("/nonexistent")):
    return PreparedData(tmp, {"content_hash": "h"}, tok or ByteTokenizer(), np.asarray(train, np.uint16),
                        np.asarray(val, np.uint16))


def _numbered(n_windows, seq_len=4):
    """A stream whose window w holds only the token w+1 (no EOS), so a batch names its windows."""
    return _prepared(np.repeat(np.arange(1, n_windows + 1), seq_len))


def _window_ids(batch):
    return [int(t) - 1 for t in batch["tokens"][:, 0]]


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in ("tokens", "segment_ids"))


def _cfg(tmp_path, **kw):
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def _docs(prepared, split):
    """The documents of a split, decoded (the stream is split at EOS)."""
    ids = np.asarray(prepared.tokens(split)).tolist()
    out, cur = [], []
    for i in ids:
        if i == prepared.tokenizer.eos_id:
            out.append(prepared.tokenizer.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur, "every split ends with EOS"
    return out


# ----------------------------------------------------------------------------- packing


def test_packing_windows_and_segment_ids_on_handcrafted_stream():
    # documents "ab", "cde", "f" joined with EOS (0) after each, then seq_len=4 windows; last partial dropped
    stream = [97, 98, 0, 99, 100, 101, 0, 102, 0]
    it = make_iterator(_prepared(stream), split="train", seq_len=4, batch_size=2, seed=0, shuffle=False,
                       num_epochs=1)
    (batch,) = list(it)
    assert batch["tokens"].dtype == np.int32 and batch["segment_ids"].dtype == np.int32
    np.testing.assert_array_equal(batch["tokens"], [[97, 98, 0, 99], [100, 101, 0, 102]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 2], [1, 1, 1, 2]])


def test_segment_ids_eos_closes_its_document():
    np.testing.assert_array_equal(segment_ids(np.array([[0, 5, 0, 0, 7]]), 0), [[1, 2, 2, 3, 4]])
    np.testing.assert_array_equal(segment_ids(np.array([[5, 6, 7]]), 0), [[1, 1, 1]])


# ----------------------------------------------------------------------------- determinism, shards, state


def test_same_seed_same_batches_and_each_epoch_is_a_new_permutation():
    kw = {"split": "train", "seq_len": 4, "batch_size": 4, "seed": 7}
    a, b = _take(make_iterator(_numbered(40), **kw), 20), _take(make_iterator(_numbered(40), **kw), 20)
    assert _same(a, b)
    c = _take(make_iterator(_numbered(40), **{**kw, "seed": 8}), 20)
    assert not _same(a, c)
    ids = [w for batch in a for w in _window_ids(batch)]
    epoch1, epoch2 = ids[:40], ids[40:]
    assert sorted(epoch1) == list(range(40)) and sorted(epoch2) == list(range(40))
    assert epoch1 != epoch2 and epoch1 != list(range(40))


def test_eval_batches_read_each_validation_window_once():
    """first_batches stops at the end of the validation split (10 windows: 3 batches of 3, the last window left out)
    rather than counting windows twice; a split long enough gives the n asked, in window order."""
    from mtpjax.data import first_batches

    val = np.repeat(np.arange(1, 11), 4)  # window w holds the token w+1
    kw = {"seq_len": 4, "batch_size": 3, "seed": 0}
    short = first_batches(_prepared([1] * 8, val=val), 5, **kw)
    assert [_window_ids(b) for b in short] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [_window_ids(b) for b in first_batches(_prepared([1] * 8, val=val), 2, **kw)] == [[0, 1, 2], [3, 4, 5]]


def test_processes_read_their_rows_of_the_same_global_batches():
    kw = {"split": "train", "seq_len": 4, "batch_size": 6, "seed": 3, "num_epochs": 2}
    whole = list(make_iterator(_numbered(42), **kw))
    halves = [list(make_iterator(_numbered(42), **kw, rows=r)) for r in ([0, 1, 2], [3, 4, 5])]
    assert len(whole) == len(halves[0]) == len(halves[1]) == 14
    glued = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)]
    assert _same(whole, glued)
    odd = list(make_iterator(_numbered(42), **kw, rows=[5, 0]))  # rows in the order given
    assert _same(odd, [{k: b[k][[5, 0]] for k in b} for b in whole])
    epoch1 = [w for b in whole[:7] for w in _window_ids(b)]
    assert sorted(epoch1) == list(range(42))  # one epoch covers every window once


def test_single_source_stream_is_grain_shuffle_then_batch():
    """One source keeps the stream a single process always had: shuffle, repeat, batch."""
    import grain

    ds = grain.MapDataset.range(30).shuffle(seed=5).repeat().batch(4)
    it = make_iterator(_numbered(30), split="train", seq_len=4, batch_size=4, seed=5)
    assert [_window_ids(next(it)) for _ in range(20)] == [list(map(int, ds[s])) for s in range(20)]


def test_state_restore_continues_exactly_across_epochs():
    kw = {"split": "train", "seq_len": 4, "batch_size": 4, "seed": 1}
    it = make_iterator(_numbered(12), **kw)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    reference = _take(it, 6)  # crosses the epoch boundary (3 batches per epoch)
    resumed = make_iterator(_numbered(12), **kw)
    resumed.set_state(state)
    assert _same(reference, _take(resumed, 6))


def test_prefetch_threads_do_not_change_batches_or_state():
    kw = {"split": "train", "seq_len": 4, "batch_size": 4, "seed": 5}
    plain, threaded = make_iterator(_numbered(30), **kw), make_iterator(_numbered(30), **kw, num_workers=2)
    assert _same(_take(plain, 9), _take(threaded, 9))
    assert threaded.get_state() == plain.get_state()


def test_state_from_other_settings_is_refused():
    state = make_iterator(_numbered(12), split="train", seq_len=4, batch_size=4, seed=1).get_state()
    other = make_iterator(_numbered(12), split="train", seq_len=4, batch_size=2, seed=1)
    with pytest.raises(DataError, match=r"saved with batch_size=4 \(now 2\); resume with the same data and batch "
                                        r"settings, or pass --fresh \(or set another train.run_dir\) to start over"):
        other.set_state(state)


def test_state_of_a_changed_corpus_is_refused_as_changed_data(monkeypatch):
    """Tokens that differ from the saved position's (the corpus' files edited) are named as such, not as two content
    hashes."""
    kw = {"split": "train", "seq_len": 4, "batch_size": 4, "seed": 1}
    state = make_iterator(_numbered(12), **kw).get_state()
    edited = _numbered(12)
    monkeypatch.setitem(edited.meta, "content_hash", "0" * 32)
    with pytest.raises(DataError) as e:
        make_iterator(edited, **kw).set_state(state)
    assert str(e.value) == ("data iterator state was saved with other tokens in the corpus (files or the tokenizer "
                            "changed since); resume with the same data and batch settings, or pass --fresh (or set "
                            "another train.run_dir) to start over")


def test_val_iterator_is_one_finite_epoch_in_order():
    batches = list(make_iterator(_numbered(10), split="train", seq_len=4, batch_size=3, seed=0, shuffle=False,
                                 num_epochs=1))
    assert [w for b in batches for w in _window_ids(b)] == list(range(9))


def test_iterator_reads_a_memmapped_prepared_split(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 50)
    p = prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / "a.txt"),)))
    assert isinstance(p.train_tokens, np.memmap)
    batch = next(make_iterator(p, split="train", seq_len=16, batch_size=2, seed=0, shuffle=False))
    assert p.tokenizer.decode(batch["tokens"][0]) == "hello world, hel"


# ----------------------------------------------------------------------------- errors of the pipeline


def test_corpus_smaller_than_one_batch_names_both_counts():
    with pytest.raises(DataError, match=r"has 40 tokens but one batch needs 4 x 16 = 64"):
        make_iterator(_numbered(10), split="train", seq_len=16, batch_size=4, seed=0)
    # a short validation split is the held-out share's: its fixes are named (they were only batch, length and data)
    with pytest.raises(DataError, match=r"has 4 tokens .* data.seq_len, raise data.val_fraction \(or skip evals: "
                                        r"train.eval_batches=0\), or add data$"):
        make_iterator(_numbered(10), split="val", seq_len=16, batch_size=4, seed=0)


@pytest.mark.parametrize("rows", [[], [0, 0], [4], [-1], [[0]]])
def test_rows_must_be_distinct_rows_of_the_batch(rows):
    with pytest.raises(DataError, match="are not distinct rows of a batch of 4"):
        make_iterator(_numbered(10), split="train", seq_len=4, batch_size=4, seed=0, rows=rows)


def test_unknown_split():
    with pytest.raises(DataError, match="unknown split 'test'"):
        make_iterator(_numbered(10), split="test", seq_len=4, batch_size=1, seed=0)


# ----------------------------------------------------------------------------- stdlib corpus


@pytest.fixture(scope="module")
def stdlib_prepared(tmp_path_factory):
    return prepare(DataConfig(cache_dir=str(tmp_path_factory.mktemp("stdlib"))))


def test_stdlib_excludes_dirs_and_hash_is_stable(stdlib_prepared, tmp_path, corpus_builds):
    keys = [k for _, k in sources.stdlib_files()]
    assert "os.py" in keys and "json/__init__.py" in keys
    for k in keys:
        assert not sources.STDLIB_EXCLUDE & set(k.split("/")[:-1]), k
    assert not any(k.startswith("lib2to3/tests") for k in keys)
    again = prepare(DataConfig(cache_dir=str(tmp_path)))  # built afresh in another cache
    assert len(corpus_builds) == 1  # (the build counter sees a build)
    assert again.content_hash == stdlib_prepared.content_hash and len(again.content_hash) == 64
    np.testing.assert_array_equal(again.val_tokens, stdlib_prepared.val_tokens)
    m = stdlib_prepared.meta
    non_empty = sum(1 for f, _ in sources.stdlib_files() if f.stat().st_size)  # empty __init__.py: no document
    assert m["files"] == len(keys) and m["train"]["docs"] + m["val"]["docs"] == non_empty < len(keys)
    assert m["train"]["tokens"] == len(stdlib_prepared.train_tokens) > 10 * m["val"]["tokens"] > 0


def test_stdlib_split_follows_key_hash(stdlib_prepared):
    files = sources.stdlib_files()
    val = [k for _, k in files if sources.is_val(k, 0.05)]
    assert 0 < len(val) < len(files) and stdlib_prepared.meta["val"]["docs"] == len(val)
    first_val = next(f for f, k in files if sources.is_val(k, 0.05))
    assert _docs(stdlib_prepared, "val")[0] == first_val.read_text(encoding="utf-8").replace("\x00", "")


def test_second_prepare_uses_the_cache(stdlib_prepared, corpus_builds):
    again = prepare(DataConfig(cache_dir=str(stdlib_prepared.dir.parent)))
    assert again.dir == stdlib_prepared.dir and again.meta == stdlib_prepared.meta
    assert corpus_builds == []  # read from the cache, not tokenized again


# ----------------------------------------------------------------------------- text sources and split


def test_txt_and_jsonl_sources_split_disjointly_by_key(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    texts = {f"sub/f{i}.txt": f"file {i} ü\n" * (i + 1) for i in range(30)}
    for k, t in texts.items():
        (d / k).write_text(t)
    lines = [json.dumps({"text": f"line {i}"}) for i in range(30)]
    (d / "more.jsonl").write_text("\n".join(lines[:15]) + "\n\n" + "\n".join(lines[15:]) + "\n")
    (d / "ignored.csv").write_text("not,read")
    cfg = _cfg(tmp_path, source="text", paths=(str(d),), val_fraction=0.3)
    p = prepare(cfg)
    keys = list(texts) + [f"more.jsonl:{n}" for n in [*range(1, 16), *range(17, 32)]]
    docs = list(texts.values()) + [f"line {i}" for i in range(30)]
    by_key = dict(zip(keys, docs))
    order = sorted(keys, key=lambda k: (k.startswith("sub"), k if k.startswith("sub") else ""))  # walk order
    want_val = [by_key[k] for k in order if sources.is_val(k, 0.3)]
    want_train = [by_key[k] for k in order if not sources.is_val(k, 0.3)]
    assert _docs(p, "val") == want_val and _docs(p, "train") == want_train
    assert want_val and want_train and not set(want_val) & set(want_train)
    assert p.meta["split"] == "hash" and p.meta["train"]["docs"] == len(want_train)
    assert prepare(cfg).content_hash == p.content_hash


def test_single_text_file_falls_back_to_a_tail_split(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("abcdefghij" * 10)
    p = prepare(_cfg(tmp_path, source="text", paths=(str(f),), val_fraction=0.1))
    assert p.meta["split"] == "tail"
    whole = np.concatenate([p.train_tokens, p.val_tokens])
    np.testing.assert_array_equal(whole, list(b"abcdefghij" * 10) + [0])
    assert len(p.val_tokens) == 10


def test_changed_file_gets_a_new_cache_entry(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("first version " * 10)
    cfg = _cfg(tmp_path, source="text", paths=(str(f),))
    a = prepare(cfg)
    f.write_text("second version, longer " * 10)
    b = prepare(cfg)
    assert a.dir != b.dir and a.content_hash != b.content_hash


@pytest.mark.parametrize("recorded", [True, False])
def test_a_damaged_cache_entry_is_refused_by_name(tmp_path, recorded):
    """meta.json records each cached file's digest; a changed byte in train.npy is refused with the fix. Companion:
    an entry without the record (as written before digests) hands the changed token to training."""
    f = tmp_path / "one.txt"
    f.write_text("some text to cache " * 10)
    cfg = _cfg(tmp_path, source="text", paths=(str(f),))
    p = prepare(cfg)
    assert set(p.meta["digests"]) >= {"train.npy", "val.npy"}
    before, arr = np.array(p.train_tokens), p.dir / "train.npy"
    raw = bytearray(arr.read_bytes())
    raw[-3] ^= 0x01  # a token id's bits, past the .npy header
    arr.write_bytes(bytes(raw))
    if recorded:
        with pytest.raises(DataError, match=f"'{p.dir}' is damaged: train.npy does not match its xxh3-128 digest; "
                                            "delete that directory"):
            prepare(cfg)
        return
    meta = json.loads((p.dir / "meta.json").read_text())
    del meta["digests"]
    (p.dir / "meta.json").write_text(json.dumps(meta))
    assert (np.asarray(prepare(cfg).train_tokens) != before).sum() == 1


@pytest.mark.parametrize("meta", [b'{"content_hash": "ab', b"[]", b"\xff\xfe"])
def test_a_damaged_meta_json_is_refused_by_name(tmp_path, meta):
    """meta.json is the one file of an entry its digests do not cover: cut short, not an object or not text, it is
    refused with the same line as a damaged array (the intact entry loads: the test above)."""
    f = tmp_path / "one.txt"
    f.write_text("some text to cache " * 10)
    cfg = _cfg(tmp_path, source="text", paths=(str(f),))
    entry = prepare(cfg).dir
    (entry / "meta.json").write_bytes(meta)
    with pytest.raises(DataError, match=f"'{entry}' is damaged: meta.json is not the JSON object preparation "
                                        "writes; delete that directory"):
        prepare(cfg)


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
    """data.cache_dir naming a file is a one-line refusal (as on several hosts), the file untouched."""
    f, cache = tmp_path / "one.txt", tmp_path / "cache"
    f.write_text("some text to cache " * 10)
    cache.write_text("mine")
    with pytest.raises(DataError, match=f"data.cache_dir '{cache}' is not writable .*; choose a writable "
                                        "data.cache_dir"):
        prepare(DataConfig(source="text", paths=(str(f),), cache_dir=str(cache)))
    assert cache.read_text() == "mine"


def test_non_utf8_text_warns_and_replaces(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("café ".encode("latin-1") * 20)
    with pytest.warns(UserWarning, match="not valid UTF-8"):
        p = prepare(_cfg(tmp_path, source="text", paths=(str(f),)))
    assert "caf\ufffd " in p.tokenizer.decode(np.concatenate([p.train_tokens, p.val_tokens]))


def test_a_command_prints_the_utf8_warning_as_one_line(tmp_path):
    """Our warnings reach a command's user as one `warning:` line, as errors do (it was Python's two lines: the
    warning's file and line in mtpjax, then that source line)."""
    f = tmp_path / "latin.txt"
    f.write_bytes("café ".encode("latin-1") * 20)
    out = subprocess.run([sys.executable, "-m", "mtpjax.data", "prepare", "data.source=text", f"data.paths=[{f}]",
                          f"data.cache_dir={tmp_path / 'c'}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stderr.splitlines() if "UTF-8" in ln or "Warning" in ln or "warn(" in ln]
    assert out.returncode == 0 and lines == [f"warning: 1 file(s) are not valid UTF-8 (first: {f}); "
                                             "undecodable bytes were replaced with U+FFFD"], out.stderr


def test_a_utf8_byte_order_mark_is_no_part_of_the_text(tmp_path):
    """A BOM opening a .jsonl file (as Notepad or PowerShell write it) made its first line "not a JSON object"; it is
    dropped there and from a .txt file's text, and the corpus equals the one without it (companion: a BOM inside a
    document, not opening its file, is text and stays)."""
    docs = [{"text": f"line {i} of the corpus"} for i in range(30)]
    body = "".join(json.dumps(d) + "\r\n" for d in docs)
    for name, text in (("plain", body), ("bom", "\ufeff" + body)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_text(text, encoding="utf-8", newline="")
        (tmp_path / name / "b.txt").write_text(("\ufeff" if name == "bom" else "") + "a text \ufeff file")
    plain, bom = (prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / n),))) for n in ("plain", "bom"))
    for split in ("train_tokens", "val_tokens"):
        np.testing.assert_array_equal(getattr(plain, split), getattr(bom, split))
    joined = bom.tokenizer.decode(np.concatenate([bom.train_tokens, bom.val_tokens]))
    assert "line 0 of the corpus" in joined and "a text \ufeff file" in joined and not joined.startswith("\ufeff")


# ----------------------------------------------------------------------------- array sources


def test_npy_and_bin_sources(tmp_path):
    a = np.array([5, 6, 0, 7, 8, 9, 0] * 20, np.int32)
    np.save(tmp_path / "a.npy", a)
    b = np.array([10, 11, 12] * 20, np.uint16)  # no final EOS: one is added
    b.tofile(tmp_path / "b.bin")
    p = prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "a.npy"), str(tmp_path / "b.bin"))))
    whole = np.concatenate([p.train_tokens, p.val_tokens])
    np.testing.assert_array_equal(whole, np.concatenate([a, b, [0]]))
    assert p.train_tokens.dtype == np.uint16 and p.meta["split"] == "tail"


def test_array_ids_beyond_vocab(tmp_path):
    np.save(tmp_path / "a.npy", np.array([1, 2, 300, 0], np.int32))
    with pytest.raises(DataError, match="token id 300 outside the tokenizer's vocab"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "a.npy"),)))
    np.save(tmp_path / "a.npy", np.array([1, -2, 0], np.int32))
    with pytest.raises(DataError, match="token id -2"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "a.npy"),)))


@pytest.mark.parametrize("arr, match", [(np.zeros((2, 2), np.int32), "1-D integer"),
                                        (np.zeros(4, np.float32), "1-D integer")])
def test_array_of_wrong_shape_or_dtype(tmp_path, arr, match):
    np.save(tmp_path / "a.npy", arr)
    with pytest.raises(DataError, match=match):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "a.npy"),)))


def test_array_source_rejects_other_files(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="not a .npy or .bin"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "a.txt"),)))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="odd number of bytes"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "odd.bin"),)))


# ----------------------------------------------------------------------------- path errors


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="does not exist; fix data.paths"):
        prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / "nope"),)))


def test_unknown_source_and_empty_paths(tmp_path):
    # The pydantic config refuses an unknown source when it is built (one line naming the choices); the data layer's
    # own guard still holds for a config built without validation.
    with pytest.raises(ConfigError, match="config key 'data.source' = 'web' is invalid: expected one of stdlib"):
        _cfg(tmp_path, source="web")
    with pytest.raises(DataError, match="unknown data.source 'web'"):
        prepare(_cfg(tmp_path).model_copy(update={"source": "web"}))
    with pytest.raises(DataError, match="data.paths is empty"):
        prepare(_cfg(tmp_path, source="text"))


def test_stdlib_without_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "stdlib_root", lambda: tmp_path)
    with pytest.raises(DataError, match="no .py files under the stdlib"):
        prepare(_cfg(tmp_path))


def test_unreadable_npy_and_unsplittable_corpus(tmp_path):
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="not a readable .npy file"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "bad.npy"),)))
    np.save(tmp_path / "one.npy", np.array([0], np.int32))
    with pytest.raises(DataError, match="only 1 token"):
        prepare(_cfg(tmp_path, source="array", paths=(str(tmp_path / "one.npy"),)))


def test_directory_without_data_files(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="has no .txt/"):
        prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / "d"),)))


def test_empty_files(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(DataError, match=r"hold no data \(2 file\(s\), all empty\)"):
        prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"))))


@pytest.mark.parametrize("line", ["not json", '{"body": "x"}', '["text"]', '{"text": 3}'])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=r"a.jsonl:2 is not a JSON object"):
        prepare(_cfg(tmp_path, source="text", paths=(str(f),)))


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_conventions():
    tok = ByteTokenizer()
    text = "héllo\x00 wörld ✓"
    ids = tok.encode(text)
    assert tok.eos_id == 0 and tok.vocab_size == 256 and 0 not in ids
    assert tok.decode(ids) == text.replace("\x00", "")
    assert tok.decode([104, 0, 105, 300, 106]) == "hi\ufffdj"  # EOS dropped, unknown id marked
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character decodes with replacement
    assert tok.decode([300, 104, -1]) == "\ufffdh\ufffd" and tok.decode(np.array(ids)) == text.replace("\x00", "")
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


@pytest.fixture(scope="module")
def bpe_prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus"
    corpus.mkdir()
    for f, k in sources.stdlib_files()[:40]:
        (corpus / (k.replace("/", "_") + ".txt")).write_bytes(f.read_bytes())
    return prepare(DataConfig(source="text", paths=(str(corpus),), tokenizer="bpe", bpe_vocab_size=400,
                              cache_dir=str(root / "cache")))


def test_bpe_trains_and_round_trips(bpe_prepared):
    tok = bpe_prepared.tokenizer
    assert tok.vocab_size == 400 and tok.eos_id == 0 and bpe_prepared.meta["vocab_size"] == 400
    text = "def f(x):\n    return x * 2  # ünïcode ✓\n\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.decode(ids + [0] + ids) == text + text
    assert 0 not in tok.encode("a <|eos|> b") and tok.decode(tok.encode("a <|eos|> b")) == "a <|eos|> b"
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    assert (bpe_prepared.dir / "tokenizer.json").is_file()
    assert int(np.max(bpe_prepared.train_tokens)) < 400
    first = _docs(bpe_prepared, "train")[0]
    assert first == next(f for f, k in sources.text_files((str(bpe_prepared.meta["paths"][0]),))
                         if not sources.is_val(k, 0.05)).read_text()


def test_tokenizer_save_and_reload(bpe_prepared, tmp_path):
    run = bpe_prepared.tokenizer.save(tmp_path / "run")
    again = tokenizer_from_dir(run)
    text = "import os\nprint(os.sep)\n"
    assert again.encode(text) == bpe_prepared.tokenizer.encode(text) and again.eos_id == 0
    assert load_tokenizer(bpe_prepared.dir).vocab_size == 400
    ByteTokenizer().save(tmp_path / "b")
    assert isinstance(tokenizer_from_dir(tmp_path / "b"), ByteTokenizer)


def test_user_tokenizer_json(bpe_prepared, tmp_path):
    (tmp_path / "t.txt").write_text("for i in range(10):\n    pass\n" * 30)
    cfg = _cfg(tmp_path, source="text", paths=(str(tmp_path / "t.txt"),),
               tokenizer=str(bpe_prepared.dir / "tokenizer.json"))
    p = prepare(cfg)
    assert p.meta["tokenizer_kind"] == "hf" and p.tokenizer.vocab_size == 400
    assert p.tokenizer.decode(np.concatenate([p.train_tokens, p.val_tokens])) == "for i in range(10):\n    pass\n" * 30
    assert load_tokenizer(cfg).encode("pass") == p.tokenizer.encode("pass")


def test_bpe_is_deterministic(tmp_path):
    texts = [f"alpha beta {i} gamma delta " * 5 for i in range(50)]
    a, b = train_bpe(iter(texts), 300), train_bpe(iter(texts), 300)
    assert a.encode(texts[3]) == b.encode(texts[3])


def test_tokenizer_file_that_does_not_parse(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": "nonsense"}')
    with pytest.raises(DataError, match="does not parse as a tokenizers JSON"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")))


def test_tokenizer_without_eos(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="no end-of-document token"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "t.json")))


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare(_cfg(tmp_path, tokenizer=str(tmp_path / "nope.json")))
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))


SP_LINES = [f"the cat {i} sat on the mat and looked at the dog number {i % 7}" for i in range(200)]


def _sp_model(path: Path, **kw) -> Path:
    """A sentencepiece model of 40 pieces trained here on SP_LINES (unk 0, bos 1, eos 2 unless `kw` says)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(SP_LINES), model_prefix=str(path.with_suffix("")),
                                   vocab_size=40, minloglevel=2, **kw)
    return path


def test_sentencepiece_model_needs_the_package_and_a_valid_file(tmp_path, monkeypatch):
    (tmp_path / "sp.model").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match=r"sp.model' does not parse as a sentencepiece model \(.*\); pass a valid "):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "sp.model")))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # the optional package absent: import fails
    with pytest.raises(DataError, match="is a sentencepiece model but the package is not installed; run `pip install "
                                        "sentencepiece`"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "sp.model")))


def test_sentencepiece_tokenizer_prepares_decodes_and_travels_with_the_run(tmp_path):
    model = _sp_model(tmp_path / "m.model")
    text = "\n".join(SP_LINES[:40])
    (tmp_path / "t.txt").write_text(text)
    p = prepare(_cfg(tmp_path, source="text", paths=(str(tmp_path / "t.txt"),), tokenizer=str(model)))
    tok = p.tokenizer
    assert p.meta["tokenizer_kind"] == "sentencepiece" and (tok.vocab_size, tok.eos_id) == (40, 2)
    ids = np.concatenate([p.train_tokens, p.val_tokens]).tolist()
    assert ids[-1] == 2 and ids.count(2) == 1 and tok.decode(ids) == tok.decode(tok.encode(text))
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"
    cat = tok.encode("cat")
    assert tok.decode([*cat, 2, 99, *cat]) == "cat\ufffdcat"  # EOS dropped, an id past the vocabulary replaced
    again = tokenizer_from_dir(tok.save(tmp_path / "run"))
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == model.read_bytes()
    assert again.encode("the dog number 3") == tok.encode("the dog number 3")


def test_sentencepiece_without_eos_or_file(tmp_path):
    model = _sp_model(tmp_path / "m.model", eos_id=-1)
    with pytest.raises(DataError, match="has no EOS id"):
        load_tokenizer(str(model))
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "other.model"))


def test_bpe_spec_needs_preparation_and_dir_meta_must_be_valid(tmp_path):
    with pytest.raises(DataError, match="call mtpjax.data.prepare first"):
        load_tokenizer("bpe")
    (tmp_path / "tokenizer_meta.json").write_text("{broken")
    with pytest.raises(DataError, match="is corrupt"):
        tokenizer_from_dir(tmp_path)
    (tmp_path / "tokenizer_meta.json").write_text('{"kind": "wordpiece"}')
    with pytest.raises(DataError, match="unknown tokenizer kind 'wordpiece'"):
        tokenizer_from_dir(tmp_path)


def test_unknown_tokenizer_spec():
    with pytest.raises(DataError, match="unknown data.tokenizer 'wordpiece'"):
        load_tokenizer(DataConfig(tokenizer="wordpiece"))


def test_tokenizer_from_empty_dir(tmp_path):
    with pytest.raises(DataError, match="no tokenizer in"):
        tokenizer_from_dir(tmp_path)


def test_check_vocab():
    check_vocab(ByteTokenizer(), 256)
    with pytest.raises(DataError, match="tokenizer has 256 ids but model.vocab_size=200; set model.vocab_size >= 256"):
        check_vocab(ByteTokenizer(), 200)


# ----------------------------------------------------------------------------- atomic cache


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partial_temp_dir_of_a_dead_process_is_cleaned(tmp_path):
    import socket

    from mtpjax.data import cache_path

    (tmp_path / "a.txt").write_text("some text " * 20)
    cfg = _cfg(tmp_path, source="text", paths=(str(tmp_path / "a.txt"),))
    final = cache_path(cfg)
    final.parent.mkdir(parents=True)
    stale = final.parent / f".tmp-{final.name}-{socket.gethostname()}~{_dead_pid()}~abcd"
    stale.mkdir()
    (stale / "train.raw").write_bytes(b"half")
    p = prepare(cfg)
    assert p.dir == final and not stale.exists()
    assert len(p.train_tokens) + len(p.val_tokens) == 201


def test_failed_preparation_leaves_no_cache_entry(tmp_path, monkeypatch):
    from mtpjax.data import corpus

    (tmp_path / "a.txt").write_text("some text " * 20)
    cfg = _cfg(tmp_path, source="text", paths=(str(tmp_path / "a.txt"),))

    def boom(*a, **k):
        raise KeyboardInterrupt  # as if killed while writing meta.json

    monkeypatch.setattr(corpus.encode, "tokenize_batch", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    assert prepare(cfg).meta["train"]["tokens"] + prepare(cfg).meta["val"]["tokens"] == 201


def test_concurrent_preparations_agree(tmp_path):
    (tmp_path / "a.txt").write_text("shared text " * 2000)
    code = ("import sys; from mtpjax.config import ConfigError, DataConfig; from mtpjax.data import prepare; "
            f"p = prepare(DataConfig(source='text', paths=({str(tmp_path / 'a.txt')!r},), "
            f"cache_dir={str(tmp_path / 'c')!r})); print(p.dir, len(p.train_tokens))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    assert [d.name for d in (tmp_path / "c").iterdir()] == [Path(outs[0].split()[0]).name]


def test_final_dir_without_meta_is_rebuilt(tmp_path, corpus_builds):
    from mtpjax.data import cache_path

    (tmp_path / "a.txt").write_text("some text " * 20)
    cfg = _cfg(tmp_path, source="text", paths=(str(tmp_path / "a.txt"),))
    cache_path(cfg).mkdir(parents=True)
    (cache_path(cfg) / "train.npy").write_bytes(b"junk")
    rebuilt = prepare(cfg)
    fresh = prepare(cfg.model_copy(update={"cache_dir": str(tmp_path / "fresh")}))
    assert len(corpus_builds) == 2 and rebuilt.dir == cache_path(cfg)  # built again, not trusted
    np.testing.assert_array_equal(rebuilt.train_tokens, fresh.train_tokens)
    np.testing.assert_array_equal(rebuilt.val_tokens, fresh.val_tokens)
    same = lambda meta: {k: v for k, v in meta.items() if k != "seconds"}  # all but the time it took
    assert same(rebuilt.meta) == same(fresh.meta) and len(rebuilt.train_tokens) > 0


# ----------------------------------------------------------------------------- CLI


def test_cli_prepare_good_and_bad(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "a.txt").write_text("cli text " * 30)
    good = subprocess.run([sys.executable, "-m", "mtpjax.data", "prepare", "data.source=text",
                           f"data.paths=[{tmp_path / 'a.txt'}]", f"data.cache_dir={tmp_path / 'c'}"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert good.returncode == 0, good.stderr
    assert "prepared text corpus" in good.stdout and "train:" in good.stdout
    bad = subprocess.run([sys.executable, "-m", "mtpjax.data", "prepare", "data.source=text",
                          f"data.paths=[{tmp_path / 'missing'}]", f"data.cache_dir={tmp_path / 'c'}"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [(f"error: data path '{tmp_path / 'missing'}' does not exist; "
                                                "fix data.paths")]


@pytest.mark.parametrize("overrides, match", [
    (["data.bogus=1"], "unknown config key 'data.bogus'"),
    (["model.vocab_size=100"], "tokenizer has 256 ids but model.vocab_size=100"),
    (["data.tokenizer=nope"], "unknown data.tokenizer 'nope'"),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=512", "model.vocab_size=300"],
     "data.bpe_vocab_size=512 exceeds model.vocab_size=300"),
    (["data.paths=[]"], "data.source=text needs at least one path"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, overrides, match):
    (tmp_path / "a.txt").write_text("cli text " * 30)
    rc = cli_main(["prepare", "data.source=text", f"data.paths=[{tmp_path / 'a.txt'}]",
                   f"data.cache_dir={tmp_path / 'c'}", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and match in err[0]
