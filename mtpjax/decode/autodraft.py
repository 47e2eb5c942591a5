"""How much to draft per round: the cost model E / cost, with cost measured on the request itself.

Whether speculation pays depends on the machine, the batch size and the model. On a 2-core CPU a 19 MB
model sits in the last-level cache and one decode row is already compute-bound, so verifying 2-3 tokens
costs 2-3 plain steps and MTP drafts lose; a 99 MB model is bound by reading its weights, and 1-2 MTP
drafts win at batch 1 (docs/benchmarks.md). At batch 32 verification is compute-bound for any model
size. So `generate(draft="auto")` times
a short probe of every candidate (plain, chains of γ drafts, and for the MTP modules the small draft trees of
PROBED_TREES) on the very prompts it was given (the same compiled loops the real run then reuses), takes α by draft
position from the longest chain and each tree's acceptance by depth and rank from its own probe, and picks the
candidate that maximizes expected tokens per unit time. Plain decoding (γ = 0) is always a candidate, and any other
must beat it by MARGIN (more than the probe's timing noise), which is how speculation is never slower than plain.
Every candidate is timed once; only the KEEP most promising are timed again, so the passes that make the timings
robust cost the same however many candidates there are.
A first probe's cost is mostly compiling every candidate's loop (the real run reuses its own); decode.py
therefore decodes a request of a new shape first, with the cost model's estimate from training's acceptance
(mtpjax.decode.firstguess; plain where there is none), and measures after it (`resolve(..., measure=False)`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from mtpjax import drafts
from mtpjax.decode import host
from mtpjax.decode.tree import acceptance_by_depth_rank
from mtpjax.drafts import PLAIN, Tree, chain
from mtpjax.errors import first_line
from mtpjax.nn.speed import by_position, choose_fastest, expected_tokens


MARGIN = 1.05  # a candidate must be predicted this much faster than plain: the probe's timing noise is a few percent
# Trees probed beside the chains, by the depth the chains reach (capped at 2): few and small, since every candidate
# costs the probe a compile and a first pass; a deeper or wider tree is fixed with decode.draft.
PROBED_TREES = {1: ("-1,-1",), 2: ("2x1", "2x2")}
KEEP = 3  # candidates timed again after the first pass, plain included: later passes cost the same for any count


@dataclass
class Calibration:
    choice: Tree = PLAIN  # what runs (PLAIN: plain decoding)
    round_cost: dict = field(default_factory=dict)  # candidate tree -> round time over a plain round
    alpha_by_position: list = field(default_factory=list)
    expected_tokens: dict = field(default_factory=dict)  # candidate tree -> tokens per round
    seconds: float = 0.0  # wall time the probe took, compiles included
    source: str = "probe"  # probe | saved (read back from a SavedCalibrations file) | estimate (nothing timed)
    acceptance_by_depth_rank: dict = field(default_factory=dict)  # tree name -> a[d][r] measured on its probe
    pruned: list = field(default_factory=list)  # candidates timed in the first pass only
    rounds: int = 0  # decode rounds the probe ran, warm-up included (its time bound counts these)

    def as_dict(self) -> dict:
        """The calibration as stats and the saved file spell it: every tree by its name (drafts.parse reads it)."""
        return {"draft": self.choice.name(), "drafts": self.choice.size, "round_cost": _named(self.round_cost),
                "alpha_by_position": self.alpha_by_position, "expected_tokens": _named(self.expected_tokens),
                "acceptance_by_depth_rank": self.acceptance_by_depth_rank,
                "pruned": [t.name() for t in self.pruned], "rounds": self.rounds, "seconds": self.seconds,
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict, source: str = "mtp") -> Calibration:
        """Inverse of as_dict, the trees' nodes given to `source`."""
        def tree(name) -> Tree:
            return drafts.parse(str(name)).drafted_by(source)

        def unname(m):
            return dict(sorted(((tree(k), float(v)) for k, v in m.items()), key=lambda kv: _order(kv[0])))

        return cls(choice=tree(d["draft"]), round_cost=unname(d["round_cost"]),
                   alpha_by_position=[float(a) for a in d["alpha_by_position"]],
                   expected_tokens=unname(d["expected_tokens"]), seconds=float(d["seconds"]), source="saved",
                   acceptance_by_depth_rank=dict(d.get("acceptance_by_depth_rank", {})),
                   pruned=[tree(k) for k in d.get("pruned", [])], rounds=int(d.get("rounds", 0)))


