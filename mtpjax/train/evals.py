"""What the train loop runs at each eval step: validation metrics and generated samples, written to TensorBoard.

`run_eval` is the eval job the loop registers (train/loop.py); a new eval scalar is one more function whose dict
joins `scalars` there (as `eval/bits_per_byte` does). Every eval is also appended to `<run_dir>/eval.jsonl`
(`eval_log`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from mtpjax.parallel import distributed
from mtpjax.data import eval_by_source
from mtpjax.eval.log import append_eval
from mtpjax.eval.task_metrics import task_metrics
from mtpjax.eval.validation import validation_metrics
from mtpjax.nn.model import placed
from mtpjax.nn.placement import host_placement
from mtpjax.train.metrics import Writer
from mtpjax.decode import generate  # the decoder's cached generation: the one import of the decoder here

SAMPLE_PROMPT = 32  # tokens of a validation row that prompt each sample
SAMPLE_TOKENS = 64  # greedy tokens generated per sample


def validation(progs, state, val: list, to_global, tokenizer=None) -> dict:
    """The validation metrics of mtpjax.eval.validation over the fixed validation batches, on the run's mesh."""
    per_batch = jax.device_get([progs.eval_step(state, *to_global(b)) for b in val])
    return validation_metrics(per_batch, val, tokenizer)


def _host_model(progs, state):
    """The model on this process's first device; with several processes every one must call this (all-gather)."""
    if jax.process_count() == 1:
        return nnx.merge(progs.graphdef, state.params)
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(state.params, tiled=True)  # numpy: sharded over processes before
    # rebuilt for the one device it now lives on: the decode loop lays its state out where the model is placed
    return placed(nnx.merge(progs.graphdef, jax.device_put(params, jax.local_devices()[0])), host_placement())


def samples(progs, state, val: list, tokenizer, n: int) -> list[str]:
    """Greedy continuations of the first validation rows' opening tokens, as 'prompt ⟶ continuation' text."""
    if n == 0:
        return []
    prompt_BP = np.asarray(val[0]["tokens"])[:n, :SAMPLE_PROMPT]
    model = _host_model(progs, state)
    if not distributed.is_primary():  # only process 0 writes them; its rows are the ones shown
        return []
    out = generate(model, prompt_BP.tolist(), max_new_tokens=SAMPLE_TOKENS).tokens
    return [tokenizer.decode(p.tolist()) + " ⟶ " + tokenizer.decode(o) for p, o in zip(prompt_BP, out)]


def run_eval(progs, state, val: list, val_sources: dict, to_global, tokenizer, writer: Writer, step: int,
             num_samples: int, run_dir=None, tasks=None) -> dict:
    """Validation scalars (returned as `eval/...`; a mixture's also per source; a synthetic source's task metric on
    the held-out instances `tasks`) and samples, written at `step` (and appended to `<run_dir>/eval.jsonl`)."""
    if not val:
        return {}
    met = validation(progs, state, val, to_global, tokenizer)
    met |= eval_by_source(val_sources, lambda batches: validation(progs, state, batches, to_global, tokenizer),
                          list(met))
    if tasks is not None:
        met |= task_metrics(_host_model(progs, state), tasks)
    scalars = {f"eval/{k}": v for k, v in met.items()}
    writer.scalars(step, scalars)
    if run_dir is not None and distributed.is_primary():
        append_eval(run_dir, step, met)
    for i, text in enumerate(samples(progs, state, val, tokenizer, num_samples)):
        writer.text(step, f"samples/{i}", text)
    writer.flush()
    return scalars
