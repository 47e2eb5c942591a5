"""Weighted mixtures (`data.mixture`): every source prepared and cached on its own, one shared tokenizer.

Each source is an ordinary corpus (its own cache entry, keyed by its own files), so changing weights or
adding a source never re-tokenizes the others. The training stream samples windows from the sources by
weight (pipeline.py); validation reports the mixture and every source (`eval/<name>/...`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from mtpjax.data.errors import DataError
from mtpjax.data.prepared import PreparedData


@dataclass
class PreparedMixture:
    """The prepared sources of a mixture with their normalized weights."""

    names: list[str]
    weights: list[float]
    parts: list[PreparedData]

    @property
    def tokenizer(self):
        return self.parts[0].tokenizer

    @property
    def content_hash(self) -> str:
        spec = [[n, w, p.content_hash] for n, w, p in zip(self.names, self.weights, self.parts)]
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()

    @property
    def meta(self) -> dict:
        return {"content_hash": self.content_hash, "sources": {n: p.meta for n, p in zip(self.names, self.parts)}}

    def sources(self) -> list[tuple[str, float, PreparedData]]:
        """(name, normalized weight, prepared) of each source, in config order."""
        return list(zip(self.names, self.weights, self.parts))

    def part(self, name: str) -> PreparedData:
        return self.parts[self.names.index(name)]

    @property
    def val_tokens(self):
        """Every source's validation tokens, joined (held-out prompts spread over the sources)."""
        import numpy as np

        return np.concatenate([p.val_tokens for p in self.parts])


def source_config(data_cfg, m):
    """The single-source DataConfig of one mixture entry (everything else shared)."""
    return data_cfg.model_copy(update={"source": m.source, "paths": tuple(m.paths), "text_field": m.text_field,
                                      "mixture": ()})


def prepare_mixture(data_cfg, prepare, *, progress: bool = False) -> PreparedMixture:
    """Prepare (or load from the cache) every source of data_cfg.mixture with `prepare` (corpus's); errors name
    the source."""
    if data_cfg.tokenizer == "bpe":  # the config schema refuses this too; a BPE per source would differ
        raise DataError("data.mixture needs one fixed tokenizer; set data.tokenizer to byte or a tokenizer.json")
    parts = []
    for m in data_cfg.mixture:
        try:
            parts.append(prepare(source_config(data_cfg, m), progress=progress))
        except DataError as e:
            raise DataError(f"data.mixture source '{m.name}': {e}") from None
    total = sum(m.weight for m in data_cfg.mixture)
    return PreparedMixture([m.name for m in data_cfg.mixture], [m.weight / total for m in data_cfg.mixture], parts)


def summary(p: PreparedMixture, one) -> str:
    """The summary of every source (`one`: corpus's summary of one), with its weight."""
    return "\n".join(f"mixture source '{n}' (weight {w:.3f}):\n" + one(part) for n, w, part in p.sources())
