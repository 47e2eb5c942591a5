"""Bits per byte of the main head (`eval/bits_per_byte`): a loss that byte-level and BPE runs share.

    bits/byte = Σ CE_main / (ln 2 · Σ bytes(target))

over the evaluated main-head targets (the valid depth-0 positions of the validation batches), CE in nats,
bytes(t) the UTF-8 bytes token t decodes to. End-of-document tokens count 0 bytes: they decode to no text
(every tokenizer's `decode` drops them), so the denominator is the size of the evaluated text itself,
whatever the tokenizer; their cross-entropy stays in the numerator (ending a document is part of
predicting it). On the byte tokenizer this makes bits/byte = Σ CE / (ln 2 · (targets − EOS targets)),
slightly above loss/main / ln 2.

Byte lengths are exact for the byte tokenizer and for `tokenizer.json` files with a byte-level decoder
(the BPE trained here, GPT-2 / Llama 3 / Qwen style) or a sentencepiece-style one (`▁` for spaces,
`<0xNN>` byte-fallback pieces). For other tokenizers (including sentencepiece `.model` files)
`token_byte_lengths` returns None and training does not log the metric rather than log a guess.
"""

from __future__ import annotations

import functools
import json
import math
import re

import jax
import numpy as np

from mtpjax.nn.loss import targets, valid_masks

_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _decoder_types(spec: dict | None) -> set[str]:
    """Types of a tokenizer.json decoder, looking inside Sequence decoders."""
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in spec.get("decoders", [])))
    out = {spec.get("type")}
    if spec.get("type") == "Replace" and spec.get("content") == " ":
        out.add("ReplaceSpace")
    return out


def _hf_lengths(tokenizer) -> np.ndarray | None:
    tok = tokenizer._tok  # the `tokenizers` object; its JSON says how ids turn back into bytes
    kinds = _decoder_types(json.loads(tok.to_str()).get("decoder"))
    if "ByteLevel" in kinds:
        from tokenizers.pre_tokenizers import ByteLevel

        chars = set(ByteLevel.alphabet())  # the 256 printable stand-ins GPT-2's byte-level BPE writes bytes as
        piece_len = lambda p: sum(1 if c in chars else len(c.encode()) for c in p)
    elif kinds & {"Metaspace", "ReplaceSpace"}:
        fallback = "ByteFallback" in kinds
        piece_len = lambda p: 1 if fallback and _BYTE_PIECE.match(p) else len(p.replace("▁", " ").encode())
    else:
        return None
    added = tok.get_added_tokens_decoder()
    out = np.zeros(tokenizer.vocab_size, np.int64)
    for i in range(tokenizer.vocab_size):
        if i in added:  # added tokens are stored as their text; special ones are dropped by decode
            out[i] = 0 if added[i].special else len(added[i].content.encode())
        else:
            piece = tok.id_to_token(i)
            out[i] = 0 if piece is None else piece_len(piece)
    return out


@functools.lru_cache(maxsize=8)
def token_byte_lengths(tokenizer) -> np.ndarray | None:
    """int64[vocab]: UTF-8 bytes each id decodes to (EOS and special tokens 0); None if not exactly known."""
    if tokenizer.kind == "byte":
        out = np.ones(tokenizer.vocab_size, np.int64)
    elif tokenizer.kind == "hf":
        out = _hf_lengths(tokenizer)
        if out is None:
            return None
    else:
        return None
    out[tokenizer.eos_id] = 0
    return out


def target_counts(tokens_BT, segment_ids_BT, lengths_V: np.ndarray) -> tuple[int, int]:
    """(main-head targets, their UTF-8 bytes) in one batch, with the loss's own validity rule."""
    valid_BT = np.asarray(valid_masks(tokens_BT, segment_ids_BT, 0)[0])
    tgt_BT = np.asarray(targets(tokens_BT, (0,))[0])
    return int(valid_BT.sum()), int(lengths_V[tgt_BT[valid_BT]].sum())


def bits_per_byte(main_losses: list[float], counts: np.ndarray) -> float:
    """Σ CE / (ln 2 · Σ bytes) from each batch's mean main-head loss and its (targets, bytes)."""
    counts = np.asarray(counts, np.float64).reshape(-1, 2)
    nats = np.asarray(main_losses, np.float64) * np.maximum(1.0, counts[:, 0])  # mtp_loss divides by max(1, n)
    n_bytes = counts[:, 1].sum()
    return float(nats.sum() / (math.log(2) * n_bytes)) if n_bytes else float("nan")


def eval_bits_per_byte(batches: list[dict], main_losses: list[float], tokenizer) -> dict:
    """{'bits_per_byte': ...} for the eval metrics, or {} when the tokenizer's byte lengths are unknown.

    `batches` are this process's rows of each eval batch and `main_losses` the global batch means, so with
    several processes the counts are summed over processes (every process must call this).
    """
    lengths_V = token_byte_lengths(tokenizer)
    if lengths_V is None or not batches:
        return {}
    counts = np.array([target_counts(b["tokens"], b["segment_ids"], lengths_V) for b in batches], np.int64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        counts = np.asarray(multihost_utils.process_allgather(counts)).sum(0)
    return {"bits_per_byte": bits_per_byte(main_losses, counts)}
