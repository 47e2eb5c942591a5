"""eval/bits_per_byte: per-token byte lengths from the tokenizer, and Σ CE / (ln 2 · Σ bytes) against brute force."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.eval.bpb import (
    bits_per_byte,
    eval_bits_per_byte,
    target_counts,
    token_byte_lengths,
)
from mtpjax.data import ByteTokenizer, HFTokenizer, segment_ids, train_bpe
from mtpjax.nn.loss import mtp_loss
from mtpjax.nn.model import build_model

WORDS = ["café", "naïve", "über", "für", "→", "déjà", "vu", "def", "return", "self", "x", "=", "1", "(", ")", ":",
         "\n", "    ", "import", "os", "print", "ŝ"]
RARE = "🙂 日本 ∀x"  # never in the BPE training text: stays split into byte tokens


def _docs(n: int, seed: int, rare: bool = False, words: tuple[int, int] = (20, 60)) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(*words)))) for _ in range(n)]
    return [d + (" " + RARE if rare and i % 3 == 0 else "") for i, d in enumerate(docs)]


@pytest.fixture(scope="module")
def bpe() -> HFTokenizer:
    return train_bpe(iter(_docs(300, 0)), vocab_size=400)


def _windows(tok, docs: list[str], batch: int, seq_len: int) -> list[dict]:
    """Batches cut from the EOS-joined stream like the data pipeline's windows."""
    stream = np.concatenate([np.asarray(tok.encode(d) + [tok.eos_id]) for d in docs]).astype(np.int32)
    n = len(stream) // (batch * seq_len)
    tokens_NBT = stream[: n * batch * seq_len].reshape(n, batch, seq_len)
    return [{"tokens": t, "segment_ids": segment_ids(t, tok.eos_id)} for t in tokens_NBT]


def _main_losses(vocab: int, batches: list[dict]) -> tuple[object, list[float]]:
    """A small random model and mtp_loss's loss/main on each batch."""
    from mtpjax.config import ModelConfig

    model = build_model(ModelConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                                    mtp_depth=1))
    losses = []
    for b in batches:
        tok, seg = jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"])
        losses.append(float(mtp_loss(model, model(tok, seg), tok, seg, step=0)[1]["loss/main"]))
    return model, losses


def test_byte_lengths_of_the_byte_tokenizer():
    lengths = token_byte_lengths(ByteTokenizer())
    assert lengths.shape == (256,) and lengths[0] == 0 and (lengths[1:] == 1).all()  # EOS (byte 0) is no text


@pytest.mark.slow
def test_byte_tokenizer_bits_per_byte_is_loss_over_ln2_up_to_eos():
    tok = ByteTokenizer()
    docs = _docs(12, 1, words=(5, 15))
    batches = _windows(tok, docs, batch=2, seq_len=64)[:2]
    _, losses = _main_losses(256, batches)
    no_eos = [{"tokens": b["tokens"], "segment_ids": np.ones_like(b["segment_ids"])} for b in batches]
    no_eos = [{**b, "tokens": np.where(b["tokens"] == 0, 32, b["tokens"])} for b in no_eos]
    _, losses_no_eos = _main_losses(256, no_eos[:1])
    assert eval_bits_per_byte(no_eos[:1], losses_no_eos, tok)["bits_per_byte"] == \
        pytest.approx(losses_no_eos[0] / math.log(2), rel=1e-12)  # every target one byte
    counts = [target_counts(b["tokens"], b["segment_ids"], token_byte_lengths(tok)) for b in batches]
    eos_targets = [n - nbytes for n, nbytes in counts]
    assert all(e > 0 for e in eos_targets)  # the windows do hold document ends
    nats = sum(loss * n for loss, (n, _) in zip(losses, counts))
    expect = nats / (math.log(2) * sum(n - e for (n, _), e in zip(counts, eos_targets)))
    assert eval_bits_per_byte(batches, losses, tok)["bits_per_byte"] == pytest.approx(expect, rel=1e-12)
    assert expect > np.average(losses, weights=[n for n, _ in counts]) / math.log(2)


