"""Corpus sources: the running interpreter's stdlib, users' text / JSON-lines / Parquet / Arrow files, token arrays.

Text-like sources are read as units (a file, a Parquet row group, an Arrow record batch) of `(key, text)`
documents; the key (a relative path, plus a line number for JSON lines or a row number for tables) decides
the train/validation split by hash, so the split does not depend on where the corpus lives. JSON lines and
tables read the text from `data.text_field`; null or empty texts are no document. Non-UTF-8 bytes are
decoded with errors="replace" and one warning names the affected files (the corpus stays usable; an
error would block e.g. a stdlib with one latin-1 file). A UTF-8 byte-order mark opening a file is dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtpjax.data.errors import DataError
from mtpjax.errors import MtpjaxWarning

STDLIB_EXCLUDE = frozenset({"test", "tests", "idlelib", "encodings", "pydoc_data", "site-packages",
                            "__pycache__"})
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
ARRAY_SUFFIXES = (".npy", ".bin")
BOM = "\ufeff"  # the byte-order mark some editors write first in a UTF-8 file: no part of the text


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[Path, str]]:
    """(path, relative key) of the stdlib's *.py files outside the excluded directories, sorted."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDE)
        rel_dir = Path(dirpath).relative_to(root)
        out += [(Path(dirpath) / f, (rel_dir / f).as_posix()) for f in filenames if f.endswith(".py")]
    if not out:
        raise DataError(f"no .py files under the stdlib '{root}'; use data.source=text with data.paths")
    return sorted(out, key=lambda x: x[1])


def _walk(paths: tuple[str, ...], suffixes: tuple[str, ...], what: str) -> list[tuple[Path, str]]:
    """(file, key) for every path (files as given, directories walked for `suffixes`), sorted per path."""
    if not paths:
        raise DataError(f"data.paths is empty; list the {what} files or directories to read")
    out = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise DataError(f"data path '{raw}' does not exist; fix data.paths")
        if p.is_file():
            out.append((p, p.name))
            continue
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        if not found:
            raise DataError(f"data path '{raw}' has no {'/'.join(suffixes)} files; fix data.paths")
        out += [(f, f.relative_to(p).as_posix()) for f in found]
    return out


def text_files(paths: tuple[str, ...]) -> list[tuple[Path, str]]:
    """The files of a text source (.txt: one document per file; .jsonl/.json: one per line)."""
    return _walk(paths, TEXT_SUFFIXES + JSONL_SUFFIXES, "text (.txt/.jsonl)")


def table_files(paths: tuple[str, ...], source: str) -> list[tuple[Path, str]]:
    """The files of a parquet or arrow source (directories are walked for their suffixes)."""
    from mtpjax.data.tables import ARROW_SUFFIXES, PARQUET_SUFFIXES

    suffixes = PARQUET_SUFFIXES if source == "parquet" else ARROW_SUFFIXES
    return _walk(paths, suffixes, "Parquet" if source == "parquet" else "Arrow IPC")


def array_files(paths: tuple[str, ...]) -> list[tuple[Path, str]]:
    """The files of a pre-tokenized source (.npy int arrays or .bin raw uint16)."""
    files = _walk(paths, ARRAY_SUFFIXES, "token array (.npy/.bin)")
    for f, _ in files:
        if f.suffix not in ARRAY_SUFFIXES:
            raise DataError(f"data path '{f}' is not a .npy or .bin file; data.source=array reads only those")
    return files


def file_stats(files: list[tuple[Path, str]]) -> list[list]:
    """[resolved path, size, mtime_ns] per file: what the cache key depends on."""
    out = []
    for f, _ in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


