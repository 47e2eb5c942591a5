"""Speculative decoding: the jitted loop (loop), the proposer contract (protocol) and proposers, samplers, caches
and their size (cache), the host API (host, api; text in and out: text, prompts), γ by timing (autodraft) and its
first guess before any timing (firstguess), streaming (stream)."""

from mtpjax.decode.api import generate
from mtpjax.decode.host import DecodeError, GenerateResult, make_loop, run, summarize
from mtpjax.decode.proposers import DraftModelProposer, MTPChainProposer, MTPProposer, MTPTreeProposer, NgramProposer
from mtpjax.decode.prompts import PromptError
from mtpjax.decode.protocol import Proposer
from mtpjax.decode.sampling import Sampler, make_sampler
from mtpjax.decode.text import Generator, TextResult

__all__ = ["generate", "DecodeError", "GenerateResult", "make_loop", "run", "summarize", "MTPProposer",
           "MTPChainProposer", "MTPTreeProposer", "NgramProposer", "DraftModelProposer", "Proposer", "Sampler",
           "make_sampler", "Generator", "TextResult", "PromptError"]
