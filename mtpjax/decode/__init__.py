"""Speculative decoding: the jitted loop (loop), the proposer contract (protocol) and proposers (proposers: plain, a
draft model and the registry; mtp_proposers: the MTP modules' chains and trees; ngram: prompt lookup), samplers, caches
and their size (cache), the host API (host, api; text in and out: text, prompts), γ by timing (autodraft) and its
first guess before any timing (firstguess), streaming (stream)."""

from mtpjax.decode.api import generate
from mtpjax.decode.host import DecodeError, GenerateResult, make_loop, run, summarize
from mtpjax.decode.mtp_proposers import MTPChainProposer, MTPProposer, MTPTreeProposer
from mtpjax.decode.ngram import NgramProposer
from mtpjax.decode.proposers import DraftModelProposer
from mtpjax.decode.prompts import PromptError
from mtpjax.decode.protocol import Proposer
from mtpjax.decode.sampling import Sampler, make_sampler
from mtpjax.decode.text import Generator, TextResult

__all__ = ["generate", "DecodeError", "GenerateResult", "make_loop", "run", "summarize", "MTPProposer",
           "MTPChainProposer", "MTPTreeProposer", "NgramProposer", "DraftModelProposer", "Proposer", "Sampler",
           "make_sampler", "Generator", "TextResult", "PromptError"]
