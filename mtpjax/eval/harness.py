"""An lm-evaluation-harness backend for a model in memory: loglikelihoods from one compiled forward, generation
through the jitted speculative decoder.

The harness's TemplateLM splits a (context, continuation) pair at the token boundary (it encodes the whole text
and the context, the continuation being what the whole adds). Requests are sorted longest first as its `hf`
backend sorts them, cut into rows of `batch_size` and padded to a power-of-two length bucket, so every batch
runs one of a few compiled programs. A request longer than `max_length` keeps its last `max_length` + 1 tokens
(the `hf` backend's left truncation); rolling loglikelihoods are the harness's disjoint windows of
`max_length` tokens. Generation groups requests with equal generation arguments, stops at the model's EOS, and
cuts the text at the first stop sequence (the decoder runs the whole `max_gen_toks`). `draft="auto"`
measures the candidates on the first batch and keeps its choice; `stats` holds, per task, what the drafts did.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mtpjax.decode import api
from mtpjax.decode.cache import rows as rows_of
from mtpjax.decode.host import draft_of
from mtpjax.drafts import PLAIN, Auto, Tree
from mtpjax.errors import MtpjaxError
from mtpjax.eval import verdict
from mtpjax.nn.model import MTPTransformer

MIN_BUCKET = 16  # the shortest padded length


class HarnessError(MtpjaxError):
    """A request this backend cannot score as asked (one line naming the fix)."""


def bucket(n: int, cap: int) -> int:
    """The padded length of an n-token row: the next power of two (at least MIN_BUCKET), at most cap."""
    return min(cap, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))


def make_scorer(model: MTPTransformer):
    """A jitted (tokens_BT, targets_BT, mask_BT) -> (Σ log p over the mask [B], every masked target greedy [B])
    of the main head (the trunk only: no MTP module runs)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def score(params, tokens_BT, targets_BT, mask_BT):
        m = nnx.merge(graphdef, params)
        logits_BTV = m.logits(m.head_norm(0, m.trunk(tokens_BT)[0]))
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        lp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
        greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
        return jnp.where(mask_BT, lp_BT, 0.0).sum(-1), jnp.all(greedy_BT | ~mask_BT, axis=-1)

    return lambda *arrays: score(params, *arrays)


def pack(pairs, max_length: int, rows: int):
    """(tokens_BT, targets_BT, mask_BT) of (context, continuation) token pairs padded to `rows` rows and a bucket:
    each row's input is the last max_length + 1 tokens of context + continuation without its last, the mask
    over the continuation's targets."""
    longest = max(len(x) for _, x in pairs)
    if longest > max_length:
        raise HarnessError(f"a continuation of {longest} tokens is longer than max_length={max_length}; raise "
                           "max_length (the model_args' max_length, data.seq_len by default)")
    wins = [(c + x)[-(max_length + 1):] for c, x in pairs]
    T = bucket(max(len(w) - 1 for w in wins), max_length)
    tokens_BT, targets_BT = np.zeros((rows, T), np.int32), np.zeros((rows, T), np.int32)
    mask_BT = np.zeros((rows, T), bool)
    for b, ((_, cont), w) in enumerate(zip(pairs, wins)):
        n = len(w) - 1
        tokens_BT[b, :n], targets_BT[b, :n] = w[:-1], w[1:]
        mask_BT[b, n - len(cont): n] = True
    return tokens_BT, targets_BT, mask_BT


BATCH = 16  # rows of one compiled batch unless the caller says otherwise


