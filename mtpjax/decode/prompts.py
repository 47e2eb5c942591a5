"""What `generate` accepts as prompts: a batch of token-id lists; anything else is one line naming the fix. And
decode.py's prompts file, one text prompt per line."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtpjax.errors import MtpjaxError

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
TEXT_HINT = "for text, use mtpjax.load(run_dir)(text) or mtpjax.Generator(model, tokenizer)"


class PromptError(MtpjaxError, ValueError):
    """Prompts of the wrong type or form (one line naming the problem and the fix)."""


def _is_id(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_token_prompts(prompts) -> None:
    """PromptError unless `prompts` is a batch (list, tuple or 2-D array) of token-id sequences."""
    if isinstance(prompts, (str, bytes)):
        raise PromptError(f"prompts is text ({prompts[:20]!r}); generate takes token ids, a list of lists: "
                          f"[tokenizer.encode(text)]; {TEXT_HINT}")
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 2 and np.issubdtype(prompts.dtype, np.integer):
            return
        raise PromptError(f"prompts is a {prompts.ndim}-D {prompts.dtype} array; pass int token ids shaped "
                          "[batch, length] (one prompt: ids[None])")
    if not isinstance(prompts, Sequence):
        raise PromptError(f"prompts is a {type(prompts).__name__}; pass a list of token-id lists ([[1, 2, 3]])")
    for i, p in enumerate(prompts):
        if _is_id(p):
            raise PromptError("prompts is one flat list of token ids; wrap it in a list, [ids], for a batch of one")
        if isinstance(p, (str, bytes)):
            raise PromptError(f"prompt {i} is text ({p[:20]!r}); generate takes token ids: "
                              f"[tokenizer.encode(text), ...]; {TEXT_HINT}")
        ids = p.tolist() if isinstance(p, np.ndarray) else p
        if not isinstance(ids, Sequence) or not all(map(_is_id, ids)):
            raise PromptError(f"prompt {i} is not a list of integer token ids ({type(p).__name__}: {str(p)[:40]})")


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of a file, one a line (only the escapes \\n, \\t and \\\\ are read); PromptError naming the file."""
    if path.is_dir():
        raise PromptError(f"prompts file '{path}' is a directory; give a file with one prompt per line")
    if not path.exists():  # anything else is read: a pipe too (--prompts-file <(...), /dev/stdin)
        raise PromptError(f"prompts file '{path}' does not exist")
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise PromptError(f"prompts file '{path}' cannot be read ({e.strerror or e}); give a readable file with one "
                          "prompt per line") from None
    lines = [re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m[1]], ln) for ln in text.splitlines()]
    if not lines:
        raise PromptError(f"prompts file '{path}' has no prompts; write one prompt per line")
    if "" in lines:  # a prompt needs text: say where, not only that one is empty
        raise PromptError(f"prompts file '{path}' line {lines.index('') + 1} is empty; remove its blank lines (each "
                          "line is one prompt)")
    return lines
