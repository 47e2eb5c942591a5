"""A training run's setup, one stage after the next, each handing the next what it needs (`open_run`).

compilation cache → mesh → init_from → run directory and data → own text → programs → state; `loop.train` runs
`open_run`, then the loop. The mesh comes first: the data shards its batches over it. Nothing is written before
every check that can refuse the run has passed (train.eval_tasks, batch vs mesh, init_from, identity, data), so
a refused run leaves no run directory behind. The state stage chooses among resuming, post-training
(train.init_from, read and checked up front with the other refusals by `posttrain.source_config`) and a fresh init.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from mtpjax import data
from mtpjax.config import Config
from mtpjax.errors import MtpjaxError
from mtpjax.parallel.sharding import BATCH_AXES, batch_sharding, data_parallelism, make_mesh, named_axes
from mtpjax.parallel import runtime
from mtpjax.train import owntext, posttrain, rundir, task_evals
from mtpjax.train.checkpoint import Checkpointer
from mtpjax.train.report import say
from mtpjax.train.step import Programs, TrainState


class TrainError(MtpjaxError, RuntimeError):
    """Bad training setup (batch vs mesh); the message is one line naming the problem and the fix."""


def open_run(cfg: Config, fresh: bool, make_programs: Callable[[Config, Mesh], Programs]) -> tuple[Run, Start]:
    """Every stage of a run's setup in order, and the loop's first step; the programs come from `make_programs`
    (train.step's, or a wrapper that records what a sweep's variants train on)."""
    runtime.enable_compilation_cache(cfg.train.compilation_cache)
    task_evals.check(cfg)  # an unknown train.eval_tasks, refused before anything is written
    mesh = open_mesh(cfg)
    source = posttrain.source_config(cfg, fresh)  # a new run's init_from, checked before anything is written
    run_dir, run_data = open_run_dir(cfg, mesh, fresh, source)
    run_data = owntext.use_own_text(cfg, run_dir, run_data, mesh)  # train.own_text: the trunk's continuations
    run = Run(cfg, mesh, run_dir, run_data, make_programs(cfg, mesh), Checkpointer(run_dir, cfg.checkpoint))
    start = open_state(run, source)
    rundir.record(cfg, run_data.prepared.tokenizer)  # config.yaml and tokenizer/, once nothing can refuse the run
    return run, start


def check_parallelism(cfg: Config, mesh: Mesh) -> None:
    """The batch must split evenly over data parallelism, micro-batches and processes."""
    dp, B, A = data_parallelism(mesh), cfg.train.batch_size, cfg.train.micro_batches
    if B % (dp * A):
        split = "*".join(f"mesh.{a}" for a in named_axes(BATCH_AXES, mesh.shape))
        raise TrainError(f"train.batch_size={B} is not divisible by data parallelism {split}={dp} "
                         f"times train.micro_batches={A}; use a multiple of {dp * A}")
    if B % jax.process_count():
        raise TrainError(f"train.batch_size={B} is not divisible by the {jax.process_count()} processes")


def open_mesh(cfg: Config) -> Mesh:
    """The device mesh of cfg.mesh; MeshError or TrainError (nothing written) if the run cannot use it."""
    mesh = make_mesh(cfg.mesh)
    check_parallelism(cfg, mesh)
    return mesh


@dataclass(frozen=True)
class RunData:
    """The corpus and what the loop reads from it: the training stream (its position is checkpointed) and the
    validation batches, per source too for a mixture, and a synthetic source's task instances."""

    prepared: data.PreparedData | data.PreparedMixture
    train: data.BatchIterator
    val: list
    val_sources: dict
    tasks: data.synthetic.TaskBatch | None = None  # a synthetic source's held-out instances (task metric)


def open_data(cfg: Config, mesh: Mesh) -> RunData:
    """Each process reads its rows of every global batch; DataError on bad input."""
    return RunData(*data.open_run_data(cfg, batch_sharding(mesh)))


def open_run_dir(cfg: Config, mesh: Mesh, fresh: bool, source: posttrain.Source | None) -> tuple[Path, RunData]:
    """The run directory (identity checked unless --fresh, probed writable) and the data (init_from's tokenizer
    checked against it); then --fresh moves an old run aside. A refusal removes what the probe created."""
    if fresh:
        rundir.check_fresh(Path(cfg.train.run_dir))
    else:
        rundir.check_identity(cfg)
    with rundir.probed(Path(cfg.train.run_dir)):
        run_data = open_data(cfg, mesh)
        posttrain.check_tokenizer(cfg, source, run_data.prepared.tokenizer)
        if not fresh:
            rundir.check_tokenizer(cfg, run_data.prepared.tokenizer)
    return rundir.setup(cfg, fresh), run_data


@dataclass(frozen=True)
class Run:
    """What the loop runs with: the config, mesh, run directory, data, compiled programs and checkpointer."""

    cfg: Config
    mesh: Mesh
    dir: Path
    data: RunData
    progs: Programs
    ck: Checkpointer


@dataclass(frozen=True)
class Start:
    """The loop's first step and state; `goodput`: the checkpoint's goodput totals ({} at step 0, None: unknown)."""

    step: int
    state: TrainState
    goodput: dict | None = None
    skipped: int = 0  # updates skipped before `step` (train.nan_policy=skip), which max_skipped_steps counts on from


def open_state(run: Run, source: posttrain.Source | None) -> Start:
    """Resume from the newest readable checkpoint (the training stream put back where it was); else a new run's
    step 0: from init_from's trunk when a source was chosen, else a fresh init."""
    restored = run.ck.restore_latest(run.progs.target)  # unreadable newer checkpoints are reported
    if restored:
        step, state, data_state, meta = restored
        run.data.train.set_state(data_state)
        say(f"resuming from checkpoint {step} in {run.ck.dir}")
        return Start(step, state, meta.get("goodput"), meta.get("skipped_steps", 0))
    if source is not None:  # read only now, before the first checkpoint
        return Start(0, posttrain.initial_state(run.cfg, source, run.progs), {})
    return Start(0, run.progs.init(), {})
