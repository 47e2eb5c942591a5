"""The export's tokenizer as `AutoTokenizer` loads the exported directory (config.json's model type included): the
run's ids on 1,000 corpus lines for the byte, a trained BPE and an imported tokenizer, Qwen2 and DeepSeek-V3 layouts.

transformers 5 picks the tokenizer class from the model type for qwen2 whatever tokenizer_config.json names, and
rebuilds Qwen2's pre-tokenizer; the export's auto_map is what keeps the run's tokenizer.json (hf_tokenizer.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_convert import BASE, cli, make_run
from test_convert_deepseek import DS
from train_helpers import write_corpus
from transformers import AutoTokenizer

from mtpjax.convert.hf_tokenizer import MODULE_FILE
from mtpjax.data import ByteTokenizer, HFTokenizer, train_bpe

# Slow tier: exporting six runs and loading them with transformers costs the default tier ~10 s of CPU, and issue 50
# adds nothing net to that tier; CI runs these.
pytestmark = pytest.mark.slow

LAYOUTS = {"qwen2": BASE, "deepseek_v3": DS}


def _imported(texts: list[str]) -> HFTokenizer:
    """A tokenizer.json as a checkpoint might bring it: NFKC, whitespace-isolating split, byte-level BPE, and Llama
    3's post-processor adding a BOS (which mtpjax's encoding, without special tokens, does not)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", BOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])])
    assert tok.encode("x").ids[0] == tok.token_to_id(BOS)  # engines' add_special_tokens=True: a BOS first
    return HFTokenizer(tok, "imported")


BOS = "<|begin_of_text|>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], dict]:
    """1,000 non-empty standard-library lines and the three tokenizers (the BPEs trained on the same sources)."""
    text = write_corpus(tmp_path_factory.mktemp("corpus")).read_text()
    lines = [s for s in text.splitlines() if s.strip()][:1000]
    assert len(lines) == 1000
    docs = text.split("\n\n")
    return lines, {"byte": ByteTokenizer(), "bpe": train_bpe(iter(docs), 400), "imported": _imported(docs)}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, corpus) -> dict:
    """(layout, tokenizer kind) -> the exported directory of a run whose tokenizer is that kind."""
    tmp, out = tmp_path_factory.mktemp("exports"), {}
    for fmt, base in LAYOUTS.items():
        run = make_run(tmp, fmt, *base, "model.vocab_size=512")
        for kind, tok in corpus[1].items():
            tok.save(run / "tokenizer")
            assert cli("export", "--run-dir", run, "--out", tmp / f"{fmt}-{kind}", "--format", fmt) == 0
            out[fmt, kind] = tmp / f"{fmt}-{kind}"
    return out


def _mismatches(directory: Path, lines: list[str], tok, **kw) -> int:
    hf = AutoTokenizer.from_pretrained(str(directory), **kw)
    assert hf.eos_token_id == tok.eos_id
    return sum(a != tok.encode(s) for a, s in zip(hf(lines)["input_ids"], lines, strict=True))


@pytest.mark.parametrize("fmt", LAYOUTS)
@pytest.mark.parametrize("kind", ["byte", "bpe", "imported"])
def test_auto_tokenizer_on_the_export_gives_the_run_s_ids(exports, corpus, fmt, kind):
    lines, toks = corpus
    assert json.loads((exports[fmt, kind] / "config.json").read_text())["model_type"] == fmt
    assert _mismatches(exports[fmt, kind], lines, toks[kind]) == 0


def test_with_trust_remote_code_the_shipped_class_gives_the_same_ids(exports, corpus):
    lines, toks = corpus
    assert _mismatches(exports["qwen2", "bpe"], lines, toks["bpe"], trust_remote_code=True) == 0


def test_the_export_drops_only_the_post_processor_that_adds_tokens(exports):
    """The imported tokenizer's BOS template is gone from the export, its ByteLevel post-processor kept; companion:
    with the template put back, AutoTokenizer's ids start with a BOS the run never saw."""
    spec = json.loads((exports["qwen2", "imported"] / "tokenizer.json").read_text())
    assert [p["type"] for p in spec["post_processor"]["processors"]] == ["ByteLevel"]


def test_companion_a_bos_template_in_the_export_adds_an_id(tmp_path, exports, corpus):
    import shutil

    from tokenizers import processors

    d = tmp_path / "bos"
    shutil.copytree(exports["qwen2", "imported"], d)
    spec = json.loads((d / "tokenizer.json").read_text())
    bos = corpus[1]["imported"]._tok.token_to_id(BOS)
    template = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    spec["post_processor"]["processors"].append(json.loads(template.__getstate__()))
    (d / "tokenizer.json").write_text(json.dumps(spec))
    assert _mismatches(d, corpus[0], corpus[1]["imported"]) == 1000


@pytest.mark.parametrize("kind", ["bpe", "imported"])
def test_companion_the_old_tokenizer_files_split_otherwise_in_qwen2(tmp_path, exports, corpus, kind):
    """Companion: without auto_map and its module (the export before issue 50) transformers 5 loads Qwen2Tokenizer,
    whose pre-tokenizer splits some lines otherwise."""
    import shutil

    d = tmp_path / "old"
    shutil.copytree(exports["qwen2", kind], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["auto_map"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / MODULE_FILE).unlink()
    assert type(AutoTokenizer.from_pretrained(str(d))).__name__ == "Qwen2Tokenizer"
    assert _mismatches(d, corpus[0], corpus[1][kind]) > 0
