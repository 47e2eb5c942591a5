"""A prepared corpus as the rest of the code sees it (its own module: corpus builds it, mixture holds several)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mtpjax import checksum
from mtpjax.data.errors import DataError
from mtpjax.data.tokenizer import Tokenizer


@dataclass
class PreparedData:
    """A prepared corpus: its cache dir, meta.json contents, tokenizer and (memory-mapped) token arrays."""

    dir: Path
    meta: dict
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray

    def tokens(self, split: str) -> np.ndarray:
        """The flat token array of 'train' or 'val'."""
        if split not in ("train", "val"):
            raise DataError(f"unknown split '{split}'; use 'train' or 'val'")
        return self.train_tokens if split == "train" else self.val_tokens

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]

    def sources(self) -> list[tuple[str, float, PreparedData]]:
        """(name, weight, prepared) of each source: one unnamed source here (a mixture has several)."""
        return [("", 1.0, self)]


def file_digests(entry: Path) -> dict[str, str]:
    """{file name: xxh3-128 digest} of a cache entry's files (token arrays, tokenizer), meta.json aside."""
    return {p.name: checksum.of_file(p) for p in sorted(entry.iterdir()) if p.is_file() and p.name != "meta.json"}


def check_files(entry: Path, meta: dict) -> None:
    """DataError naming the first file of a cache entry that no longer matches the digest its meta.json recorded
    (an entry written before digests were recorded is not checked)."""
    for name, want in (meta.get("digests") or {}).items():
        p = entry / name
        if not p.is_file() or checksum.of_file(p) != want:
            raise damaged(entry, f"{name} does not match its {checksum.ALGORITHM} digest")


def damaged(entry: Path, what: str) -> DataError:
    """The error for a cache entry whose files cannot be trusted: `what` is wrong; deleting it rebuilds it."""
    return DataError(f"the prepared data cache entry '{entry}' is damaged: {what}; delete that directory and it is "
                     "rebuilt on the next run")