def _named(m: dict) -> dict:
    return {t.name(): v for t, v in m.items()}


def _order(t: Tree) -> tuple:
    """Chains by γ, then trees by node count: cheaper first (max() keeps the first of equal rates)."""
    return (not t.is_chain(), t.size, t.name())


LONG_CHAINS = (6, 8, 12, 16, 24, 32, 48)  # past 4 drafts, the chains auto probes: neighbours differ little


def chain_lengths(most: int) -> list[int]:
    """The chains auto probes up to `most` drafts: 0..4, then LONG_CHAINS, then `most` (each probe is a compile)."""
    return sorted({*range(min(most, 4) + 1), *(g for g in LONG_CHAINS if g < most), most})


def candidates(model, proposer: str, draft_model=None) -> list[Tree]:
    """What auto probes: PLAIN, the chains of chain_lengths up to what the proposer drafts usefully (its most_drafts,
    at most drafts.MAX_NODES, the limit of any draft), then the PROBED_TREES as deep as those chains (at most 2) that
    this proposer and model can draft."""
    drafter = host.DRAFTERS[proposer]
    most = min(max(drafter.most_drafts(model, draft_model), 0), drafts.MAX_NODES)
    out = [chain(g, drafter.source) for g in chain_lengths(most)]
    for name in PROBED_TREES.get(min(most, max(PROBED_TREES)), ()):
        tree = drafts.parse(name).drafted_by(drafter.source)
        try:
            host.check_proposer(model, proposer, tree, None)
        except host.DecodeError:  # not an MTP proposer, or parallel heads fewer than the tree is deep
            continue
        out.append(tree)
    return out


def calibrate(model, prompts, loops: dict, seed: int = 0, probe: int = 32, repeats: int = 3,
              min_seconds: float = 1.0, max_repeats: int = 20, keep: int = KEEP, draft_model=None,
              progress=None) -> Calibration:
    """Time every candidate's compiled loop on `prompts` (loops: candidate tree -> Loop) and choose one.

    A round's cost is the slope between a run that stops after the prefill (one new token) and one of
    2·`probe` new tokens, so prefill and dispatch (~10 ms on the tiny model) cancel. Candidates are timed
    interleaved so drift hits them alike, at least `repeats` times and until `min_seconds` were spent, and
    each run length keeps its fastest time: interference only ever adds time, and medians of 20 ms probes
    on a shared CPU chose wrong about one time in four. After the first pass only plain and the `keep` - 1
    others of best predicted speedup (`kept`) are timed again: the probe's rounds past the first pass are
    bounded by `keep`, not by the number of candidates. The loops are the request's own (compiled here,
    reused by the real run). `progress(text)`, if given, hears what is being measured.
    """
    t0 = time.perf_counter()
    max_new = min(lp.max_new for lp in loops.values())
    short, long_ = 1, max(2, min(2 * probe, max_new))
    if progress is not None:
        progress(f"auto: compiling and timing {len(loops)} candidates ({', '.join(t.name() for t in loops)}) on this "
                 f"request, {long_} tokens a run")
    timed = _Probe(model, prompts, seed, draft_model)
    times: dict = {c: ([], []) for c in loops}
    rounds, last = {}, {}
    for loop in loops.values():  # compile and warm
        timed(loop, short)
    done, spent, live = 0, 0.0, list(loops)
    while done < max(repeats, 1) or (spent < min_seconds and done < max_repeats):
        for c in live:
            ts, rs, _ = timed(loops[c], short)
            tl, rl, last[c] = timed(loops[c], long_)
            times[c][0].append(ts)
            times[c][1].append(tl)
            rounds[c] = (rs, rl)
            spent += ts + tl
        done += 1
        if done == 1:
            live = kept(_expected(loops, last)[2], _costs(times, rounds), keep)
    cost, (alpha, by_tree, expected) = _costs(times, rounds), _expected(loops, last)
    choice = choose_fastest(expected, {c: cost[c] for c in live}, margin=MARGIN)
    return Calibration(choice=choice, round_cost=cost,
                       alpha_by_position=alpha, expected_tokens=expected, acceptance_by_depth_rank=by_tree,
                       pruned=[c for c in loops if c not in live], rounds=timed.rounds,
                       seconds=time.perf_counter() - t0)


