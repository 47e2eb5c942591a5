"""What a process sets up around its programs: the cache directory, the persistent compilation cache, profiling.

None of it changes what is computed, and nothing here writes into a run directory except the profile
that `train.profile` asks for (into the run's TensorBoard directory, where TensorBoard looks for it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import jax

from mtpjax.config import parse_profile
from mtpjax.parallel import console


def cache_root() -> Path:
    """mtpjax's per-user cache: $MTPJAX_CACHE_DIR, else ~/.cache/mtpjax (never inside a run directory)."""
    root = os.environ.get("MTPJAX_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    try:
        return Path.home() / ".cache" / "mtpjax"
    except (RuntimeError, KeyError):  # no home directory: everything kept here is only a speed-up
        return Path(tempfile.gettempdir()) / "mtpjax"


def compilation_cache_dir() -> Path:
    """Where compiled XLA programs are kept: <cache_root>/xla."""
    return cache_root() / "xla"


def enable_compilation_cache(enabled: bool = True) -> Path | None:
    """Turn JAX's persistent compilation cache on in compilation_cache_dir() (a user's JAX_COMPILATION_CACHE_DIR
    wins), or off; returns the directory in use (None: off).

    Every program is cached, however small or quick to compile (JAX's defaults skip programs that compile in
    under a second, which on a CPU is most of them), so a restarted run compiles nothing it compiled before.
    """
    from jax.experimental.compilation_cache import compilation_cache

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(compilation_cache_dir())
    if enabled:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    now = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    if now != (enabled, path if enabled else now[1]):
        jax.config.update("jax_enable_compilation_cache", enabled)
        if enabled:
            jax.config.update("jax_compilation_cache_dir", path)
        # JAX decides once per process whether to use the cache, at its first compile; let it decide again.
        compilation_cache.reset_cache()
    return Path(path) if enabled else None


class Profiler:
    """A jax.profiler trace of the steps between `start` and `stop` completed steps (train.profile "start:stop").

    The trace goes to `<log_dir>/plugins/profile/<timestamp>/` (process i > 0: `<log_dir>/process_<i>/...`), read
    by TensorBoard's profile tab. Call step() before each train step with the number of steps completed so far
    and the state the step will consume, and close() when the loop ends (also on error): "10:13" traces the
    11th, 12th and 13th steps.
    """

    def __init__(self, spec: str, log_dir: str | Path):
        self.window = parse_profile(spec)
        self.log_dir, self.first = Path(log_dir), None  # first: the first traced step while a trace runs
        if jax.process_index() > 0:  # processes sharing a host would write the same <host>.xplane.pb
            self.log_dir = self.log_dir / f"process_{jax.process_index()}"

    def step(self, done: int, state) -> None:
        """Start the trace before step start+1; stop it once `stop` steps are done (their work finished)."""
        if self.window is None:
            return
        start, stop = self.window
        if self.first is None and start <= done < stop:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir))
            self.first = done + 1
        elif self.first is not None and done >= stop:
            self.close(done, state)

    def annotate(self, step: int):
        """Context around the dispatch of train step `step` (1-based): XProf's step marker while a trace runs.

        Without it the overview page reports "No step marker observed" and a step time of 0.
        """
        if self.first is None:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def close(self, done: int, state=None) -> None:
        """Stop a running trace once the device has finished the traced steps (`done` steps completed)."""
        if self.first is None:
            return
        first, self.first = self.first, None
        try:
            jax.block_until_ready(state)
        except RuntimeError:  # the state was donated to a step that failed: nothing left to wait for
            pass
        jax.profiler.stop_trace()
        if jax.process_index() == 0 and done >= first:
            console.say(f"profile of steps {first}..{done} written under {self.log_dir}/plugins/profile "
                        f"(TensorBoard's profile tab: tensorboard --logdir {self.log_dir})")  # above the bar
