"""A run directory's lifecycle: the identity check before resuming, --fresh, the writable probe, setup and record.

Checked and probed before anything is written; set up (--fresh) once the data is ready; its record (config.yaml,
tokenizer/) written once the run's state opened.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax

from mtpjax.parallel import distributed
from mtpjax.train.checkpoint import SavedRun, complete_steps, read_run_config
from mtpjax.config import Config, identity
from mtpjax.errors import MtpjaxError

IDENTITY_SECTIONS = ("model", "data")  # what makes a run dir "the same run"; other sections may change on resume
# ...and single keys elsewhere that fix a checkpoint's layout (the optimizer state covers only what trains)
IDENTITY_KEYS = ("train.freeze",)


class RunDirError(MtpjaxError, RuntimeError):
    """The run directory cannot be used; the message is one line naming the problem and the fix."""


def _diff(a, b, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}.{k}")]
    return [] if a == b else [f"{prefix.lstrip('.')}: {a!r} -> {b!r}"]


def _unplaced(section: dict) -> dict:
    """A section's identity without where its files lie (data.paths, each mixture source's paths): a corpus moved
    elsewhere is the same run, its tokens compared at restore (the data position holds their content hashes)."""
    out = {k: v for k, v in section.items() if k != "paths"}
    if "mixture" in out:
        out["mixture"] = [{k: v for k, v in m.items() if k != "paths"} for m in out["mixture"]]
    return out


def saved_config(run: Path) -> Config | None:
    """The config a run dir holds: its config.yaml, else (deleted) its newest readable checkpoint's; None if neither."""
    old = read_run_config(run)
    if old is None and complete_steps(run):
        with SavedRun(run) as saved:
            old = saved.newest_config()
    return old


def check_identity(cfg: Config) -> None:
    """Refuse a run dir whose saved model/data config differs."""
    run = Path(cfg.train.run_dir)
    old = saved_config(run)
    if old is None:
        return
    diffs = [d for s in IDENTITY_SECTIONS for d in _diff(_unplaced(identity(old, s)), _unplaced(identity(cfg, s)), s)]
    flat_old, flat_new = old.to_dict(), cfg.to_dict()
    for key in IDENTITY_KEYS:
        s, k = key.split(".")
        diffs += _diff(flat_old[s].get(k), flat_new[s].get(k), key)
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; +{len(diffs) - 3} more" if len(diffs) > 3 else "")
        raise RunDirError(f"run dir '{run}' holds a run with a different model/data/freeze config ({shown}); "
                          "pass --fresh to move it aside, or set another train.run_dir")
    check_clipping(old, cfg, run)


def check_clipping(old: Config, cfg: Config, run: Path) -> None:
    """Refuse turning gradient clipping on or off on resume: the clipping stage is part of the optimizer state the
    checkpoints hold (its threshold may change)."""
    was = old.optim.grad_clip > 0
    if was != (cfg.optim.grad_clip > 0):
        keep = "optim.grad_clip > 0 (any value)" if was else "optim.grad_clip=0"
        raise RunDirError(f"run dir '{run}' holds a run trained with optim.grad_clip={old.optim.grad_clip} (clipping "
                          f"{'on' if was else 'off'}); turning it {'off' if was else 'on'} changes the optimizer state "
                          f"its checkpoints hold: set {keep} to resume, or pass --fresh to move the run aside")


def check_tokenizer(cfg: Config, tokenizer) -> None:
    """Refuse resuming a run dir whose saved tokenizer/ gives other token ids than the data's tokenizer (the file
    data.tokenizer names was changed in place): the run's embedding rows are that tokenizer's ids."""
    from mtpjax.data import DataError, tokenizer_from_dir

    run = Path(cfg.train.run_dir)
    try:
        saved = tokenizer_from_dir(run / "tokenizer")
    except DataError:  # none yet, or unreadable: the run's record gets the data's (rundir.record)
        return
    if not same_ids(saved, tokenizer):
        fix = ("the BPE is trained on the corpus, which changed since: restore the corpus" if cfg.data.tokenizer ==
               "bpe" else f"put that tokenizer back at {cfg.data.tokenizer}")
        raise RunDirError(f"data.tokenizer={cfg.data.tokenizer} gives other token ids than the tokenizer the run in "
                          f"'{run}' was trained with ({run / 'tokenizer'}); {fix}, or pass --fresh to move the run "
                          "aside")


