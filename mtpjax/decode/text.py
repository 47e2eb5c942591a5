"""Text in, text out: a model and its tokenizer behind `generate`, for callers who start from strings.

    gen = mtpjax.load("runs/tiny")            # or Generator(model, tokenizer, cfg.decode)
    out = gen("def fibonacci(n):", max_new_tokens=64, draft=1, temperature=0.7, top_k=40)
    out.text, out.stats["tokens_per_round"]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpjax.config import DecodeConfig
from mtpjax.decode.api import generate
from mtpjax.decode.prompts import PromptError


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids; PromptError for an empty one (generate's own check speaks of token ids, not text)."""
    ids = [tokenizer.encode(t) for t in texts]
    if any(len(p) == 0 for p in ids):
        raise PromptError("empty prompt: give at least one character of text")
    return ids


@dataclass(frozen=True)
class TextResult:
    """The continuations (without their prompts) as text and token ids, and generate's stats."""

    texts: list[str]
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The first (for one prompt: the only) continuation."""
        return self.texts[0]


@dataclass
class Generator:
    """A loaded model and its tokenizer; calling it with a string (or a list of strings) generates text.

    Settings default to `decode` (the run's decode section: decode.py's defaults); keyword arguments of a call
    are generate's (draft, proposer, temperature, top_k, top_p, seed, on_commit, ...) and win over them.
    """

    model: object
    tokenizer: object
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __call__(self, prompts: str | list[str], **kw) -> TextResult:
        ids = encode(self.tokenizer, self._texts(prompts))
        res = generate(self.model, ids, **{**self.defaults(), **kw})
        return TextResult([self.tokenizer.decode(t) for t in res.tokens], res.tokens, res.stats)

    def defaults(self) -> dict:
        """generate's keyword arguments from the decode section (a call's own win over them)."""
        d = self.decode
        return {"max_new_tokens": d.max_new_tokens, "proposer": d.proposer, "temperature": d.temperature,
                "top_k": d.top_k, "top_p": d.top_p, "max_len": d.max_len, "eos_id": self.tokenizer.eos_id,
                "draft": d.draft}

    @staticmethod
    def _texts(prompts) -> list[str]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts):
            return list(prompts)
        if isinstance(prompts, (list, tuple)) and prompts:
            raise PromptError("a Generator takes text (a string or a list of strings); for token ids call "
                              "mtpjax.generate(model, [ids, ...], ...)")
        raise PromptError(f"prompts must be a string or a non-empty list of strings, not {prompts!r:.40}")
