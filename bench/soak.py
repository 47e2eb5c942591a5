"""The soak: a run stopped many times (SIGTERM, kill -9, a corrupted latest checkpoint), resumed alternately on 1 and
2 processes, ends where an uninterrupted run ends.

    python -m bench.soak --interruptions 20 --seed 0 --out /tmp/soak

Every segment trains the same config on the same mesh (data=2: one process with 2 CPU devices, or 2 processes
with one each, gloo between them) from the run directory's latest checkpoint. Each interruption is drawn with
the seed: SIGTERM to every process (they checkpoint one agreed step and exit 0) or kill -9 of one process (the
others stop by themselves: the heartbeat watch, or JAX when process 0 is lost), right after a checkpoint is
committed or while a save is in flight; once, the latest checkpoint gets a flipped bit (its digest check sends
the next segment to the previous one). Moments are events seen on disk, never sleeps. Then the final
parameters, optimizer state, data position, eval loss and every step's logged loss are compared with a
straight run's. The test tier runs it small (tests/test_soak.py); docs/reliability.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EVERY = 2  # checkpoint.every: a committed checkpoint every other step is the soak's clock
OVERRIDES = [
    "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.mtp_depth=2", "data.source=text", "data.tokenizer=byte", "data.seq_len=32",
    "data.val_fraction=0.1", "train.batch_size=8", "train.log_every=1", "train.eval_batches=1",
    "train.num_samples=0", "train.progress=false", "train.peak_flops=1e9", f"checkpoint.every={EVERY}",
    "checkpoint.keep=3", "optim.warmup_steps=2", "optim.lr=1e-2", "mesh.data=2",
]
HANG = 900.0  # seconds: only a hung segment waits this long (and the soak then fails)


def soak_overrides(tmp: Path, corpus: Path, run: str, steps: int) -> list[str]:
    """The soak's config overrides (on top of configs/tiny.yaml) for run directory `tmp/run`."""
    return [*OVERRIDES, f"data.paths={corpus}", f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / run}",
            f"train.steps={steps}", f"train.eval_every={steps}"]


def write_corpus(directory: Path) -> Path:
    """~80 KB of standard-library source as the soak's corpus."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    path = Path(directory) / "soak-corpus.txt"
    path.write_text("\n".join((lib / n).read_text() for n in ("json/decoder.py", "textwrap.py", "string.py",
                                                              "bisect.py", "heapq.py", "fnmatch.py")))
    return path


# ----------------------------------------------------------------------------- processes and events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(overrides: list[str], procs: int, log: Path, *, heartbeat: int = 10,
           script: Path = ROOT / "train.py") -> list[subprocess.Popen]:
    """`procs` train.py processes (2 CPU devices in all) of one segment; process i's stderr to `log`-p<i>.log."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("MTPJAX_", "SLURM_", "TPU_")) or k == "MTPJAX_CACHE_DIR"}  # compiled programs kept
    base |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "MTPJAX_LOCAL_DEVICES": str(2 // procs),
             "MTPJAX_HEARTBEAT_TIMEOUT": str(heartbeat), "MTPJAX_INIT_TIMEOUT": "300"}
    port, out = _free_port(), []
    for i in range(procs):
        env = base | ({"MTPJAX_COORDINATOR": f"127.0.0.1:{port}", "MTPJAX_NUM_PROCESSES": str(procs),
                       "MTPJAX_PROCESS_ID": str(i)} if procs > 1 else {})
        out.append(subprocess.Popen([sys.executable, str(script), "--config", str(ROOT / "configs/tiny.yaml"),
                                     *overrides], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=Path(f"{log}-p{i}.log").open("w")))
    return out


def committed(run: Path) -> list[int]:
    """The run's committed checkpoint steps."""
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def saving(run: Path) -> bool:
    """Whether a save is in flight (orbax's temporary step directory exists)."""
    d = run / "checkpoints"
    return d.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in d.iterdir())


