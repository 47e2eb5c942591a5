"""train/hooks.py: the loop's jobs run on their schedules, a synced job sees its step's metrics read, a stop stops."""

from mtpjax.train.hooks import Hooks, Tick


def _ticks(start: int, end: int):
    """The ticks of a loop from `start` to `end`: before the first step, then after each."""
    yield Tick(start, None, None, last=start >= end)
    for s in range(start + 1, end + 1):
        yield Tick(s, None, {"loss": s}, last=s == end)


def _run(hooks: Hooks, start: int, end: int) -> int:
    for tick in _ticks(start, end):
        if hooks.run(tick) or tick.last:
            return tick.step
    raise AssertionError("no last tick")


def test_each_job_runs_on_its_schedule_in_the_order_added():
    calls = []
    hooks = Hooks(sync=lambda t: calls.append(("sync", t.step)))
    hooks.add(lambda t: calls.append(("each", t.step)))
    hooks.add(lambda t: calls.append(("third", t.step)), every=3, synced=True)
    hooks.add(lambda t: calls.append(("at 5", t.step)), every=lambda s: s == 5)
    hooks.add(lambda t: calls.append(("before", t.step)), before_step=True)
    assert _run(hooks, 2, 6) == 6
    assert calls == [("before", 2),
                     ("sync", 3), ("each", 3), ("third", 3), ("before", 3),  # a synced job due: sync first
                     ("each", 4), ("before", 4),
                     ("each", 5), ("at 5", 5), ("before", 5),
                     ("sync", 6), ("each", 6), ("third", 6)]  # no step follows the last tick: nothing before one


def test_a_job_that_asks_to_stop_ends_the_run_before_the_next_step():
    calls = []
    hooks = Hooks(sync=lambda t: None)
    hooks.add(lambda t: t.step == 4, before_step=True)
    hooks.add(lambda t: calls.append(t.step), before_step=True)
    assert _run(hooks, 0, 10) == 4
    assert calls == [0, 1, 2, 3]  # the jobs after the one that stopped do not run
    # Companion: a job returning something other than True (a dict of metrics, say) does not stop the run.
    hooks = Hooks(sync=lambda t: None)
    hooks.add(lambda t: {"eval/loss": 1.0})
    assert _run(hooks, 0, 10) == 10


def test_a_finished_run_runs_no_job():
    calls = []
    hooks = Hooks(sync=lambda t: calls.append("sync"))
    hooks.add(lambda t: calls.append("after"), synced=True)
    hooks.add(lambda t: calls.append("before"), before_step=True)
    assert _run(hooks, 7, 7) == 7 and calls == []
