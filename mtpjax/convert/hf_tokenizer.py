"""Tokenizer files for `AutoTokenizer`: tokenizer.json + tokenizer_config.json encoding text to mtpjax's ids.

The byte tokenizer becomes a `tokenizers` BPE with no merges over the byte-level alphabet, so each byte is
one token whose id is its value; id 0 is `<|eos|>` instead of the NUL byte, which no token spells, so a NUL
in the text is dropped, as mtpjax drops it. A literal `<|eos|>` in a document stays text on both sides
(`split_special_tokens`). Our own `tokenizer_meta.json` is written too, so import restores the same class.

transformers 5 ignores `tokenizer_config.json`'s class for model types it lists as shipping a wrong one (qwen2
among them) and rebuilds the model type's class (Qwen2Tokenizer: Qwen2's pre-tokenizer + NFC) from the vocab and
merges alone, which splits otherwise than our tokenizer.json. An `auto_map` entry is the one thing that skips
that override; without trust_remote_code it then loads the tokenizer.json as written, and with it the tiny
module written beside it, a subclass that adds nothing (transformers 4 loads it as before either way).
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpjax.convert.errors import ConvertError
from mtpjax.data.tokenizer import (
    EOS_TOKEN,
    HF_FILE,
    ByteTokenizer,
    Tokenizer,
)

CONFIG_FILE = "tokenizer_config.json"
MODULE_FILE = "tokenization_mtpjax.py"
MODULE_TEXT = '''"""The exported run's tokenizer: tokenizer.json as written (tokenizer_config.json's auto_map)."""

try:
    from transformers import TokenizersBackend as _Base  # transformers 5
except ImportError:
    from transformers import PreTrainedTokenizerFast as _Base  # transformers 4


class MtpjaxTokenizer(_Base):
    """tokenizer.json's pipeline unchanged: no __init__, so transformers does not rebuild it from vocab/merges."""
'''


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (the ByteLevel pre-tokenizer's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer_json():
    """A `tokenizers` Tokenizer whose ids are mtpjax's byte ids (id 0 = <|eos|>)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars()) if b != ByteTokenizer.eos_id}
    vocab[EOS_TOKEN] = ByteTokenizer.eos_id
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def check_exportable(tok: Tokenizer, vocab_size: int | None = None) -> None:
    """ConvertError unless `tok` can be written as tokenizer.json (for a model of `vocab_size` ids, if given)."""
    if tok.kind not in ("byte", "hf"):
        raise ConvertError(f"a {tok.kind} tokenizer cannot be exported as tokenizer.json; "
                           "export runs trained with data.tokenizer=byte, bpe or a tokenizer.json")
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ConvertError(f"the run's tokenizer has {tok.vocab_size} ids but model.vocab_size={vocab_size}")


# Post-processors that add special tokens (Llama 3's BOS, BERT's [CLS]): mtpjax encodes without them, and engines
# encode with add_special_tokens=True, so the export drops them to give the engines the run's ids.
ADDS_TOKENS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def ids_as_ours(post: dict | None) -> dict | None:
    """A tokenizer.json post_processor without the parts that add special tokens (None if nothing else is left)."""
    if post is None or post["type"] in ADDS_TOKENS:
        return None
    if post["type"] == "Sequence":
        kept = [p for p in map(ids_as_ours, post["processors"]) if p is not None]
        return {**post, "processors": kept} if kept else None
    return post


def export_tokenizer(tok: Tokenizer, directory: Path, max_len: int) -> str:
    """Write tokenizer.json, tokenizer_config.json, tokenization_mtpjax.py (and tokenizer_meta.json) into
    `directory`; the EOS token's text."""
    check_exportable(tok)
    tok.save(directory)  # tokenizer_meta.json (+ tokenizer.json for an HF tokenizer)
    if isinstance(tok, ByteTokenizer):
        inner = byte_tokenizer_json()
        inner.save(str(directory / HF_FILE))
    else:
        inner, spec = tok._tok, json.loads((directory / HF_FILE).read_text())
        (directory / HF_FILE).write_text(json.dumps({**spec, "post_processor": ids_as_ours(spec["post_processor"])}))
    eos = inner.id_to_token(tok.eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "bos_token": None,
              "unk_token": None, "model_max_length": max_len, "split_special_tokens": True,
              "clean_up_tokenization_spaces": False,
              "auto_map": {"AutoTokenizer": [None, f"{MODULE_FILE.removesuffix('.py')}.MtpjaxTokenizer"]}}
    (directory / MODULE_FILE).write_text(MODULE_TEXT)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return eos
