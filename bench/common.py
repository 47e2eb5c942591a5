"""Shared measurement helpers: interleaved rounds, medians of per-round ratios, load average, peak memory."""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time

import numpy as np

from mtpjax.cli.args import UsageError, writable, write_json

__all__ = ["interleave", "json_path", "load", "log", "median_ratio", "peak_rss_mb", "write_json"]


def json_path(text: str) -> str:
    """--json's type: a path a report can be written to, checked before the benchmark runs (minutes, or a lent
    accelerator's), so a bad one is one line, exit 2, not a lost table; write_json writes it, making its folders."""
    try:
        writable("--json", text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def load() -> list[float]:
    """The 1/5/15-minute load averages, printed beside every result (the host is shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1 << 20) if sys.platform == "darwin" else kb / 1024


def interleave(fns: dict, rounds: int, seed: int = 0, cpu: dict | None = None) -> dict:
    """Seconds per call of each fn, in `rounds` rounds that run every fn once in a shuffled order (A B A B ...).

    `cpu`, if given, receives this process's CPU seconds per call too: on a host loaded by others every
    wall time is contended, while CPU time counts the work done.
    """
    rng = random.Random(seed)
    out = {k: [] for k in fns}
    names = list(fns)
    for _ in range(rounds):
        rng.shuffle(names)
        for k in names:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[k]()
            out[k].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(k, []).append(time.process_time() - c0)
    return out


def median_ratio(num, den) -> float:
    """Median over rounds of num[i]/den[i]: drift in the machine's load cancels within a round."""
    return float(np.median(np.asarray(num) / np.asarray(den)))


def log(msg: str) -> None:
    print(f"{msg}  [load {load()}]", flush=True)


def mtp_chain(key: str) -> bool:
    """A decode_bench row of an MTP chain `mtpG` (module k drafting token k), not `mtp1_G` (module 1 reused) nor a
    tree's or another proposer's."""
    return key.startswith("mtp") and key[3:].isdigit()