def same_ids(a, b) -> bool:
    """Whether two tokenizers map text to the same ids: kind, vocabulary, end of document, every id's text."""
    if (a.kind, a.vocab_size, a.eos_id) != (b.kind, b.vocab_size, b.eos_id) or a.encode(PROBE) != b.encode(PROBE):
        return False
    return all(a.decode([i]) == b.decode([i]) for i in range(a.vocab_size))


PROBE = "def f(x):\n    return {'é': x ** 2}  # 你好, tokenizers\n"


# What every run directory holds once it has trained (written by rundir.record, the checkpointer, the Logger).
RUN_MARKS = ("config.yaml", "checkpoints", "tensorboard", "tokenizer")


def check_fresh(run: Path) -> None:
    """--fresh moves the run dir aside: refuse one that is, or holds, the working directory (train.run_dir=.), and a
    non-empty directory that holds no run (train.run_dir=~ would move a home directory aside)."""
    here, there = Path.cwd().resolve(), run.resolve()
    if here == there or there in here.parents:
        raise RunDirError(f"--fresh would move train.run_dir '{run}' aside, and it is or holds the current directory "
                          f"('{here}'); run from another directory, or set another train.run_dir")
    if run.is_dir() and any(run.iterdir()) and not any((run / m).exists() for m in RUN_MARKS):
        raise RunDirError(f"--fresh moves a run aside, and train.run_dir '{run}' holds files but no run (none of "
                          f"{', '.join(RUN_MARKS)}); set train.run_dir to a new or a run's directory")


def probe_writable(run: Path) -> list[Path]:
    """Create the run dir (if missing) and write a probe file; RunDirError if impossible. Returns the directories
    it created, deepest first, for remove_created."""
    if run.exists() and not run.is_dir():
        raise RunDirError(f"train.run_dir '{run}' is a file, not a directory; choose another train.run_dir")
    created = [p for p in (run, *run.parents) if not p.exists()]
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / f".write-probe-{time.time_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"train.run_dir '{run}' is not writable ({e.strerror or e}); choose a writable "
                          "train.run_dir") from None
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the directories probe_writable created while they are still empty: a refused run leaves none."""
    for d in created:
        try:
            d.rmdir()
        except OSError:  # not empty (another process's run, or written meanwhile): keep it and its parents
            return


@contextmanager
def probed(run: Path) -> Iterator[None]:
    """probe_writable for a block of checks: if one refuses the run, remove_created (a refused run leaves none)."""
    created = probe_writable(run)
    try:
        yield
    except BaseException:
        remove_created(created)
        raise


def setup(cfg: Config, fresh: bool) -> Path:
    """--fresh moves an old run to <run_dir>.old-<timestamp> (never deletes); the run dir exists after it."""
    run = Path(cfg.train.run_dir)
    if fresh and jax.process_index() == 0 and run.exists() and any(run.iterdir()):
        aside = run.with_name(f"{run.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}")
        run.rename(aside)
        print(f"moved the previous run aside to {aside}", file=sys.stderr)
    if jax.process_index() == 0:
        run.mkdir(parents=True, exist_ok=True)
    distributed.barrier("mtpjax-run-dir")  # no process may look for checkpoints before the run dir is set up
    return run


def record(cfg: Config, tokenizer) -> None:
    """Write config.yaml and tokenizer/: only once the run's state opened, so a resume refused at its checkpoint
    (another batch size, no readable checkpoint) leaves the run's record as it was."""
    if jax.process_index() != 0:
        return
    run = Path(cfg.train.run_dir)
    # Written aside and renamed: a kill mid-write must not leave a truncated config that blocks resuming.
    tmp = run / f".config.yaml.tmp-{time.time_ns()}"
    tmp.write_text(cfg.to_yaml())
    tmp.replace(run / "config.yaml")
    tokenizer.save(run / "tokenizer")