def test_bpe_lengths_add_up_to_each_documents_utf8_size(bpe):
    lengths = token_byte_lengths(bpe)
    assert lengths.shape == (bpe.vocab_size,) and lengths[bpe.eos_id] == 0
    split_chars = 0
    for doc in _docs(40, 7, rare=True):
        ids = bpe.encode(doc)
        assert lengths[ids].sum() == len(doc.encode("utf-8"))
        split_chars += sum("\ufffd" in bpe.decode([i]) for i in ids)
    assert split_chars > 0  # some tokens are parts of a character: a per-token decode could not count them
    for i in range(bpe.vocab_size):
        text = bpe.decode([i])
        if "\ufffd" not in text and i != bpe.eos_id:
            assert lengths[i] == len(text.encode("utf-8")), (i, text)


def test_bpe_bits_per_byte_against_brute_force(bpe):
    batches = _windows(bpe, _docs(30, 3), batch=2, seq_len=48)[:3]
    model, losses = _main_losses(bpe.vocab_size, batches)
    nats = n_bytes = 0.0
    for b in batches:
        tok_BT, seg_BT = b["tokens"], b["segment_ids"]
        logits = np.asarray(model.logits(model(jnp.asarray(tok_BT), jnp.asarray(seg_BT)).hidden[0]), np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for r in range(tok_BT.shape[0]):
            for i in range(tok_BT.shape[1] - 1):
                if seg_BT[r, i] == seg_BT[r, i + 1]:
                    target = int(tok_BT[r, i + 1])
                    nats -= logp[r, i, target]
                    text = bpe.decode([target])  # EOS decodes to ""
                    assert "\ufffd" not in text
                    n_bytes += len(text.encode("utf-8"))
    got = eval_bits_per_byte(batches, losses, bpe)["bits_per_byte"]
    assert got == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)  # float32 loss vs float64 sum


def test_sentencepiece_style_tokenizer_json():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Llama-2 style: `▁` for spaces, `<0xNN>` pieces in the vocabulary for bytes of unknown characters
    chars = sorted(set("".join(_docs(50, 0)).replace(" ", "▁")) | {"▁"})
    vocab = {"</s>": 0, "<unk>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    vocab |= {c: len(vocab) + i for i, c in enumerate(chars)}
    merges = [("▁", "d"), ("▁d", "e"), ("▁de", "f")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    t.add_special_tokens(["</s>"])
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    tok = HFTokenizer(t)
    lengths = token_byte_lengths(tok)
    assert lengths[tok.eos_id] == 0 and lengths[vocab["<0xF0>"]] == 1 and lengths[vocab["▁def"]] == 4
    for doc in (d.lstrip() for d in _docs(20, 5, rare=True)):
        ids = tok.encode(doc)
        assert tok.decode(ids) == doc and (vocab["<0xF0>"] in ids) == (RARE in doc)  # 🙂 as 4 byte pieces
        # the Strip decoder drops the space Metaspace put before a document; a document's first token is
        # never an evaluated target (it follows EOS or opens the window), so that byte is never counted
        assert lengths[ids].sum() == len(doc.encode("utf-8")) + 1


def test_unknown_decoders_give_no_metric():
    from tokenizers import Tokenizer, decoders, models

    t = Tokenizer(models.WordLevel({"<|eos|>": 0, "a": 1}, unk_token="a"))
    t.decoder = decoders.WordPiece()
    tok = HFTokenizer(t)

    class Other:  # e.g. a sentencepiece .model: not handled, so no metric rather than a guess
        kind, vocab_size, eos_id = "sentencepiece", 8, 1

    assert token_byte_lengths(tok) is None and token_byte_lengths(Other()) is None
    batch = {"tokens": np.ones((1, 4), np.int32), "segment_ids": np.ones((1, 4), np.int32)}
    assert eval_bits_per_byte([batch], [1.0], tok) == {}
    assert eval_bits_per_byte([batch], [1.0], ByteTokenizer())["bits_per_byte"] == pytest.approx(1 / math.log(2))


def test_no_bytes_is_nan_not_an_error():
    assert math.isnan(bits_per_byte([2.0], np.array([[0, 0]])))
    assert jax.process_count() == 1
