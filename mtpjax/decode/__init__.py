"""Speculative decoding: the jitted loop (loop), proposers, samplers, the host API (host, api), γ by timing
(autodraft), streaming (stream), and decode.py's command line (cli)."""

from mtpjax.decode.api import generate
from mtpjax.decode.host import DecodeError, GenerateResult, make_loop, run, summarize
from mtpjax.decode.proposers import DraftModelProposer, MTPProposer, NgramProposer
from mtpjax.decode.sampling import Sampler, make_sampler

__all__ = ["generate", "DecodeError", "GenerateResult", "make_loop", "run", "summarize", "MTPProposer",
           "NgramProposer", "DraftModelProposer", "Sampler", "make_sampler"]