class Utf8Tracker:
    """Decodes bytes as UTF-8 with replacement and remembers which files needed it (each once)."""

    def __init__(self):
        self.bad: dict[str, None] = {}

    def decode(self, raw: bytes, name: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.bad[name] = None
            return raw.decode("utf-8", errors="replace")

    def warn(self, names=None) -> None:
        """One warning naming the first bad file of `names` (default: those seen here)."""
        bad = list(self.bad if names is None else names)
        if bad:
            warnings.warn(f"{len(bad)} file(s) are not valid UTF-8 (first: {bad[0]}); "
                          "undecodable bytes were replaced with U+FFFD", MtpjaxWarning, stacklevel=3)


@dataclass(frozen=True)
class Unit:
    """What preparation reads as one piece: a text or JSON-lines file, a Parquet row group, an Arrow batch."""

    path: str
    key: str  # the file's key (relative path); documents get key or key:line / key:row
    kind: str  # txt | jsonl | parquet | arrow
    part: int = -1  # row group / record batch (-1: the whole file)
    first_row: int = 0  # rows of the file before this part
    size: int = 0  # bytes, for the progress bar


def units(source: str, files: list[tuple[Path, str]], field: str) -> list[Unit]:
    """The units of a text-like source in reading order; checks every table's text column first."""
    if source in ("parquet", "arrow"):
        from mtpjax.data import tables

        return [Unit(str(f), key, source, part, row, size) for f, key in files
                for part, row, size in tables.parts(f, source, field)]
    return [Unit(str(f), key, "jsonl" if f.suffix in JSONL_SUFFIXES else "txt", size=f.stat().st_size)
            for f, key in files]


def _jsonl_docs(u: Unit, field: str, utf8: Utf8Tracker) -> Iterator[tuple[str, str]]:
    with open(u.path, "rb") as fh:  # line by line: a JSON-lines file is never held in memory whole
        for n, raw in enumerate(fh, 1):
            line = utf8.decode(raw, u.path)
            if n == 1:
                line = line.removeprefix(BOM)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            text = obj.get(field) if isinstance(obj, dict) else 0
            if not isinstance(obj, dict) or field not in obj or not (text is None or isinstance(text, str)):
                raise DataError(f"{u.path}:{n} is not a JSON object with a string \"{field}\" field; write one "
                                f"{{\"{field}\": ...}} object per line or set data.text_field")
            if text:  # null and "" are no document
                yield f"{u.key}:{n}", text


def read_unit(u: Unit, field: str, utf8: Utf8Tracker) -> Iterator[tuple[str, str]]:
    """(key, text) for every non-empty document of a unit, in order."""
    try:
        if u.kind == "txt":
            text = utf8.decode(Path(u.path).read_bytes(), u.path).removeprefix(BOM)
            if text:
                yield u.key, text
        elif u.kind == "jsonl":
            yield from _jsonl_docs(u, field, utf8)
    except OSError as e:  # a file that lists but does not read (an I/O error, no permission)
        raise DataError(f"data file '{u.path}' cannot be read ({e.strerror or e}); fix data.paths") from None
    if u.kind in ("parquet", "arrow"):
        from mtpjax.data import tables

        yield from tables.read_part(Path(u.path), u.key, u.kind, u.part, u.first_row, field,
                                    lambda raw: utf8.decode(raw, u.path))


def is_val(key: str, val_fraction: float) -> bool:
    """Deterministic split: the document goes to validation when the hash of its key falls below the fraction."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h < val_fraction * 2**64


def load_array(f: Path) -> np.ndarray:
    """A read-only view of one pre-tokenized file (memory-mapped); DataError if it is not 1-D integers."""
    if f.suffix == ".bin":
        if f.stat().st_size % 2:
            raise DataError(f"'{f}' has an odd number of bytes; .bin files hold raw uint16 tokens")
        return np.memmap(f, dtype=np.uint16, mode="r") if f.stat().st_size else np.zeros(0, np.uint16)
    try:
        arr = np.load(f, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DataError(f"'{f}' is not a readable .npy file ({e}); save it with numpy.save") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"'{f}' holds a {arr.dtype} array of shape {arr.shape}; expected a 1-D integer array")
    return arr


def check_ids(arr: np.ndarray, vocab_size: int, name: str, chunk: int = 1 << 24) -> None:
    """DataError when any id is negative or >= vocab_size (scanned in chunks so memmaps stay cheap)."""
    for s in range(0, len(arr), chunk):
        part = np.asarray(arr[s:s + chunk])
        lo, hi = int(part.min()), int(part.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(f"'{name}' holds token id {bad} outside the tokenizer's vocab [0, {vocab_size}); "
                            "use the tokenizer the array was made with (data.tokenizer)")
