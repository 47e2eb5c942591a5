"""The safetensors format, streamed: files written one tensor at a time, read as memory-mapped views.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with spaces, then the
raw little-endian bytes. The header is known before any tensor is read (shapes come from the config), so
a writer holds one tensor at a time; above `max_bytes` per file the tensors are split into
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, as transformers writes them.

Digests: the header's `__metadata__` records each tensor's xxh3-128 digest (`mtpjax.xxh3-128.<name>`, hashed
as the tensor is written; the header is written first with placeholders of the same length, then filled in).
Other readers ignore these keys; `Reader.array` checks a tensor against its digest when one is recorded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from mtpjax import checksum
from mtpjax.convert.errors import ConvertError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
           "F8_E4M3": ml_dtypes.float8_e4m3fn}  # DeepSeek-V3's fp8 weights (mtpjax.convert.fp8)
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
FLOATS = frozenset(np.dtype(_DTYPES[k]) for k in ("F64", "F32", "F16", "BF16"))  # float8 only with block scales


class Spec(NamedTuple):
    """One tensor to write: its name, shape, dtype and a function producing its array (called once, when written)."""

    name: str
    shape: tuple
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


DIGEST = f"mtpjax.{checksum.ALGORITHM}."  # + a tensor's name: a __metadata__ key
_UNSET = "0" * len(checksum.of_bytes(b""))


def _header(specs: list[Spec], digests: dict[str, str] | None = None) -> bytes:
    meta = {"format": "pt"} | {DIGEST + s.name: (digests or {}).get(s.name, _UNSET) for s in specs}
    head, offset = {"__metadata__": meta}, 0
    for s in specs:
        head[s.name] = {"dtype": _NAMES[np.dtype(s.dtype)], "shape": list(s.shape),
                        "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def write_file(path: Path, specs: list[Spec]) -> None:
    """Write one safetensors file, producing and releasing the tensors one by one; their digests go in the header."""
    header, digests = _header(specs), {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for s in specs:
            arr = np.ascontiguousarray(s.produce(), dtype=s.dtype)
            if arr.shape != tuple(s.shape):
                raise ConvertError(f"tensor {s.name} has shape {arr.shape}, expected {tuple(s.shape)}")
            digests[s.name] = checksum.of_array(arr)
            arr.tofile(f)  # raw little-endian bytes (every platform jax runs on), without a copy
            del arr
        f.seek(8)
        f.write(_header(specs, digests))  # the same length: digests replace placeholders of their size


def shard(specs: list[Spec], max_bytes: float) -> list[list[Spec]]:
    """Consecutive groups of at most max_bytes each (a larger tensor gets a file of its own)."""
    groups, size = [[]], 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.nbytes
    return groups


def write_checkpoint(directory: Path, specs: list[Spec], max_bytes: float) -> list[str]:
    """`model.safetensors`, or shards and their index when the total exceeds max_bytes; the file names written."""
    groups = shard(specs, max_bytes)
    if len(groups) == 1:
        write_file(directory / SINGLE, specs)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        write_file(directory / name, group)
        weight_map.update({s.name: name for s in group})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX]


class Entry(NamedTuple):
    file: Path
    dtype: np.dtype
    shape: tuple
    offset: int  # absolute byte offset of the data in the file
    digest: str | None  # recorded by an mtpjax export


def _read_header(path: Path) -> dict[str, Entry]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ValueError("header length is implausible")
            head = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ConvertError(f"'{path}' is not a readable safetensors file ({e})") from None
    size, out = path.stat().st_size, {}
    meta = head.get("__metadata__") or {}
    for name, info in head.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            why = " (float8 other than e4m3); dequantize the checkpoint to bfloat16 first" if str(
                info.get("dtype")).startswith("F8") else ""
            raise ConvertError(f"tensor {name} in '{path}' has unsupported dtype {info.get('dtype')}{why}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize or 8 + n + end > size:
            raise ConvertError(f"tensor {name} in '{path}' has offsets that do not match its shape or the file")
        out[name] = Entry(path, np.dtype(dt), shape, 8 + n + begin, meta.get(DIGEST + name))
    return out


class Reader:
    """The tensors of a Hugging Face directory (model.safetensors, or the shards its index names), read lazily."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        if (d / INDEX).is_file():
            try:
                files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConvertError(f"'{d / INDEX}' is not a valid safetensors index") from None
            missing = [f for f in files if not (d / f).is_file()]
            if missing:
                raise ConvertError(f"'{d / INDEX}' names {missing[0]}, which is not in '{d}'")
        elif (d / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ConvertError(f"'{d}' has no {SINGLE} or {INDEX}")
        self.entries: dict[str, Entry] = {}
        self.checked: set[str] = set()
        for f in files:
            self.entries.update(_read_header(d / f))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def array(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view; checked once against its recorded digest, if there is one."""
        e = self.entries[name]
        if 0 in e.shape:  # np.memmap cannot map zero bytes
            return np.zeros(e.shape, e.dtype)
        a = np.memmap(e.file, e.dtype, "r", offset=e.offset, shape=e.shape or (1,)).reshape(e.shape)
        if e.digest is not None and name not in self.checked:
            if checksum.of_array(a) != e.digest:
                raise ConvertError(f"tensor {name} in '{e.file}' does not match its {checksum.ALGORITHM} digest (a "
                                   "changed or flipped byte); export it again or restore the file from a good copy")
            self.checked.add(name)
        return a