class MtpjaxLM(TemplateLM):
    """lm-eval's LM interface over an MTPTransformer and its tokenizer (one device).

    What generate_until drafts is `draft` (a mtpjax.drafts Tree or Auto, measured, or spelled as decode.draft is),
    read once as generate reads it; proposer: mtp, mtp1, ngram or model (draft_model drafting).
    batch_size: rows per compiled batch. measure: time generation without compiles and, where it drafts, the
    same batches decoded plain (stats' plain_seconds).
    """

    def __init__(self, model: MTPTransformer, tokenizer, *, max_length: int, batch_size: int = BATCH,
                 draft: Tree | Auto | str | int = PLAIN, proposer: str = "mtp", seed: int = 0,
                 max_gen_toks: int = 256, draft_model: MTPTransformer | None = None, measure: bool = False):
        super().__init__()
        self.model, self.tok = model, tokenizer
        self._max_length, self.batch_size, self.max_gen_toks = int(max_length), int(batch_size), int(max_gen_toks)
        self.draft, self.proposer, self.seed = draft_of(draft, proposer), proposer, seed
        self._score = make_scorer(model)
        self.stats: dict[str, dict] = {}  # per task: what generation did (generate_until)
        self.chosen: Tree | None = None  # what Auto chose on its first batch
        # why generation runs plain, where it does (stats' why_plain)
        self.why_plain = "draft=0 was asked (decode.draft, or the decode.py or model_args flags that spell it)"
        self.draft_model, self.measure, self._compiled = draft_model, measure, set()

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(Σ log p(continuation | context), greedy) per (strings, context ids, continuation ids) request."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            pairs = [(ctx, cont) for _, ctx, cont in chunk]
            lp_B, greedy_B = jax.device_get(self._score(*pack(pairs, self.max_length, self.batch_size)))
            out += [(float(lp_B[i]), bool(greedy_B[i])) for i in range(len(chunk))]
        return order.get_original(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Σ log p of each whole text over the harness's disjoint windows of max_length tokens (EOS first)."""
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), ctx, cont))
                owner.append(i)
        totals = np.zeros(len(requests))
        for i, (lp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += lp
        return totals.tolist()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its first stop sequence, at most max_gen_toks tokens."""
        order = Collator([(r.args[0], r.args[1], getattr(r, "task_name", None) or "") for r in requests],
                         sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]), group_by="gen_kwargs",
                         group_fn=lambda r: r[1])
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            kw = normalize_gen_kwargs(chunk[0][1], self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=None)
            max_new = int(kw.pop("max_gen_toks"))
            keep = max(1, self.max_length - max_new)  # the hf backend's left truncation of the context
            prompts = [(self.tok_encode(c) or [self.eot_token_id])[-keep:] for c, _, _ in chunk]
            for cont in self._generate(prompts, max_new, kw, chunk[0][2]):
                out.append(postprocess_generated_text(generation=self.tok_decode(cont), stop=until,
                                                      think_end_token=None))
        return order.get_original(out)

    def _generate(self, prompts: list[list[int]], max_new: int, kw: dict, task: str) -> list[list[int]]:
        """New tokens per prompt; the batch padded to batch_size rows (one compiled loop per prompt bucket)."""
        rows = prompts + [prompts[-1]] * (self.batch_size - len(prompts))
        sample = bool(kw.get("do_sample")) and float(kw.get("temperature", 1.0) or 0.0) > 0
        args = dict(max_new_tokens=max_new, proposer=self.proposer, seed=self.seed, eos_id=self.eot_token_id,
                    temperature=float(kw.get("temperature", 1.0)) if sample else 0.0,
                    top_k=kw.get("top_k") if sample else None, top_p=kw.get("top_p") if sample else None,
                    draft_model=self.draft_model)
        res, seconds = self._timed(rows, args, self.chosen or self.draft)
        t = self._record(task, res.stats, seconds, len(rows))
        if self.measure and res.draft != PLAIN:  # the same batch decoded plain
            t["plain_seconds"] += self._timed(rows, args, PLAIN)[1]
        return res.tokens[: len(prompts)]

    def _timed(self, rows, args: dict, draft: Tree | Auto):
        """(api.generate's result, its seconds); with `measure`, after an untimed run of each new compiled tree.
        A first Auto request is its calibration: the choice is kept and used from then on."""
        if isinstance(draft, Auto):
            first = api.generate(self.model, rows, **args, draft=draft)
            self.chosen = draft = first.draft
            self.why_plain = "auto measured the drafts: " + (verdict.plain_reason(
                first.stats["calibration"], self.proposer) or "no draft count or tree beat plain decoding")
        key = (rows_of(max(map(len, rows)), args["max_new_tokens"], 0).prompt_pad, args["max_new_tokens"],
               len(rows), draft)
        if self.measure and key not in self._compiled:
            api.generate(self.model, rows, **args, draft=draft)
        self._compiled.add(key)
        t0 = time.perf_counter()
        res = api.generate(self.model, rows, **args, draft=draft)
        return res, time.perf_counter() - t0

    def _record(self, task: str, s: dict, seconds: float, rows: int) -> dict:
        """Sum one batch's decode statistics into stats[task] (padding rows included); that entry."""
        t = self.stats.setdefault(task, {"rows": 0, "seconds": 0.0, "plain_seconds": 0.0, "rounds": 0,
                                         "generated": 0, "accepted": [], "reached": []})
        t["draft"] = s["draft"]
        if not s["drafts"]:
            t["why_plain"] = self.why_plain
        t["rows"] += rows
        t["seconds"] += seconds
        t["rounds"] += s["rounds"]
        t["generated"] += s["generated"]
        for k in ("accepted", "reached"):
            t[k] = (np.add(t[k], s[k]) if len(t[k]) == len(s[k]) else np.asarray(s[k])).tolist()
        return t


def spec_summary(t: dict) -> dict:
    """A task's generation statistics as reported: tokens per round, acceptance by depth, speedup vs plain (or why
    it ran plain)."""
    out = {"draft": t["draft"], "tokens_per_sec": t["generated"] / t["seconds"] if t["seconds"] else 0.0,
           # each row's first token comes from the prefill, not from a round
           "tokens_per_round": (t["generated"] - t["rows"]) / t["rounds"] if t["rounds"] else 0.0,
           "acceptance_by_depth": [a / r if r else 0.0 for a, r in zip(t["accepted"], t["reached"])]}
    if t["plain_seconds"]:
        out["speedup_vs_plain"] = t["plain_seconds"] / t["seconds"]
    if "why_plain" in t:
        out["why_plain"] = t["why_plain"]
    return out