@dataclass
class _Probe:
    """Runs a candidate's loop on the request, silently (no callback), counting the decode rounds it spent."""

    model: object
    prompts: list
    seed: int
    draft_model: object = None
    rounds: int = 0

    def __call__(self, loop, budget: int):
        """(seconds, rounds of the slowest row, final state) of one run cut at `budget` new tokens."""
        t = time.perf_counter()
        st = host.run(self.model, self.prompts, loop, self.seed, budget=budget, draft_model=self.draft_model)
        jax.block_until_ready(st.n_B)
        r = int(np.asarray(st.rounds_B).max())
        self.rounds += r
        return time.perf_counter() - t, r, st


def _costs(times: dict, rounds: dict) -> dict:
    """Each candidate's round time over plain's, from its fastest short and long runs."""
    per_round = {c: (min(tl) - min(ts)) / (rounds[c][1] - rounds[c][0])
                 for c, (ts, tl) in times.items() if rounds[c][1] > rounds[c][0]}
    if len(per_round) < len(times) or min(per_round.values()) <= 0:
        # Too few rounds for the slope to rise above timing noise: whole-run time per round instead.
        per_round = {c: min(tl) / max(rounds[c][1], 1) for c, (_, tl) in times.items()}
    return {c: t / per_round[PLAIN] for c, t in per_round.items()}


def _expected(loops: dict, last: dict) -> tuple[list, dict, dict]:
    """(α by position of the longest chain, each wider tree's acceptance by depth and rank by its name, each
    candidate's expected tokens per round from them) off the candidates' last probe runs."""
    top = max((t for t in loops if t.is_chain()), key=lambda t: t.size)
    alpha = host.summarize(last[top], top).stats["acceptance_by_position"] if top.size else []
    expected, by_tree = {}, {}
    for t in loops:
        if t.is_chain():
            expected[t] = expected_tokens(t, by_position(alpha))
        else:
            stats = host.summarize(last[t], t).stats
            by_tree[t.name()] = acceptance_by_depth_rank(t, stats["accepted_by_node"], stats["reached"])
            expected[t] = expected_tokens(t, by_tree[t.name()])
    return alpha, by_tree, expected


def kept(expected: dict, round_cost: dict, keep: int) -> list:
    """The candidates timed again: plain, and the `keep` - 1 others of best predicted speedup E / cost among those
    that could still beat plain by MARGIN (a round costs at least a plain one, so E < MARGIN never can). More
    passes only lower a cost (each run length keeps its fastest time), so a candidate dropped here ranked below
    every kept one and stays below."""
    rivals = [c for c in round_cost if c != PLAIN and expected[c] >= MARGIN]
    rivals.sort(key=lambda c: -expected[c] / round_cost[c])  # stable: of equal rates, the cheaper first
    return [PLAIN] + rivals[: max(keep - 1, 0)]


_MEMO = weakref.WeakKeyDictionary()  # model -> {request shape: Calibration}: one probe per request shape
_DRAFT_MEMO = weakref.WeakKeyDictionary()  # draft model -> the same, per target model


def memo(model, draft_model=None) -> dict:
    """This model's (and draft model's) calibrations, keyed by request shape (dropped with either model)."""
    if draft_model is None:
        return _MEMO.setdefault(model, {})
    return _DRAFT_MEMO.setdefault(draft_model, weakref.WeakKeyDictionary()).setdefault(model, {})


@functools.cache  # fixed for the life of the process; read for every saved-calibration lookup
def machine() -> str:
    """What a measured round cost holds for: backend and device, CPU model, core count, JAX version."""
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{dev.platform}/{dev.device_kind} | {cpu} | {os.cpu_count()} cores | jax {jax.__version__}"


def default_calibration_file() -> Path:
    """Where decode.py keeps calibrations: $MTPJAX_CACHE_DIR, else ~/.cache/mtpjax (never the run directory)."""
    from mtpjax.parallel.runtime import cache_root

    return cache_root() / "decode_calibration.json"