def wait_for(cond, procs: list[subprocess.Popen], timeout: float = HANG) -> bool:
    """Poll `cond()` until it holds (True) or a process exits first (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if cond():
            return True
        time.sleep(0.002)
    return bool(cond())


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    return [p.wait(timeout=HANG) for p in procs]


def flip_bit(step_dir: Path, item: str = "model", name: str = "embed") -> None:
    """One bit of one element of a stored array changed in place, through tensorstore (the array still reads)."""
    import tensorstore as ts

    t = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir / item}",
                                               "path": name}}).result()
    a = t.read().result()
    a.reshape(-1)[:1].view(np.uint8)[0] ^= 1  # the lowest bit of the first element (little-endian)
    t.write(a).result()


# ----------------------------------------------------------------------------- the soak


@dataclass
class Event:
    """One interruption: what, on how many processes, when, and what the next segment resumed from."""

    kind: str  # sigterm | kill9
    procs: int
    moment: str  # committed | saving
    victim: int | None = None
    exit_codes: list = field(default_factory=list)
    lost_lines: int = 0  # survivors that named the lost process
    stop_s: float = 0.0  # from the interruption until every process had exited
    corrupted: int | None = None  # the checkpoint step given a flipped bit after this interruption


def interrupt(ev: Event, procs: list[subprocess.Popen], logs: Path, rng: random.Random) -> None:
    """Deliver `ev` to a running segment and wait until every process of it has exited."""
    t0 = time.monotonic()
    if ev.kind == "sigterm":
        for p in procs:
            p.send_signal(signal.SIGTERM)
    else:
        ev.victim = rng.randrange(len(procs))
        procs[ev.victim].send_signal(signal.SIGKILL)
    ev.exit_codes = wait_all(procs)
    ev.stop_s = time.monotonic() - t0
    ev.lost_lines = sum("was lost (no heartbeat" in Path(f"{logs}-p{i}.log").read_text() for i in range(len(procs)))


def soak(overrides: list[str], run: Path, logs: Path, interruptions: int, seed: int, *, heartbeat: int = 10,
         corrupt_at: int = 1, script: Path = ROOT / "train.py") -> tuple[list[Event], list[int]]:
    """Interrupt the run `interruptions` times, then let it finish; (events, each final process's exit code)."""
    rng, events = random.Random(seed), []
    logs.mkdir(parents=True, exist_ok=True)
    for k in range(interruptions):
        nprocs = 1 if k % 2 == 0 else 2
        ev = Event(rng.choice(["sigterm", "kill9"]), nprocs, rng.choice(["committed", "saving"]))
        before = committed(run)
        procs = launch(overrides, nprocs, logs / f"seg{k}", heartbeat=heartbeat, script=script)
        new = lambda b=before: committed(run) != b and max(committed(run)) > max(b, default=0)
        reached = wait_for(new, procs) and (ev.moment == "committed" or wait_for(lambda: saving(run), procs))
        if not reached:  # the segment ended first (the run is done): nothing left to interrupt
            wait_all(procs)
            break
        interrupt(ev, procs, logs / f"seg{k}", rng)
        if k == corrupt_at and len(committed(run)) >= 2:
            ev.corrupted = committed(run)[-1]
            flip_bit(run / "checkpoints" / str(ev.corrupted))
        events.append(ev)
    final = launch(overrides, 1 if len(events) % 2 == 0 else 2, logs / "final", heartbeat=heartbeat, script=script)
    return events, wait_all(final)


# ----------------------------------------------------------------------------- comparing two runs


def stored_arrays(step_dir: Path, item: str) -> dict[str, np.ndarray]:
    """Every array of a checkpoint item, read whole with tensorstore (any process count or mesh)."""
    import tensorstore as ts

    base = f"file://{step_dir / item}"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    names = sorted({k.decode().rsplit("/", 1)[0] for k in kv.list().result() if k.endswith(b"/.zarray")})
    return {n: ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base, "path": n}}).result()
            .read().result() for n in names}


def logged_losses(run: Path, tag: str = "loss/main") -> list[tuple[int, float]]:
    """(step, value) of every `tag` event TensorBoard keeps (an interrupted run's purged steps excluded)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def compare(a: Path, b: Path) -> dict:
    """How the final checkpoints of runs `a` and `b` differ: arrays (max |a-b| and whether bitwise equal), data
    position, eval loss and the logged losses."""
    sa, sb = committed(a)[-1], committed(b)[-1]
    out = {"steps": [sa, sb]}
    for item in ("model", "train"):
        xa, xb = stored_arrays(a / "checkpoints" / str(sa), item), stored_arrays(b / "checkpoints" / str(sb), item)
        assert xa.keys() == xb.keys(), (item, set(xa) ^ set(xb))
        out[f"{item}_bitwise"] = all(xa[k].tobytes() == xb[k].tobytes() for k in xa)
        out[f"{item}_max_abs_diff"] = max((float(np.max(np.abs(xa[k].astype(np.float64) - xb[k])))
                                           for k in xa if xa[k].size), default=0.0)
    data = [json.loads((r / "checkpoints" / str(s) / "data" / "metadata").read_text()) for r, s in ((a, sa), (b, sb))]
    out["data_position_equal"] = data[0] == data[1]
    evals = [[json.loads(ln) for ln in (r / "eval.jsonl").read_text().splitlines()][-1] for r in (a, b)]
    out["eval_loss"] = [e["loss/main"] for e in evals]
    la, lb = logged_losses(a), logged_losses(b)
    out["logged_steps_once"] = [s for s, _ in la] == sorted({s for s, _ in la}) == [s for s, _ in lb]
    out["loss_max_abs_diff"] = max((abs(x - y) for (_, x), (_, y) in zip(la, lb)), default=0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--interruptions", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heartbeat", type=int, default=10, help="MTPJAX_HEARTBEAT_TIMEOUT of every process")
    ap.add_argument("--out", type=Path, required=True, help="a new directory for the runs and logs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True)
    corpus, steps = write_corpus(args.out), EVERY * 3 * (args.interruptions + 2)
    t0 = time.monotonic()
    assert wait_all(launch(soak_overrides(args.out, corpus, "straight", steps), 1, args.out / "straight")) == [0]
    straight_s = time.monotonic() - t0
    events, final = soak(soak_overrides(args.out, corpus, "soak", steps), args.out / "soak", args.out / "logs",
                         args.interruptions, args.seed, heartbeat=args.heartbeat)
    soak_s = time.monotonic() - t0 - straight_s
    result = {"steps": steps, "straight_s": round(straight_s, 1), "soak_s": round(soak_s, 1),
              "final_exit_codes": final, "events": [vars(e) for e in events],
              "compare": compare(args.out / "straight", args.out / "soak"), "load": os.getloadavg()}
    print(json.dumps(result, indent=1))
    return 0 if final and set(final) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
