"""Corpus preparation throughput (tokens/s) against the plain `tokenizers` batch encoder, side by side.

    python bench/data_bench.py [--mb 24] [--tokenizer bpe|byte] [--workers 0,2] [--rounds 3] [--json out.json]

A synthetic Parquet corpus (standard-library sources cut into ~2 KB documents, row groups of 2048 rows) is
prepared from scratch each round, in this process (`data.prepare_workers=0`) and with worker processes;
`encoder` is the batch encoder alone on the already-decoded documents (4 MB per call, as preparation
calls it), `read` is reading and decoding the documents alone. Rounds are interleaved; each ratio is the
median of per-round ratios to `encoder`, so machine load cancels out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpjax.config import DataConfig  # noqa: E402
from mtpjax.data import encode, prepare, sources  # noqa: E402
from mtpjax.data.tokenizer import ByteTokenizer, load_spec, train_bpe  # noqa: E402
from bench.common import json_path, write_json  # noqa: E402


def make_corpus(directory: Path, mb: float) -> tuple[Path, list[str]]:
    """A Parquet file of ~mb MB of ~2 KB documents cut from stdlib sources; also the documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lib = Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for f in sorted(lib.rglob("*.py")):
        text = f.read_text(errors="replace")
        for i in range(0, len(text), 2000):
            docs.append(text[i:i + 2000])
            size += len(docs[-1])
        if size >= mb * 2**20:
            break
    path = directory / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=2048)
    return path, docs


def time_encoder(tok, docs: list[str]) -> tuple[float, int]:
    t0, n, batch, size = time.perf_counter(), 0, [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= encode.BATCH_BYTES:
            n += len(encode.tokenize_batch(tok, batch))
            batch, size = [], 0
    if batch:
        n += len(encode.tokenize_batch(tok, batch))
    return time.perf_counter() - t0, n


def time_read(path: Path) -> float:
    t0 = time.perf_counter()
    utf8 = sources.Utf8Tracker()
    for u in sources.units("parquet", [(path, path.name)], "text"):
        for _ in sources.read_unit(u, "text", utf8):
            pass
    return time.perf_counter() - t0


def time_prepare(path: Path, tokenizer: str, workers: int, cache: Path) -> tuple[float, int]:
    shutil.rmtree(cache, ignore_errors=True)
    cfg = DataConfig(source="parquet", paths=(str(path),), tokenizer=tokenizer, cache_dir=str(cache),
                     prepare_workers=workers)
    t0 = time.perf_counter()
    p = prepare(cfg)
    return time.perf_counter() - t0, p.meta["train"]["tokens"] + p.meta["val"]["tokens"]


def run(mb: float, tokenizer: str, workers: list[int], rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path, docs = make_corpus(tmp, mb)
        if tokenizer == "bpe":
            spec = str(train_bpe(iter(docs[:4000]), 4096).save(tmp / "tok") / "tokenizer.json")
            tok = load_spec(spec)
        else:
            spec, tok = "byte", ByteTokenizer()
        time_encoder(tok, docs[:200])  # the encoder's thread pool starts outside the timings
        measure = {"encoder": lambda: time_encoder(tok, docs), "read": lambda: (time_read(path), None),
                   **{f"prepare_w{w}": (lambda w=w: time_prepare(path, spec, w, tmp / f"cache{w}")) for w in workers}}
        rows: dict[str, list] = {name: [] for name in measure}
        counts = set()
        for r in range(rounds):  # every other round in reverse order: drifting load favours no path
            for name in (list(measure) if r % 2 == 0 else list(measure)[::-1]):
                dt, n = measure[name]()
                rows[name].append(dt)
                counts |= {n} - {None}
    assert len(counts) == 1, counts  # every path makes the same tokens
    tokens = counts.pop()
    out = {"mb": mb, "docs": len(docs), "tokens": tokens,
           "tokenizer": tokenizer, "cpus": os.cpu_count(), "load": os.getloadavg()[0], "rounds": rounds, "rows": {}}
    for name, times in rows.items():
        ratio = statistics.median(rows["encoder"][i] / t for i, t in enumerate(times))
        out["rows"][name] = {"tokens_per_s": tokens / statistics.median(times), "vs_encoder": ratio}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=24, help="corpus size in MB of text")
    ap.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    ap.add_argument("--workers", default="0,2", help="data.prepare_workers values to time (0: in-process)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=json_path, help="write the results here")
    args = ap.parse_args(argv)
    res = run(args.mb, args.tokenizer, [int(w) for w in args.workers.split(",")], args.rounds)
    print(f"{res['docs']} documents, {res['tokens']:,} tokens ({args.tokenizer}), {res['cpus']} CPUs, "
          f"load {res['load']:.2f}")
    print(f"{'path':14s} {'tokens/s':>12s} {'vs encoder':>11s}")
    for name, r in res["rows"].items():
        print(f"{name:14s} {r['tokens_per_s']:>12,.0f} {r['vs_encoder']:>11.2f}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