class SavedCalibrations:
    """Calibrations kept in a JSON file, so later runs of the same request shape skip the probe.

    Entries are keyed by machine(), a model tag (decode.py: the run directory and checkpoint step) and the
    request shape. A file that holds something else is refused when this is made (DecodeError; a user's file
    named by mistake is never overwritten); a damaged one of these files (it starts as a JSON object but does not
    parse) counts as empty. Writes replace the file atomically, and one that cannot be written only costs the next
    run its probe. refresh=True ignores what is saved (and overwrites it with a new measurement).
    """

    def __init__(self, path, tag: str, refresh: bool = False):
        self.path, self.tag, self.refresh = Path(path), tag, refresh
        if self.path.exists():
            self._check_ours()

    def _check_ours(self) -> None:
        """DecodeError, the file left as it is, unless the existing file is one of these (or empty)."""
        if not self.path.is_file() and not self.path.is_dir():  # a directory's read says so, below
            # a device or pipe: reading a pipe may never end, and a save replaces the node (/dev/null, as root)
            raise host.DecodeError(f"calibration file '{self.path}' is not a regular file (left as it is); give "
                                   "another path (decode.py --calibration-file)")
        try:
            text = self.path.read_text(errors="replace")
        except OSError as e:  # a directory, or a file this user cannot read: it cannot be told from a foreign one
            raise host.DecodeError(f"calibration file '{self.path}' cannot be read ({first_line(e)}); give another "
                                   "path (decode.py --calibration-file)") from None
        if _foreign(text):
            raise host.DecodeError(f"calibration file '{self.path}' holds something other than mtpjax's decode "
                                   "calibrations (left as it is); give another path (decode.py --calibration-file) "
                                   "or remove it")

    def _key(self, key: tuple) -> str:
        return " || ".join([machine(), self.tag, repr(key)])

    def _entries(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: tuple, source: str = "mtp") -> Calibration | None:
        """The saved calibration for this request shape on this machine (its trees' nodes `source`'s), or None."""
        entry = None if self.refresh else self._entries().get(self._key(key))
        try:
            return Calibration.from_dict(entry, source) if entry else None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def put(self, key: tuple, cal: Calibration) -> bool:
        """Save (atomically); False if the file could not be written."""
        entries = self._entries()
        entries[self._key(key)] = cal.as_dict()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
            return True
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. the directory is a file: nothing was written
                pass
            return False


def _foreign(text: str) -> bool:
    """Whether a calibration file's text is something else than SavedCalibrations writes: a JSON object whose keys
    are machine || tag || shape; text that starts as a JSON object but does not parse is a damaged one (rebuilt), and
    an empty file holds nothing to lose."""
    if not text.strip():
        return False
    try:
        data = json.loads(text)
    except ValueError:
        return not text.lstrip().startswith("{")
    return not isinstance(data, dict) or not all(k.count(" || ") >= 2 for k in data)


def resolve(model, prompts, loop_for, proposer: str, seed: int, saved: SavedCalibrations | None = None,
            draft_model=None, progress=None, measure: bool = True, guess=None) -> tuple[Tree, Calibration | None]:
    """(the chosen tree, Calibration) for this request shape (`loop_for(tree)` builds each candidate's loop): measured
    once per model (or read from `saved`), then remembered. The key names the candidates, so a measurement among
    others is never reused.

    measure=False: when nothing is known yet for this shape, `guess()` (a Calibration of source "estimate",
    mtpjax.decode.firstguess) decides, or plain decoding, (PLAIN, None), without a guess; neither is remembered.
    At most 2 new tokens: (PLAIN, None), nothing measured.
    """
    if loop_for(PLAIN).max_new <= 2:  # the prompt gives token 1 and one round token 2: no draft saves a round
        return PLAIN, None
    cands = candidates(model, proposer, draft_model)
    loops = {c: loop_for(c) for c in cands}
    key = request_key(prompts, loops[PLAIN], proposer, cands)
    known = memo(model, draft_model)
    if key not in known:
        cal = saved.get(key, host.DRAFTERS[proposer].source) if saved is not None else None
        if cal is None:
            if not measure:
                est = guess() if guess is not None else None
                return (est.choice, est) if est is not None else (PLAIN, None)
            cal = calibrate(model, prompts, loops, seed, draft_model=draft_model, progress=progress)
            if saved is not None:
                saved.put(key, cal)
        known[key] = cal
    cal = known[key]
    return cal.choice, cal


def request_key(prompts, plain, proposer: str, cands) -> tuple:
    """What a calibration holds for: batch, padded prompt, new tokens, proposer, sampler, EOS, the candidates."""
    return (len(prompts), plain.prompt_pad, plain.max_new, proposer, plain.sampler, plain.eos_id,
            tuple(t.name() for t in cands))
