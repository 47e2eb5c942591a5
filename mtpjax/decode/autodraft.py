"""How many drafts per round: the cost model E(γ) / cost(γ), with cost measured on the request itself.

Whether speculation pays depends on the machine, the batch size and the model. On a 2-core CPU a 19 MB
model sits in the last-level cache and one decode row is already compute-bound, so verifying 2-3 tokens
costs 2-3 plain steps and MTP drafts lose; a 99 MB model is bound by reading its weights, and 1-2 MTP
drafts win at batch 1 (docs/benchmarks.md). At batch 32 verification is compute-bound for any model
size. So `generate(num_draft="auto")` times
a short probe of every candidate γ on the very prompts it was given (the same compiled loops the real
run then reuses), takes α by draft position from the longest candidate, and picks the γ that
maximizes expected tokens per unit time. γ = 0 (plain decoding) is always a candidate, and a γ > 0 must
beat it by MARGIN (more than the probe's timing noise), which is how speculation is never slower than plain.
A first probe's cost is mostly compiling every candidate's loop (the real run reuses its own); decode.py
therefore decodes a request of a new shape plain and measures after it (`resolve(..., measure=False)`).
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

from mtpjax.decode import host
from mtpjax.decode.proposers import PROPOSERS
from mtpjax.nn.speed import choose_num_draft, expected_tokens


MARGIN = 1.05  # a γ > 0 must be predicted this much faster than plain: the probe's timing noise is a few percent


@dataclass
class Calibration:
    num_draft: int
    round_cost: dict = field(default_factory=dict)  # γ -> time of a round relative to a plain round
    alpha_by_position: list = field(default_factory=list)
    expected_tokens: dict = field(default_factory=dict)  # γ -> E(γ) from α
    seconds: float = 0.0  # wall time the probe took, compiles included
    source: str = "probe"  # probe | saved (read back from a SavedCalibrations file)

    def as_dict(self) -> dict:
        return {"num_draft": self.num_draft, "round_cost": self.round_cost, "alpha_by_position": self.alpha_by_position,
                "expected_tokens": self.expected_tokens, "seconds": self.seconds, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """Inverse of as_dict (JSON turns the γ keys into strings)."""
        return cls(num_draft=int(d["num_draft"]), round_cost={int(k): float(v) for k, v in d["round_cost"].items()},
                   alpha_by_position=[float(a) for a in d["alpha_by_position"]],
                   expected_tokens={int(k): float(v) for k, v in d["expected_tokens"].items()},
                   seconds=float(d["seconds"]), source="saved")


def candidates(model, proposer: str) -> list[int]:
    """γ values worth probing: 0 (plain) up to what the proposer can draft usefully (MTP: its depth)."""
    return list(range(0, max(PROPOSERS[proposer](1).most_drafts(model), 0) + 1))


def calibrate(model, prompts, loops: dict, seed: int = 0, probe: int = 32, repeats: int = 3,
              min_seconds: float = 1.0, max_repeats: int = 20, draft=None, progress=None) -> Calibration:
    """Time every candidate's compiled loop on `prompts` (loops: γ -> Loop) and choose γ.

    A round's cost is the slope between a run that stops after the prefill (one new token) and one of
    2·`probe` new tokens, so prefill and dispatch (~10 ms on the tiny model) cancel. Candidates are timed
    interleaved so drift hits them alike, at least `repeats` times and until `min_seconds` were spent, and
    each run length keeps its fastest time: interference only ever adds time, and medians of 20 ms probes
    on a shared CPU chose wrong about one time in four. The loops are the request's own (compiled here,
    reused by the real run). `progress(text)`, if given, hears what is being measured.
    """
    t0 = time.perf_counter()
    max_new = min(lp.max_new for lp in loops.values())
    short, long_ = 1, max(2, min(2 * probe, max_new))
    if progress is not None:
        progress(f"auto: compiling and timing {len(loops)} draft counts ({', '.join(map(str, loops))}) on this "
                 f"request, {long_} tokens a run")

    def timed(loop, budget):
        t = time.perf_counter()
        st = host.run(model, prompts, loop, seed, budget=budget, draft=draft)  # no callback: the probe is silent
        jax.block_until_ready(st.n_B)
        return time.perf_counter() - t, int(np.asarray(st.rounds_B).max()), st

    times: dict = {g: ([], []) for g in loops}
    rounds, last = {}, {}
    for loop in loops.values():  # compile and warm
        timed(loop, short)
    done, spent = 0, 0.0
    while done < repeats or (spent < min_seconds and done < max_repeats):
        for g, loop in loops.items():
            ts, rs, _ = timed(loop, short)
            tl, rl, last[g] = timed(loop, long_)
            times[g][0].append(ts)
            times[g][1].append(tl)
            rounds[g] = (rs, rl)
            spent += ts + tl
        done += 1
    per_round = {g: (min(tl) - min(ts)) / (rounds[g][1] - rounds[g][0])
                 for g, (ts, tl) in times.items() if rounds[g][1] > rounds[g][0]}
    if len(per_round) < len(loops) or min(per_round.values()) <= 0:
        # Too few rounds for the slope to rise above timing noise: whole-run time per round instead.
        per_round = {g: min(tl) / max(rounds[g][1], 1) for g, (_, tl) in times.items()}
    top = max(loops)
    alpha = host.summarize(last[top]).stats["acceptance_by_position"] if top > 0 else []
    cost = {g: t / per_round[0] for g, t in per_round.items()}
    return Calibration(num_draft=choose(alpha, cost), round_cost=cost, alpha_by_position=alpha,
                       expected_tokens={g: expected_tokens(alpha, g) for g in loops}, seconds=time.perf_counter() - t0)


def choose(alpha_by_pos, round_cost: dict) -> int:
    """The γ of choose_num_draft, or 0 (plain) unless it is predicted MARGIN faster than plain decoding."""
    return choose_num_draft(alpha_by_pos, round_cost, margin=MARGIN)


_MEMO = weakref.WeakKeyDictionary()  # model -> {request shape: Calibration}: one probe per request shape
_DRAFT_MEMO = weakref.WeakKeyDictionary()  # draft model -> the same, per target model


def memo(model, draft=None) -> dict:
    """This model's (and draft model's) calibrations, keyed by request shape (dropped with either model)."""
    if draft is None:
        return _MEMO.setdefault(model, {})
    return _DRAFT_MEMO.setdefault(draft, weakref.WeakKeyDictionary()).setdefault(model, {})


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
    request shape. An unreadable file counts as empty; writes replace the file atomically, and one that
    cannot be written only costs the next run its probe. refresh=True ignores what is saved (and
    overwrites it with a new measurement).
    """

    def __init__(self, path, tag: str, refresh: bool = False):
        self.path, self.tag, self.refresh = Path(path), tag, refresh

    def _key(self, key: tuple) -> str:
        return " || ".join([machine(), self.tag, repr(key)])

    def _entries(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: tuple) -> Calibration | None:
        """The saved calibration for this request shape on this machine, or None."""
        entry = None if self.refresh else self._entries().get(self._key(key))
        try:
            return Calibration.from_dict(entry) if entry else None
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


def resolve(model, prompts, loop_for, proposer: str, seed: int, saved: SavedCalibrations | None = None,
            draft=None, progress=None, measure: bool = True):
    """(γ, Calibration) for this request shape: measured once per model (or read from `saved`), then remembered.

    measure=False: (0, None) when nothing is known yet for this shape (plain decoding until a measurement exists).
    """
    loops = {g: loop_for(g) for g in candidates(model, proposer)}
    base = loops[0]
    key = (len(prompts), base.prompt_pad, base.max_new, proposer, base.sampler, base.eos_id)
    known = memo(model, draft)
    if key not in known:
        cal = saved.get(key) if saved is not None else None
        if cal is None:
            if not measure:
                return 0, None
            cal = calibrate(model, prompts, loops, seed, draft=draft, progress=progress)
            if saved is not None:
                saved.put(key, cal)
        known[key] = cal
    cal = known[key]
    return cal.num_draft, cal
