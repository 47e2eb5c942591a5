"""Corpus preparation: read a source, tokenize, split, and cache flat token arrays atomically.

The cache directory `<data.cache_dir>/<source>-<tokenizer>-<key>` is keyed by a hash of the source,
its files' paths/sizes/mtimes, the text field, the tokenizer spec (and its file's stat), bpe_vocab_size
and val_fraction; never by worker counts (they do not change the arrays). A `data.mixture` prepares each
source into its own entry (see mixture.py).

An entry holds `train.npy`, `val.npy` (uint16, or int32 for vocabularies over 65536; documents joined with
EOS after each; written in place, the header filled in at the end), `meta.json` and the tokenizer's files.
It is built in a `.tmp-*` sibling and renamed into place, so a killed preparation never leaves a directory
that is later mistaken for a finished one; temp dirs of dead processes on this host are deleted by the
next `prepare`.

Split: text documents go to validation by a hash of their key (see sources.is_val). When that leaves a
side empty (e.g. a single .txt file) and for pre-tokenized arrays, the joined stream is cut instead:
the last `val_fraction` of its tokens is the validation split (meta["split"] says which was used).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from mtpjax.data import encode, sources, synthetic
from mtpjax.data.errors import DataError, cache_unwritable
from mtpjax.data.prepared import PreparedData, check_files, damaged, file_digests
from mtpjax.data.tokenizer import Tokenizer, load_spec, tokenizer_file, tokenizer_from_dir, tokenizer_kind, train_bpe

FORMAT = 2  # 2: content hash over per-unit digests
BPE_MAX_TRAIN_BYTES = 32 << 20  # BPE merges stabilise long before this; keeps training to seconds
TEXT_SOURCES = ("text", "parquet", "arrow")  # the sources data.text_field applies to


def _files(cfg) -> list[tuple[Path, str]]:
    if cfg.source in synthetic.KINDS:  # generated: no files
        return []
    if cfg.source == "stdlib":
        return sources.stdlib_files()
    if cfg.source == "text":
        return sources.text_files(tuple(cfg.paths))
    if cfg.source == "array":
        return sources.array_files(tuple(cfg.paths))
    if cfg.source in ("parquet", "arrow"):
        return sources.table_files(tuple(cfg.paths), cfg.source)
    raise DataError(f"unknown data.source '{cfg.source}'; use stdlib, text, array, parquet, arrow, "
                    f"{' or '.join(synthetic.KINDS)}")


def _key(cfg, files, kind: str) -> str:
    spec: dict[str, Any] = {"format": FORMAT, "source": cfg.source, "files": sources.file_stats(files),
                            "tokenizer": cfg.tokenizer, "val_fraction": cfg.val_fraction}
    if cfg.source in TEXT_SOURCES:
        spec["text_field"] = cfg.text_field
    if cfg.source == "stdlib":
        spec["python"] = sys.version
    if cfg.source in synthetic.KINDS:
        spec["synthetic"] = synthetic.spec(cfg)
    if kind == "bpe":
        spec["bpe_vocab_size"] = cfg.bpe_vocab_size
    tf = tokenizer_file(cfg.tokenizer)
    if tf is not None:
        if not tf.is_file():
            raise DataError(f"tokenizer file '{tf}' does not exist; "
                            "set data.tokenizer to byte, bpe or an existing file")
        spec["tokenizer_file"] = sources.file_stats([(tf, "")])
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cfg) -> Path:
    """Where `prepare(cfg)` keeps (or will keep) this corpus."""
    return _entry(cfg, _files(cfg), tokenizer_kind(cfg.tokenizer))


def _entry(cfg, files: list, kind: str) -> Path:
    return Path(cfg.cache_dir).expanduser() / f"{cfg.source}-{kind}-{_key(cfg, files, kind)}"


def _load(d: Path) -> PreparedData:
    try:
        meta = json.loads((d / "meta.json").read_bytes())
    except ValueError:  # not JSON, or not UTF-8
        meta = None
    if not isinstance(meta, dict):
        raise damaged(d, "meta.json is not the JSON object preparation writes")
    check_files(d, meta)
    return PreparedData(d, meta, tokenizer_from_dir(d), np.load(d / "train.npy", mmap_mode="r"),
                        np.load(d / "val.npy", mmap_mode="r"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(final: Path) -> None:
    """Delete temp dirs of this cache entry left by dead processes on this host."""
    host = socket.gethostname()
    for t in final.parent.glob(f".tmp-{final.name}-*"):
        parts = t.name[len(f".tmp-{final.name}-"):].split("~")
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            shutil.rmtree(t, ignore_errors=True)


def prepare(data_cfg, *, progress: bool = False):
    """The prepared corpus of `data_cfg` (a DataConfig), built and cached if needed; a PreparedMixture for a mixture."""
    if getattr(data_cfg, "mixture", ()):
        from mtpjax.data.mixture import prepare_mixture

        return prepare_mixture(data_cfg, prepare, progress=progress)
    kind = tokenizer_kind(data_cfg.tokenizer)
    files = _files(data_cfg)
    final = _entry(data_cfg, files, kind)
    if (final / "meta.json").is_file():
        return _load(final)
    # tables are opened (columns checked) before anything is written
    text_like = data_cfg.source not in ("array", *synthetic.KINDS)
    units = sources.units(data_cfg.source, files, data_cfg.text_field) if text_like else []
    tmp = final.parent / f".tmp-{final.name}-{socket.gethostname()}~{os.getpid()}~{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale(final)
        if final.exists() and not (final / "meta.json").is_file():  # no meta.json: not ours to trust
            shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise cache_unwritable(final.parent, e) from None
    try:
        _build(data_cfg, files, units, kind, tmp, progress)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: its copy is equivalent
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(final)


def _npy_header(dtype, n: int) -> bytes:
    buf = io.BytesIO()  # numpy pads the header so that a longer shape fits in the same bytes
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                               "shape": (n,)})
    return buf.getvalue()


class _Sink:
    """Appends token ids straight into a .npy file whose header `finish` fills in (no copy of the tokens)."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.n, self.docs = path, np.dtype(dtype), 0, 0
        self._f = open(path, "wb")  # noqa: SIM115 - open across add() calls, closed by close()
        self._f.write(_npy_header(self.dtype, 0))

    def add(self, ids: np.ndarray, docs: int) -> None:
        self._f.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self.n += len(ids)
        self.docs += docs

    def close(self) -> None:
        self._f.close()

    def finish(self, stop: int | None = None) -> int:
        """Keep the first `stop` tokens (default all) and write the real header; the token count."""
        stop = self.n if stop is None else stop
        head = _npy_header(self.dtype, stop)
        if len(head) != len(_npy_header(self.dtype, 0)):
            raise AssertionError("the .npy header outgrew its reserved bytes")
        with open(self.path, "r+b") as f:
            f.truncate(len(head) + stop * self.dtype.itemsize)
            f.write(head)
        return stop

    def copy_tail(self, out: Path, start: int, chunk: int = 1 << 24) -> int:
        """Write tokens [start, n) to a new .npy file; their count."""
        src = np.memmap(self.path, dtype=self.dtype, mode="r", offset=len(_npy_header(self.dtype, 0)), shape=(self.n,))
        dst = np.lib.format.open_memmap(out, mode="w+", dtype=self.dtype, shape=(self.n - start,))
        for s in range(start, self.n, chunk):
            dst[s - start:min(s + chunk, self.n) - start] = src[s:min(s + chunk, self.n)]
        dst.flush()
        del dst, src
        return self.n - start


