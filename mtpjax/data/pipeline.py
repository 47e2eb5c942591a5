"""grain pipeline: flat token array → per-process shard of windows → seeded shuffle → repeat → batch.

A split's stream (documents joined, EOS after each) is cut into `seq_len`-token windows; the final
partial window is dropped, so there is no padding. `segment_ids` number the documents inside a window
1, 2, 3, ... and the EOS token belongs to the document it ends (the loss masks cross-document targets).
Process p of P reads windows [p*W/P, (p+1)*W/P) only; with `num_epochs=None` the shard repeats
forever, reshuffled every epoch (grain reseeds with seed + epoch), and batches may straddle epochs.

`num_workers` sets grain's prefetch threads (worker processes would only add start-up time here).
Iterator state (`get_state()`) is a small JSON-serializable dict: grain's `next_index` plus the settings
it is only meaningful for; save it with orbax `args.JsonSave(state)` / `args.JsonRestore()`. The
process count is not checked: after a restart on a different number of processes each one resumes
at the same batch index in its new shard (same step count, not the same examples).
"""

from __future__ import annotations

import grain
import numpy as np

from mtpjax.data.errors import DataError

_CHECKED = ("split", "seq_len", "batch_size", "seed", "shuffle", "content_hash")


def segment_ids(tokens_BT: np.ndarray, eos_id: int) -> np.ndarray:
    """Document number (from 1) of each token in each window; EOS closes its own document."""
    is_eos = tokens_BT == eos_id
    return (1 + np.cumsum(is_eos, axis=-1) - is_eos).astype(np.int32)


class _Windows:
    """Maps a batch of shard-local window indices to a batch dict."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, eos_id: int):
        self.tokens, self.seq_len, self.first, self.eos_id = tokens, seq_len, first, eos_id

    def __call__(self, idx_B: np.ndarray) -> dict[str, np.ndarray]:
        starts_B = (self.first + np.asarray(idx_B, dtype=np.int64)) * self.seq_len
        tokens_BT = np.asarray(self.tokens[starts_B[:, None] + np.arange(self.seq_len)], dtype=np.int32)
        return {"tokens": tokens_BT, "segment_ids": segment_ids(tokens_BT, self.eos_id)}


class BatchIterator:
    """Iterator of {"tokens", "segment_ids"} int32 [B, T] numpy batches with get_state/set_state."""

    def __init__(self, dataset: grain.MapDataset, info: dict, read_options):
        self.info = info
        self._it = iter(dataset.to_iter_dataset(read_options))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict:
        """JSON-serializable position (plus the settings it belongs to)."""
        return {**self._it.get_state(), **{k: self.info[k] for k in _CHECKED}}

    def set_state(self, state: dict) -> None:
        """Continue from a state returned by get_state; DataError if it belongs to other settings."""
        diff = [f"{k}={state.get(k)!r} (now {self.info[k]!r})" for k in _CHECKED if state.get(k) != self.info[k]]
        if diff:
            raise DataError(f"data iterator state was saved with {', '.join(diff)}; resume with the same "
                            "data and batch settings, or start without restoring the data state")
        self._it.set_state({k: v for k, v in state.items() if k not in _CHECKED})


def make_iterator(prepared, *, split: str, seq_len: int, batch_size: int, seed: int, shuffle: bool = True,
                  process_index: int = 0, process_count: int = 1, num_epochs: int | None = None,
                  num_workers: int = 0) -> BatchIterator:
    """Batches of this process's shard of `split`; infinite when num_epochs is None."""
    tokens = prepared.tokens(split)
    if batch_size % process_count:
        raise DataError(f"batch size {batch_size} is not divisible by the {process_count} processes; "
                        f"use a multiple of {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is outside [0, {process_count})")
    local_bs = batch_size // process_count
    per_proc = len(tokens) // seq_len // process_count
    if per_proc < local_bs:
        raise DataError(f"the {split} split has {len(tokens)} tokens but one batch needs {batch_size} x "
                        f"{seq_len} = {batch_size * seq_len} ({process_count} process(es)); lower "
                        "train.batch_size or data.seq_len, or add data")
    ds = grain.MapDataset.range(per_proc)
    if shuffle:
        ds = ds.shuffle(seed=seed % 2**32)
    ds = ds.repeat(num_epochs).batch(local_bs, drop_remainder=True)
    ds = ds.map(_Windows(tokens, seq_len, process_index * per_proc, prepared.tokenizer.eos_id))
    info = {"split": split, "seq_len": seq_len, "batch_size": batch_size, "seed": seed, "shuffle": shuffle,
            "content_hash": prepared.meta.get("content_hash"), "batches_per_epoch": per_proc // local_bs,
            "local_batch_size": local_bs}
    # a batch is one fancy-indexed memmap read (>1000 batches/s of 16x256 on one core): threads suffice
    read = grain.ReadOptions(num_threads=max(1, num_workers), prefetch_buffer_size=max(2, 2 * num_workers))
    return BatchIterator(ds, info, read)
