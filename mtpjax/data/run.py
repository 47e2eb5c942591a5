"""The data of a training run: prepared corpus, this process's rows of the global train stream, eval batches."""

from __future__ import annotations

import itertools

from mtpjax.data.errors import DataError
from mtpjax.data.hosts import local_rows, prepare_on_hosts
from mtpjax.data.pipeline import make_iterator
from mtpjax.data.synthetic import task_batch
from mtpjax.data.tokenizer import check_vocab


def first_batches(prepared, n: int, name: str = "", **kw) -> list:
    """The first n batches of the unshuffled validation split, each window at most once (fewer batches if the split
    holds fewer): the same numbers at every eval (and decode.py --eval)."""
    try:
        it = make_iterator(prepared, split="val", shuffle=False, num_epochs=1, **kw)
    except DataError as e:
        raise DataError(f"data.mixture source '{name}': {e}" if name else str(e)) from None
    return list(itertools.islice(it, n))


def open_run_data(cfg, sharding) -> tuple:
    """(prepared, train iterator, validation batches, {source name: its validation batches} for a mixture,
    the held-out instances of a synthetic source's task metric or None).

    `sharding` is the batch sharding: each process reads the rows of every global batch its devices hold.
    """
    import jax

    prepared = prepare_on_hosts(cfg.data, progress=cfg.train.progress and jax.process_index() == 0)
    check_vocab(prepared.tokenizer, cfg.model.vocab_size)
    common = {"seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size, "seed": cfg.train.seed,
              "rows": local_rows(sharding, cfg.train.batch_size)}
    train_it = make_iterator(prepared, split="train", shuffle=cfg.data.shuffle, num_workers=cfg.data.num_workers,
                             **common)
    n, val, by_source = cfg.train.eval_batches, [], {}
    if n:
        val = first_batches(prepared, n, **common)
        if len(prepared.sources()) > 1:
            by_source = {name: first_batches(part, n, name, **common) for name, _, part in prepared.sources()}
    tasks = task_batch(cfg.data, prepared.tokenizer, cfg.data.task_instances, cfg.data.seq_len) if n else None
    return prepared, train_it, val, by_source, tasks


def eval_by_source(by_source: dict, evaluate, keep) -> dict:
    """{"<source>/<metric>": value} for each source's validation batches and each metric named in `keep`."""
    out = {}
    for name, batches in by_source.items():
        met = evaluate(batches)
        out.update({f"{name}/{k}": met[k] for k in keep if k in met})
    return out
