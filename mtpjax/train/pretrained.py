"""`mtpjax.load(run_dir)`: a trained run as a text-in, text-out Generator (its model, tokenizer and decode section)."""

from __future__ import annotations

from pathlib import Path

from mtpjax.decode.text import Generator
from mtpjax.train.checkpoint import load_model


def load(run_dir: str | Path, step: int | None = None) -> Generator:
    """The run's checkpoint (latest by default) as a Generator; CheckpointError if the run has none."""
    cfg, model, tok = load_model(run_dir, step)
    return Generator(model, tok, cfg.decode)
