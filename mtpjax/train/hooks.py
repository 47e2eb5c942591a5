"""The jobs the train loop runs between its steps, each registered once with its schedule.

As Levanter's `add_hook(fn, every=n)`: the loop only steps and calls `Hooks.run` at each tick; a new job (an eval
of another kind, a goodput record) is one `hooks.add(job, every=n)` line where `loop.py` registers the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tick:
    """Where the run stands between two steps: `step` steps done, `state` after them, `metrics` the device arrays
    of the step just done (None before the first step), `last`: no step follows."""

    step: int
    state: Any
    metrics: dict | None
    last: bool


@dataclass(frozen=True)
class Hook:
    """One job: `fn(tick)` (returning True stops the run before the next step) and when it runs."""

    fn: Callable[[Tick], bool | None]
    due: Callable[[int], bool]  # after which steps (the step count); unused for a job run before every step
    before_step: bool  # runs at every tick a step follows (before the first too), not after the last
    synced: bool  # reads the host's view of this step: the delayed metric read catches up first


class Hooks:
    """The loop's jobs in the order they run at a tick; `sync(tick)` reads the tick's metrics at once."""

    def __init__(self, sync: Callable[[Tick], None]):
        self.sync, self.hooks = sync, []

    def add(self, fn: Callable[[Tick], bool | None], every: int | Callable[[int], bool] = 1, *,
            before_step: bool = False, synced: bool = False) -> None:
        """Run `fn` after every `every`-th step (or the steps a predicate of the step count picks), or before every
        step; `synced`: only once this step's metrics were read and checked (train.nan_policy)."""
        due = every if callable(every) else (lambda step: step % every == 0)
        self.hooks.append(Hook(fn, due, before_step, synced))

    def run(self, tick: Tick) -> bool:
        """Run the jobs due at `tick`, in the order added; whether one asked to stop the run."""
        due = [h for h in self.hooks if (not tick.last if h.before_step else
                                         tick.metrics is not None and h.due(tick.step))]
        if any(h.synced for h in due):
            self.sync(tick)
        return any(h.fn(tick) is True for h in due)  # the jobs after one that stops do not run
