"""Data: corpus sources, tokenizers, cached preparation, mixtures and the global batch stream.

Public API: prepare (a PreparedData, or a PreparedMixture for data.mixture), make_iterator, open_run_data,
eval_by_source, prepare_on_hosts, local_rows, load_tokenizer, tokenizer_from_dir, Tokenizer, check_vocab,
DataError (see each module's docstring for the formats and conventions).
"""

from __future__ import annotations

from pathlib import Path

from mtpjax.data.corpus import PreparedData, cache_path, data_config_of, prepare, summary
from mtpjax.data.errors import DataError
from mtpjax.data.mixture import PreparedMixture
from mtpjax.data.tokenizer import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer, check_vocab,
                                   load_spec, tokenizer_from_dir, train_bpe)


_LAZY = {"BatchIterator": "pipeline", "make_iterator": "pipeline", "segment_ids": "pipeline",
         "open_run_data": "run", "eval_by_source": "run", "first_batches": "run", "prepare_on_hosts": "hosts",
         "local_rows": "hosts"}


def __getattr__(name: str):
    # grain takes ~2 s to import; `python -m mtpjax.data prepare` and tokenizer users do not need it
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mtpjax.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mtpjax.data' has no attribute '{name}'")


def load_tokenizer(data_cfg_or_dir) -> Tokenizer:
    """The tokenizer of a DataConfig/Config (bpe: prepares the corpus, cached), a saved directory or a spec."""
    if isinstance(data_cfg_or_dir, (str, Path)):
        if Path(data_cfg_or_dir).expanduser().is_dir():
            return tokenizer_from_dir(data_cfg_or_dir)
        return load_spec(str(data_cfg_or_dir))
    cfg = data_config_of(data_cfg_or_dir)
    if cfg.tokenizer == "bpe":
        return prepare(cfg).tokenizer
    return load_spec(cfg.tokenizer)


def check_vocab_early(data_cfg, vocab_size: int) -> None:
    """check_vocab before any preparation (bpe: its requested size bounds the trained vocab)."""
    if data_cfg.tokenizer == "bpe":
        if data_cfg.bpe_vocab_size > vocab_size:
            raise DataError(f"data.bpe_vocab_size={data_cfg.bpe_vocab_size} exceeds model.vocab_size={vocab_size}; "
                            f"set model.vocab_size >= {data_cfg.bpe_vocab_size}")
    else:
        check_vocab(load_spec(data_cfg.tokenizer), vocab_size)


__all__ = ["BatchIterator", "ByteTokenizer", "DataError", "HFTokenizer", "PreparedData", "PreparedMixture",
           "SentencePieceTokenizer", "Tokenizer", "cache_path", "check_vocab", "check_vocab_early", "eval_by_source",
           "first_batches", "load_tokenizer", "local_rows", "make_iterator", "open_run_data", "prepare",
           "prepare_on_hosts", "segment_ids", "summary", "tokenizer_from_dir", "train_bpe"]
