"""Tokenizers: raw bytes, byte-level BPE (trained here with `tokenizers`), a user's tokenizer.json or .model.

Every tokenizer has an end-of-document id (`eos_id`) that separates packed documents:
- byte: 256 ids, id = byte value; byte 0 (NUL) is the EOS id. NUL never occurs in real text, so NUL
  characters in the input are dropped when encoding rather than being mistaken for a document boundary.
- bpe / tokenizer.json: the `<|eos|>` token (id 0 for the BPE trained here), or the first of the
  usual end-of-text tokens a user's tokenizer has.
- sentencepiece: the model's own `eos_id()`; `sentencepiece` is an optional dependency.
`decode` drops EOS ids and turns ids the tokenizer does not know (a model's padded vocab) into U+FFFD.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from mtpjax.data.errors import DataError
from mtpjax.errors import first_line

EOS_TOKEN = "<|eos|>"
_EOS_CANDIDATES = (EOS_TOKEN, "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
META_FILE = "tokenizer_meta.json"
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Common interface: encode/decode, vocab_size, eos_id, save(dir)."""

    kind = "base"
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents (the HF tokenizer does it in parallel)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        """Write this tokenizer's files into `directory` so `tokenizer_from_dir` can load it back."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._save_files(d)
        meta = {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        (d / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        return d

    def _save_files(self, d: Path) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids (vocab 256); byte 0 is the document separator."""

    kind = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.replace("\x00", "").encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The encoding as raw bytes (fast path for corpus preparation)."""
        return text.replace("\x00", "").encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        flat = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64).reshape(-1)
        flat = flat[flat != self.eos_id]
        bad = (flat < 0) | (flat >= 256)
        if not bad.any():
            return flat.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        cuts = np.flatnonzero(bad)
        pieces = np.split(flat, cuts)  # each piece after the first starts with an unknown id
        return _REPLACEMENT.join(p[1 if i else 0:].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
                                 for i, p in enumerate(pieces))


class HFTokenizer(Tokenizer):
    """A `tokenizers` library tokenizer (tokenizer.json)."""

    kind = "hf"

    def __init__(self, tok, source: str = "<memory>"):
        self._tok = tok
        # a literal "<|eos|>" in a document is text, not a document boundary
        tok.encode_special_tokens = True
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eos = next((tok.token_to_id(t) for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(f"tokenizer '{source}' has no end-of-document token (one of "
                            f"{', '.join(_EOS_CANDIDATES)}); add one as a special token")
        self.eos_id = int(eos)

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """Load a tokenizer.json; DataError if it is missing or does not parse."""
        from tokenizers import Tokenizer as _Tok

        p = Path(path).expanduser()
        if not p.is_file():
            raise DataError(f"tokenizer file '{p}' does not exist; set data.tokenizer to byte, bpe or an existing file")
        try:
            tok = _Tok.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the Rust error has no public type; keep its first line
            raise DataError(f"tokenizer file '{p}' does not parse as a tokenizers JSON ({first_line(e)}); "
                            "pass a valid tokenizer.json") from None
        return cls(tok, str(p))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        parts, run = [], []
        for i in (int(i) for i in ids):
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts.append(self._tok.decode(run, skip_special_tokens=True) + _REPLACEMENT)
                run = []
        parts.append(self._tok.decode(run, skip_special_tokens=True))
        return "".join(parts)

    def _save_files(self, d: Path) -> None:
        self._tok.save(str(d / HF_FILE))


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` (needs the optional `sentencepiece` package)."""

    kind = "sentencepiece"

    def __init__(self, path: str | Path):
        p = Path(path).expanduser()
        if not p.is_file():
            raise DataError(f"tokenizer file '{p}' does not exist; set data.tokenizer to byte, bpe or an existing file")
        try:
            import sentencepiece as spm
        except ImportError:
            raise DataError(f"tokenizer '{p}' is a sentencepiece model but the package is not installed; "
                            "run `pip install sentencepiece`") from None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(p))
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError/...
            raise DataError(f"tokenizer file '{p}' does not parse as a sentencepiece model ({e}); "
                            "pass a valid .model file") from None
        self._path = p
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise DataError(f"sentencepiece model '{p}' has no EOS id; train it with --eos_id set")

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        parts, run = [], []
        for i in ids:
            if i == self.eos_id:
                continue
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts.append(self._sp.decode(run) + _REPLACEMENT)
                run = []
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def _save_files(self, d: Path) -> None:
        if self._path.resolve() != (d / SP_FILE).resolve():
            shutil.copyfile(self._path, d / SP_FILE)


def train_bpe(texts: Iterator[str], vocab_size: int, length: int | None = None) -> HFTokenizer:
    """Train a byte-level BPE with `<|eos|>` as id 0 on an iterator of documents."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(tok, "trained BPE")


def tokenizer_kind(spec: str) -> str:
    """Classify a data.tokenizer spec: byte | bpe | hf | sentencepiece; DataError for anything else."""
    if spec in ("byte", "bpe"):
        return spec
    p = Path(spec).expanduser()
    if p.suffix == ".json":
        return "hf"
    if p.suffix == ".model":
        return "sentencepiece"
    if p.is_dir() and (p / HF_FILE).is_file():
        return "hf"
    raise DataError(f"unknown data.tokenizer '{spec}'; use byte, bpe, a path to a tokenizer.json "
                    "or a sentencepiece .model file")


def tokenizer_file(spec: str) -> Path | None:
    """The file behind a path spec (None for byte/bpe)."""
    kind = tokenizer_kind(spec)
    if kind in ("byte", "bpe"):
        return None
    p = Path(spec).expanduser()
    return p / HF_FILE if p.is_dir() else p


def load_spec(spec: str) -> Tokenizer:
    """A tokenizer from a byte/file spec (bpe needs the prepared data: use load_tokenizer)."""
    kind = tokenizer_kind(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return HFTokenizer.from_file(tokenizer_file(spec))
    if kind == "sentencepiece":
        return SentencePieceTokenizer(tokenizer_file(spec))
    raise DataError("data.tokenizer=bpe is trained during preparation; call mtpjax.data.prepare first")


def tokenizer_from_dir(directory: str | Path) -> Tokenizer:
    """Load the tokenizer saved in a directory (prepared data or a run directory)."""
    d = Path(directory).expanduser()
    meta_path = d / META_FILE
    if meta_path.is_file():
        try:
            kind = json.loads(meta_path.read_text())["kind"]
        except (ValueError, KeyError):
            raise DataError(f"'{meta_path}' is corrupt; delete it and save the tokenizer again") from None
    elif (d / HF_FILE).is_file():
        kind = "hf"
    elif (d / SP_FILE).is_file():
        kind = "sentencepiece"
    else:
        raise DataError(f"no tokenizer in '{d}' ({META_FILE}, {HF_FILE} or {SP_FILE}); "
                        "a run directory's is written again when train.py resumes it; else save one there with "
                        "Tokenizer.save")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return HFTokenizer.from_file(d / HF_FILE)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(d / SP_FILE)
    raise DataError(f"'{meta_path}' names an unknown tokenizer kind '{kind}'; save the tokenizer again")


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """DataError unless the model's vocab (model.vocab_size) covers every tokenizer id."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={vocab_size}; "
                        f"set model.vocab_size >= {tokenizer.vocab_size}")
