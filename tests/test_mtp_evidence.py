"""The plan's 'does MTP help the main model?' section: the committed ablation's numbers, or 'not yet measured'."""

import json
from pathlib import Path

from mtpjax.eval import evidence as mtp_evidence
from mtpjax.eval.evidence import PUBLISHED, evidence_lines
from mtpjax.cli.plan import main

ROOT = Path(__file__).resolve().parent.parent


def _summary(path: Path, trunk: int = 4_430_000, seeds: int = 2) -> Path:
    rows = [{"variant": "d1-seq-constant_0.3", "label": "D=1 sequential λ=constant:0.3",
             "delta_equal_tokens": {"mean": -0.0312, "std": 0.0041 if seeds > 1 else None, "n": seeds},
             "delta_equal_flops": {"mean": 0.0123, "std": None, "n": 1}}]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": {"trunk_params": trunk, "tokens": 2_048_000, "seeds": seeds,
                                            "tokenizer": "byte", "source": "stdlib", "rows": rows}}))
    return path


def test_without_a_committed_sweep_the_plan_says_not_yet_measured(tmp_path):
    lines = evidence_lines(3_000_000, tmp_path / "absent.json", tmp_path / "absent.json")
    assert lines[0] == "does MTP help the main model? this config has a 3.0M-parameter trunk"
    assert "not yet measured" in lines[1]
    assert lines[2:] == [f"  published: {p}" for p in PUBLISHED]
    (tmp_path / "broken.json").write_text("{")
    assert "not yet measured" in evidence_lines(1, tmp_path / "broken.json")[1]


def test_the_measured_differences_are_stated_next_to_the_published_ones(tmp_path):
    lines = evidence_lines(8_860_000, _summary(tmp_path / "results.json"), tmp_path / "absent.json")
    assert lines[0].endswith("8.9M-parameter trunk, 2x the one measured here (the measurement applies)")
    big = evidence_lines(1_000_000_000, tmp_path / "results.json", tmp_path / "absent.json")[0]
    assert big.endswith("226x the one measured here (far from it: see the published results)")
    assert "4.4M-parameter trunk, 2.05M tokens, byte tokens of the stdlib corpus, 2 seed(s)" in lines[1]
    assert "D=1 sequential λ=constant:0.3" in lines[2]
    assert "-0.031 ± 0.004 at equal tokens, +0.012 at equal training FLOPs" in lines[2]
    assert any("DeepSeek-V3" in line for line in lines) and any("Gloeckle" in line for line in lines)
    assert not any("seed spread, measured" in line for line in lines)


def test_the_seed_spread_measured_at_a_smaller_size_follows(tmp_path):
    main_sweep = _summary(tmp_path / "results.json", seeds=1)
    spread = _summary(tmp_path / "seeds" / "results.json", trunk=790_000, seeds=3)
    lines = evidence_lines(1, main_sweep, spread)
    at = next(i for i, line in enumerate(lines) if "seed spread" in line)
    assert "0.8M-parameter trunk" in lines[at] and "3 seed(s)" in lines[at]
    assert "-0.031 ± 0.004 at equal tokens" in lines[at + 1] and "-0.031 at equal tokens" in lines[at - 1]


def test_plan_cli_prints_the_section(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mtp_evidence, "RESULTS", _summary(tmp_path / "results.json"))
    monkeypatch.setattr(mtp_evidence, "SEEDS", tmp_path / "absent.json")
    assert main(["--config", str(ROOT / "configs" / "tiny.yaml"), "model.d_model=32", "model.n_layers=2"]) == 0
    out = capsys.readouterr().out
    assert "does MTP help the main model?" in out and "+0.012 at equal training FLOPs" in out


def test_the_committed_conclusion_follows_the_numbers(tmp_path, monkeypatch):
    path, none = _summary(tmp_path / "results.json"), tmp_path / "absent.json"
    monkeypatch.setattr(mtp_evidence, "CONCLUSION", None)
    assert not any("in short" in line for line in evidence_lines(1, path, none))
    monkeypatch.setattr(mtp_evidence, "CONCLUSION", "MTP helped at equal tokens, not at equal FLOPs.")
    assert "  in short: MTP helped at equal tokens, not at equal FLOPs." in evidence_lines(1, path, none)
    assert not any("in short" in line for line in evidence_lines(1, none, none))


def test_the_committed_sweep_is_what_plan_reads_by_default():
    """RESULTS names the file committed at the repository root's bench/ablation/, so `plan` prints its numbers."""
    assert mtp_evidence.RESULTS.is_file() and mtp_evidence.SEEDS.is_file()
    lines = evidence_lines(1_000_000)
    assert "the one measured here" in lines[0] and "not yet measured" not in "\n".join(lines)