def _make_tokenizer(cfg, units, kind: str, progress: bool) -> Tokenizer:
    if kind != "bpe":
        return load_spec(cfg.tokenizer)
    if cfg.source in synthetic.KINDS:
        return train_bpe((x.text for x in synthetic.instances(cfg, "train")), cfg.bpe_vocab_size)

    def texts():
        seen, utf8 = 0, sources.Utf8Tracker()
        bar = encode.Progress(progress, min(BPE_MAX_TRAIN_BYTES, sum(u.size for u in units)), "train bpe")
        try:
            for u in units:
                for key, text in sources.read_unit(u, cfg.text_field, utf8):
                    if sources.is_val(key, cfg.val_fraction):
                        continue
                    yield text
                    seen += len(text)
                    if seen >= BPE_MAX_TRAIN_BYTES:
                        return
                bar.advance(u.size)
        finally:
            bar.close()

    tok = train_bpe(texts(), cfg.bpe_vocab_size)
    if tok.eos_id != 0:
        raise AssertionError("the trained BPE must have <|eos|> as id 0")
    return tok


def _text_streams(cfg, units, tok, out: Path, sinks, progress) -> str:
    """Tokenize text documents into the train/val sinks by key hash (in worker processes if asked); content hash."""
    bar = encode.Progress(progress, sum(u.size for u in units), f"prepare {cfg.source}")
    try:
        if cfg.prepare_workers > 0 and len(encode.tasks_of(units)) > 1:
            content_hash, bad = encode.encode_workers(units, cfg.text_field, out, cfg.val_fraction, sinks, bar,
                                                      cfg.prepare_workers)
        else:
            content_hash, bad = encode.encode_here(units, cfg.text_field, tok, cfg.val_fraction, sinks, bar)
    finally:
        bar.close()
    sources.Utf8Tracker().warn(bad)
    return content_hash


