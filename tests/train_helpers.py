"""Shared pieces of the training-system tests: a tiny config over a small deterministic text corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from mtpjax.config import Config, load_config

TINY = [
    "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.mtp_depth=2", "data.source=text", "data.tokenizer=byte", "data.seq_len=32",
    "data.val_fraction=0.1", "train.batch_size=8", "train.steps=8", "train.eval_every=4", "train.eval_batches=1",
    "train.log_every=2", "train.num_samples=1", "train.progress=false", "train.peak_flops=1e9",
    "checkpoint.every=4", "optim.warmup_steps=2", "optim.lr=1e-2",
]
_SOURCES = ("json/__init__.py", "textwrap.py", "string.py", "bisect.py", "colorsys.py", "fnmatch.py")


def write_corpus(directory: Path) -> Path:
    """A ~60 KB text file made of a few standard-library sources (deterministic for one interpreter)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    path = Path(directory) / "corpus.txt"
    path.write_text("\n".join((lib / name).read_text() for name in _SOURCES))
    return path


def tiny_cfg(tmp: Path, *overrides: str, corpus: Path | None = None, run: str = "run") -> Config:
    """The tiny training config with its corpus, cache and run dir under `tmp`."""
    corpus = corpus or write_corpus(tmp)
    base = TINY + [f"data.paths={corpus}", f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / run}"]
    return load_config(None, base + list(overrides))


def cli_args(cfg: Config, *extra: str) -> list[str]:
    """train.py argv reproducing `cfg` (a config file holding it) plus extra overrides."""
    path = Path(cfg.data.cache_dir).parent / f"cfg-{Path(cfg.train.run_dir).name}.yaml"
    path.write_text(cfg.to_yaml())
    return ["--config", str(path), *extra]


def synthetic_batches(n: int, batch: int, seq_len: int, seed: int = 0, vocab: int = 256):
    """n (tokens, segment_ids) int32 batches with several documents per row and padded (segment 0) tails."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(1, vocab, (batch, seq_len)).astype(np.int32)
        seg = np.zeros((batch, seq_len), np.int32)
        for r in range(batch):
            cuts = np.sort(rng.choice(np.arange(1, seq_len), 2, replace=False))
            seg[r] = 1 + (np.arange(seq_len) >= cuts[0]) + (np.arange(seq_len) >= cuts[1])
            seg[r, seq_len - rng.integers(0, seq_len // 4):] = 0  # padding
        out.append((np.where(seg == 0, 0, tok).astype(np.int32), seg))
    return out


def step_losses(cfg: Config, batches, devices=None) -> tuple[list[float], object]:
    """loss/total of consecutive train steps on a mesh from cfg.mesh over `devices`; also the final state."""
    import jax

    from mtpjax.parallel.sharding import make_mesh
    from mtpjax.train.step import make_programs

    progs = make_programs(cfg, make_mesh(cfg.mesh, devices))
    state, losses = progs.init(), []
    for tok, seg in batches:
        put = lambda x: jax.device_put(x, progs.batch_sharding)
        state, met = progs.train_step(state, put(tok), put(seg))
        losses.append(float(met["loss/total"]))
    return losses, state


def one_line_error(capsys, main, argv) -> str:
    """Run a CLI's main(argv): exit 2 and one `error: ...` line on stderr, no traceback; that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


REPO = Path(__file__).resolve().parent.parent
HANG = 900.0  # seconds: only a hung run takes this long, and that fails the test (no step depends on it)
# XLA:CPU aborts a collective ("Termination timeout ... exceeded") whose emulated devices, threads of one process, do
# not all reach it within its terminate timeout; on a loaded 2-core host a device's thread can lag that long (the
# staged runs' ppermute and all-reduce did), so processes with emulated devices wait for their collectives up to HANG.
PATIENT_COLLECTIVES = f"--xla_cpu_collective_call_terminate_timeout_seconds={int(HANG)}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sub_env(**kw) -> dict:
    """The environment of a train.py subprocess: this checkout, CPU, no inherited launch variables, plus `kw`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MTPJAX_", "SLURM_", "TPU_"))}
    return {**base, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **{k: str(v) for k, v in kw.items()}}


def spawn(args: list[str], log: Path, script: str = "train.py") -> subprocess.Popen:
    """A `python train.py ARGS` process; stderr goes to `log` (a file, so it never blocks on a full pipe)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / script), *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"))


def wait_for(cond, proc: subprocess.Popen, timeout: float = HANG, poll: float = 0.002) -> bool:
    """Poll `cond()` until it holds (True) or the process exits first (False); `timeout` guards against a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if cond():
            return True
        time.sleep(poll)
    return bool(cond())


def evaluated_at(run_dir: Path, step: int) -> bool:
    """Whether the run has logged an eval (a complete eval.jsonl line) at `step` or later: progress seen on disk."""
    path = Path(run_dir) / "eval.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # the last piece may be half-written
    return any(json.loads(ln)["step"] >= step for ln in lines)


WORKER_LOG = "MTPJAX_TEST_WORKER_LOG"


def started_worker(*args) -> None:
    """Stands in for data.encode's worker initializer: notes the worker's process id as a file in the directory
    $MTPJAX_TEST_WORKER_LOG, then runs the real one (a spawned worker imports this module by name)."""
    from mtpjax.data import encode

    (Path(os.environ[WORKER_LOG]) / str(os.getpid())).touch()
    encode._init_worker(*args)


def dying_worker(*args) -> None:
    """Stands in for data.encode's worker initializer: the worker process ends at once, as one killed would."""
    os._exit(9)
