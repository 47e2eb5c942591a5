"""The in-training task eval: lm-eval task scores of the live model, every train.eval_tasks_every steps.

Written to TensorBoard as `tasks/<task>/<metric>` beside the losses. Runs on process 0's model (the task
harness scores on one device); lm-eval is imported only when train.eval_tasks names a task.
"""

from __future__ import annotations

from mtpjax.parallel import distributed
from mtpjax.train.evals import _host_model
from mtpjax.train.metrics import Writer


def check(cfg) -> None:
    """Before training: TaskError for a task in train.eval_tasks that is unknown or cannot be read here."""
    if cfg.train.eval_tasks and distributed.is_primary():
        from mtpjax.eval import tasks

        tasks.load(list(cfg.train.eval_tasks))


def due(cfg, step: int, end: int) -> bool:
    """Whether a task eval runs after `step` (every eval_tasks_every steps, and at the last)."""
    return bool(cfg.train.eval_tasks) and (step % cfg.train.eval_tasks_every == 0 or step == end)


def run_task_eval(cfg, progs, state, tokenizer, writer: Writer, step: int) -> dict:
    """The task scores at `step` (`tasks/<task>/<metric>`), written to TensorBoard; {} on processes > 0."""
    from mtpjax.eval import tasks
    from mtpjax.eval.harness import MtpjaxLM

    model = _host_model(progs, state)  # every process takes part in the gather
    if not distributed.is_primary():
        return {}
    lm = MtpjaxLM(model, tokenizer, max_length=cfg.data.seq_len, batch_size=cfg.train.batch_size)
    names = list(cfg.train.eval_tasks)
    results = tasks.evaluate(lm, names, limit=cfg.train.eval_tasks_limit or None)
    out = {f"tasks/{k}": v for k, v in tasks.scores(results).items()}
    writer.scalars(step, out)
    writer.flush()
    return out