def _array_stream(files, tok, sink, progress) -> str:
    """Copy pre-tokenized arrays into one sink (EOS between files), checking ids; returns the content hash."""
    h = hashlib.sha256()
    bar = encode.Progress(progress, sum(f.stat().st_size for f, _ in files), "copy arrays")
    try:
        for f, key in files:
            arr = sources.load_array(f)
            if len(arr):
                sources.check_ids(arr, tok.vocab_size, str(f))
                h.update(key.encode() + b"\0" + np.ascontiguousarray(arr).tobytes())
                sink.add(arr, 0)
                if int(arr[-1]) != tok.eos_id:
                    sink.add(np.array([tok.eos_id]), 0)
            bar.advance(f.stat().st_size, len(arr))
    finally:
        bar.close()
    return h.hexdigest()


def _build(cfg, files, units, kind: str, out: Path, progress: bool) -> None:
    t0 = time.time()
    tok = _make_tokenizer(cfg, units, kind, progress)
    tok.save(out)  # worker processes load it from here
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    sinks = {s: _Sink(out / f"{s}.npy", dtype) for s in ("train", "val")}
    if cfg.source == "array":
        content_hash = _array_stream(files, tok, sinks["train"], progress)
    elif cfg.source in synthetic.KINDS:
        content_hash = synthetic.write(cfg, tok, sinks)
    else:
        content_hash = _text_streams(cfg, units, tok, out, sinks, progress)
    for s in sinks.values():
        s.close()
    total = sinks["train"].n + sinks["val"].n
    if total == 0:
        raise DataError(f"data.paths {list(cfg.paths)} hold no data ({len(files)} file(s), all empty); "
                        "point data.paths at non-empty files")
    split = "hash"
    if cfg.source in synthetic.KINDS and not (sinks["train"].n and sinks["val"].n):
        # cutting the stream would put training instances into validation
        raise DataError(f"the {cfg.source} corpus of {cfg.synthetic_instances} instances left the "
                        f"{'val' if sinks['train'].n else 'train'} split empty; raise data.synthetic_instances")
    if sinks["train"].n and sinks["val"].n:
        stats = {s: {"docs": sinks[s].docs, "tokens": sinks[s].finish()} for s in sinks}
    else:
        split = "tail"
        whole = sinks["train"] if sinks["train"].n else sinks["val"]
        if whole.n < 2:
            raise DataError(f"the corpus has only {whole.n} token(s); it cannot be split into train and val")
        if whole is sinks["val"]:  # every document hashed to val: the stream becomes train.npy, then is cut
            os.replace(whole.path, out / "train.npy")
            whole.path = out / "train.npy"
        cut = whole.n - min(whole.n - 1, max(1, round(whole.n * cfg.val_fraction)))
        val_tokens = whole.copy_tail(out / "val.npy", cut)
        stats = {"train": {"docs": None, "tokens": whole.finish(cut)}, "val": {"docs": None, "tokens": val_tokens}}
    meta = {"format": FORMAT, "source": cfg.source, "paths": list(cfg.paths), "files": len(files),
            "text_field": cfg.text_field if cfg.source in TEXT_SOURCES else None,
            "synthetic": synthetic.spec(cfg) if cfg.source in synthetic.KINDS else None,
            "tokenizer": cfg.tokenizer, "tokenizer_kind": tok.kind, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "dtype": np.dtype(dtype).name, "val_fraction": cfg.val_fraction,
            "bpe_vocab_size": cfg.bpe_vocab_size if kind == "bpe" else None, "content_hash": content_hash,
            "split": split, "train": stats["train"], "val": stats["val"],
            "seconds": round(time.time() - t0, 3), "digests": file_digests(out)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def summary(p) -> str:
    """A few human-readable lines about a prepared corpus (every source of a mixture)."""
    if not isinstance(p, PreparedData):
        from mtpjax.data.mixture import summary as mixture_summary

        return mixture_summary(p, summary)
    m = p.meta
    tr, va = m["train"], m["val"]
    docs = lambda s: f"{s['docs']} docs, " if s["docs"] is not None else ""
    return (f"prepared {m['source']} corpus in {p.dir}\n"
            f"  tokenizer {m['tokenizer']} ({m['tokenizer_kind']}, vocab {m['vocab_size']}, eos {m['eos_id']})\n"
            f"  train: {docs(tr)}{tr['tokens']} tokens; val: {docs(va)}{va['tokens']} tokens ({m['split']} split)\n"
            f"  content hash {m['content_hash'][:16]}  ({m['seconds']} s to build)")


def data_config_of(cfg):
    """The DataConfig of a Config, or the DataConfig itself."""
    return cfg.data if hasattr(cfg, "data") and hasattr(cfg, "model") else cfg
