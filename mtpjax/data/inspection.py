"""`python -m mtpjax.data inspect`: per source, its documents, tokens and sample training windows, decoded."""

from __future__ import annotations

import numpy as np

from mtpjax.data.pipeline import make_iterator, segment_ids

_SCAN_BATCHES = 1000  # batches of the stream planned (not read) to find windows of a rare source
_DOC_SCAN = 1 << 20  # tokens searched for the first documents


def _show(text: str, width: int) -> str:
    r = repr(text)
    return r if len(r) <= width else r[:width - 3] + "..."


def _documents(tokens, tok, n: int, width: int) -> list[str]:
    head = np.asarray(tokens[:_DOC_SCAN])
    ends = np.flatnonzero(head == tok.eos_id)[:n]
    out, start = [], 0
    for i, end in enumerate(ends):
        out.append(f"    doc {i + 1} ({end - start} tokens + EOS): {_show(tok.decode(head[start:end]), width)}")
        start = end + 1
    return out


def _window(tokens, w: int, seq_len: int, tok, width: int) -> list[str]:
    toks = np.asarray(tokens[w * seq_len:(w + 1) * seq_len], np.int32)
    seg = segment_ids(toks[None], tok.eos_id)[0]
    out = []
    for s in np.unique(seg):
        part = toks[seg == s]
        eos = " + EOS" if part[-1] == tok.eos_id else ""
        n = len(part) - (1 if eos else 0)
        out.append(f"      segment {s}: {n} tokens{eos}: {_show(tok.decode(part), width)}")
    return out


def report(cfg, prepared, *, docs: int = 3, windows: int = 2, width: int = 120) -> str:
    """The inspection text of a config's corpus, `prepared` (its PreparedData or PreparedMixture)."""
    tok, T, B = prepared.tokenizer, cfg.data.seq_len, cfg.train.batch_size
    it = make_iterator(prepared, split="train", seq_len=T, batch_size=B, seed=cfg.train.seed,
                       shuffle=cfg.data.shuffle)
    srcs = prepared.sources()
    picked: dict[int, list] = {k: [] for k in range(len(srcs))}
    taken = np.zeros(len(srcs), np.int64)
    first = None
    for s in range(_SCAN_BATCHES):  # the stream's own choices: what the model is fed, in order
        src, j = it.plan(s, taken)
        first = src if first is None else first
        for r, (k, i) in enumerate(zip(src, j)):
            if len(picked[k]) < windows:
                picked[k].append((s, r, it.window(k, i)))
        if all(len(v) == windows for v in picked.values()):
            break
    lines = [f"tokenizer {tok!r}; seq_len {T}, batch {B}, seed {cfg.train.seed}"]
    if len(srcs) > 1:
        lines.append("first batch: " + ", ".join(f"{n} {int((first == k).sum())} rows"
                                                 for k, (n, _, _) in enumerate(srcs)))
    for k, (name, weight, part) in enumerate(srcs):
        m = part.meta
        title = f"source '{name}' (weight {weight:.3f})" if name else "corpus"
        lines.append(f"{title}: {m['source']} in {part.dir}")
        for split in ("train", "val"):
            d = m[split]["docs"]
            lines.append(f"  {split}: {'' if d is None else f'{d} documents, '}{m[split]['tokens']} tokens, "
                         f"{m[split]['tokens'] // T} windows")
        lines.append(f"  first {docs} train documents:")
        lines += _documents(part.train_tokens, tok, docs, width)
        lines.append("  sample training windows (segment ids decoded; EOS ends a document):")
        for s, r, w in picked[k]:
            lines.append(f"    batch {s} row {r}: window {w}")
            lines += _window(part.train_tokens, w, T, tok, width)
    return "\n".join(lines)
