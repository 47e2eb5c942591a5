"""The benchmark suite: the entry point end to end in smoke mode, the table of targets, the draft-count cost model."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.__main__ import targets
from bench.peer import available

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_suite_smoke_writes_every_key(tmp_path):
    out = tmp_path / "results.json"
    none = str(tmp_path / "no-run")  # random smoke models, whatever runs/ of this checkout holds
    r = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(out), "--run-dir", none,
                        "--draft-run-dir", none], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res) >= {"smoke", "train", "decode", "targets", "plots", "command", "cache_cliff"}
    assert [r["n_layers"] for r in res["cache_cliff"]["rows"]] == [1, 2]
    for name in ("tiny", "cpu_medium"):
        t = res["train"][name]
        assert t["peak_flops"] > 0 and t["peak_rss_mb"] > 0 and len(t["load"]) == 3
        for d, row in t["depths"].items():
            assert 0 < row["mfu"] < 1.5, (name, d)
            if d != "0":
                assert row["flop_ratio"] > 1 and row["step_time_ratio"] > 0
    assert set(res["train"]["tiny"]["depths"]) == {"0", "2"}
    for b in res["decode"]["batches"]:
        v = b["variants"]
        assert {"plain", "mtp1", "mtp2", "ngram2", "auto"} <= set(v)
        # greedy speculation reproduces plain greedy token for token
        assert all(v[k]["identical_to_plain"] for k in ("mtp1", "mtp2", "ngram2"))
        assert len(v["mtp2"]["acceptance_by_position"]) == 2
        # issue 30's rows: chains past the depth, trees and hybrids, each as plain, with v, c and a ceiling
        spec = ("mtp1_3", "tree2", "tree2x1", "tree2x2", "tree1x1+ngram2", "tree2x1+ngram2")
        assert all(v[k]["identical_to_plain"] for k in spec)
        assert [v[k]["rows"] for k in spec] == [4, 3, 5, 7, 5, 7] and v["tree2x2"]["acceptance_by_depth_rank"]
        assert sorted(map(int, b["verify"]["v"])) == list(range(1, 8)) and b["verify"]["v"]["1"] == 1.0
        for k in (*spec, "mtp1", "ngram2", "model2"):
            assert v[k]["verify_cost_v"] == b["verify"]["v"][str(v[k]["rows"])] and v[k]["ceiling"] > 0
            assert v[k]["of_ceiling"] == pytest.approx(v[k]["vs_plain"] / v[k]["ceiling"])
        assert v["ngram2"]["draft_cost_c"] is None and v["ngram2"]["draft_floor"] == 0
        assert v["mtp2"]["predicted_speedup"] > 0 and v["auto"]["num_draft"] in (0, 1, 2)
        # the draft model (a random one in smoke mode) beside MTP and n-gram, with its acceptance and ceiling
        assert all(v[f"model{g}"]["identical_to_plain"] for g in (1, 2, 3))
        assert len(v["model3"]["acceptance_by_position"]) == 3 and v["model3"]["predicted_speedup"] > 0
        assert 0 < b["draft_ceiling"]["ceiling_r"] < b["ceiling"]["ceiling_r"] and b["draft_ceiling"]["max"] >= 1
    assert [r["proposer"] for r in res["proposers"]] == ["MTP modules", "n-gram", "draft model"]
    assert set(res["proposers"][2]["by_batch"]) == {"1", "2"} and "draft model" in r.stdout  # JSON keys
    reason = available()
    if reason:  # the peer part is the only thing skipped without torch, and it says why
        assert res["decode"]["peer_skipped"] == reason and reason in r.stdout
    else:
        assert res["decode"]["peer"]["max_logit_diff"] < 1e-4  # the peer computes our trunk's function
        assert "peer_greedy" in res["decode"]["batches"][0]["variants"]
    assert [Path(p).name for p in res["plots"]] == ["acceptance_by_position.png", "speedup_vs_num_draft.png",
                                                     "train_vs_depth.png"]
    assert all(Path(p).stat().st_size > 1000 for p in res["plots"])
    train_peer = [t for t in res["targets"] if t["target"].startswith("train tokens/s / transformers eager")]
    assert len(train_peer) == (0 if reason else 2)  # issue 29: ours vs eager at both shapes (no compile in smoke)
    assert len(res["targets"]) == 8 + len(train_peer)
    ceil = res["decode"]["batches"][0]["ceiling"]
    assert 0 < ceil["ceiling_r"] < 1 and ceil["max"] >= 1 and ceil["perfect_drafter"] > 1
    peer_row = [t for t in res["targets"] if "transformers" in t["target"]][0]
    assert (peer_row["value"] is None) == bool(reason)


def _res(mfu_tiny, mfu_med, peer_ratio):
    dec = {"batches": [{"batch": 1, "variants": {
        "plain": {"vs_plain": 1.0}, "mtp1": {"vs_plain": 1.5, "measured_over_predicted": 0.95},
        "peer_greedy": {"vs_plain": peer_ratio}}},
        {"batch": 32, "variants": {"plain": {"vs_plain": 1.0}, "auto": {"num_draft": 0, "vs_plain": 1.0}}}]}
    tiny = {"0": {"mfu": 0.3}, "2": {"mfu": mfu_tiny, "overhead_vs_flop_share": 1.05}}
    return {"train": {"tiny": {"depths": tiny}, "cpu_medium": {"depths": {"1": {"mfu": mfu_med}}}}, "decode": dec}


def test_targets_table_reports_met_and_unmet():
    t = targets(_res(0.45, 0.4, 0.25))
    assert [r["met"] for r in t if "MFU" in r["target"]] == [True, False]
    assert [r for r in t if "transformers" in r["target"]][0]["value"] == pytest.approx(4.0)
    assert [r for r in t if "MTP speculative" in r["target"]][0]["met"] is False  # 1.5 < 2
    assert [r for r in t if "auto" in r["target"]][0]["met"] is True
    assert [r for r in t if "overhead" in r["target"]][0]["met"] is True
    assert not [r for r in t if "ceiling" in r["target"]]  # only when the decode bench measured one
    res = _res(0.45, 0.4, 0.25)
    res["decode"]["batches"][0]["ceiling"] = {"ceiling_r": 0.31, "max": 1.59}
    row = [r for r in targets(res) if "ceiling" in r["target"]][0]
    assert row["value"] == 1.59 and row["met"] is False and "r = 0.31, batch 1" in row["target"]
    res["decode"]["batches"][0]["ceiling"]["max"] = 2.3
    assert [r for r in targets(res) if "ceiling" in r["target"]][0]["met"] is True


def test_large_model_row_reports_batch_1_mtp_speed():
    res = _res(0.45, 0.6, 0.25)
    assert not [r for r in targets(res) if "MB model" in r["target"]]  # only with --large-run-dir
    res["decode_large"] = {"weights_mb": 99.2, "batches": [{"batch": 1, "variants": {
        "plain": {"vs_plain": 1.0}, "mtp1": {"vs_plain": 1.17}, "mtp2": {"vs_plain": 1.23},
        "ngram2": {"vs_plain": 1.9}}}]}
    row = [r for r in targets(res) if "MB model" in r["target"]][0]
    assert row["target"].startswith("MTP speculative (mtp2)") and "99 MB" in row["target"]
    assert row["value"] == pytest.approx(1.23) and row["met"] is True
    res["decode_large"]["batches"][0]["variants"]["mtp2"]["vs_plain"] = 0.9
    res["decode_large"]["batches"][0]["variants"]["mtp1"]["vs_plain"] = 0.8
    assert [r for r in targets(res) if "MB model" in r["target"]][0]["met"] is False
    res["decode_large"]["batches"][0]["ceiling"] = {"ceiling_r": 0.2, "max": 1.74}
    row = [r for r in targets(res) if "ceiling" in r["target"]][0]
    assert "99 MB" in row["target"] and row["met"] is False


def test_suite_decodes_the_large_run_at_batch_1_only(monkeypatch, tmp_path):
    import bench.__main__ as suite

    calls = []
    monkeypatch.setattr(suite, "_child", lambda module, args, tmp, name: calls.append((name, module, args)) or {})
    assert "decode_large" not in suite.run_suite(False, 3, "runs/tiny", True, tmp_path)
    calls.clear()
    res = suite.run_suite(False, 3, "runs/tiny", True, tmp_path, large_run_dir="runs/big")
    name, module, args = calls[-1]
    assert "decode_large" in res and name == "decode_large" and module == "bench.decode_bench"
    assert args[args.index("--run-dir") + 1] == "runs/big" and args[args.index("--batches") + 1] == "1"
    assert "--no-peer" in args and "--smoke" not in args


@pytest.mark.slow
def test_mtp_drafting_variants_decode_exactly():
    """bench.mtp_drafting's bookkeeping: every variant (old window, γ+1 window, module 1 only) is exact."""
    from bench.decode_bench import load_subject
    from bench.mtp_drafting import bench_batch

    model, prompts, _ = load_subject(None, True, 2, 16)
    r = bench_batch(model, prompts, 1, max_new=8, rounds=1, gammas=[1, 2])
    assert set(r["variants"]) == {"plain", "mtp1_old_window", "mtp1", "mtp2_old_window", "mtp2", "mtp2_module1"}
    assert all(v["identical_to_plain"] for v in r["variants"].values())
    mtp2 = r["variants"]["mtp2"]
    assert mtp2["vs_old_window"] > 0 and mtp2["vs_old_window_cpu"] > 0
    assert len(r["variants"]["mtp2_module1"]["acceptance_by_position"]) == 2


def test_verify_costs_are_medians_of_per_round_ratios_to_one_row():
    """bench/cache_cliff.py --rows: v(n) = median_i t_n[i] / t_1[i] (within a round); c(γ) per draft alike."""
    from bench.cache_cliff import verify_costs

    ones = [1.0, 2.0, 4.0]  # the load triples the step in the last round: per-round ratios cancel it
    res = verify_costs({1: ones, 4: [1.2, 2.6, 4.8]}, {2: [0.2, 0.4, 1.6]})
    assert res["v"] == {1: 1.0, 4: pytest.approx(1.2)}  # ratios 1.2, 1.3, 1.2
    assert res["c"] == {2: pytest.approx(0.1)}  # ratios 0.2, 0.2, 0.4 over 2 drafts
    # companion: a ratio of medians would read the drift as cost (median 2.6 / median 2.0 = 1.3)
    assert res["v"][4] != pytest.approx(1.3)


TOY_STEP = ["model.d_model=32", "model.n_layers=1", "data.seq_len=32", "train.batch_size=2"]


@pytest.mark.slow
def test_profile_step_splits_each_op_by_cores(capsys):
    """bench.profile_step --cores-split traces one compiled step on every core, then pinned to one, and gives each op
    and part both times; the process's cores are its own again afterwards."""
    import os

    from bench import profile_step

    cpus = os.sched_getaffinity(0)
    assert profile_step.main(["--cores-split", "--steps", "1", "--top", "3", *TOY_STEP]) == 0
    out = capsys.readouterr().out
    assert "pinned to one core" in out and "| op | ms/step, " in out
    parts = [ln for ln in out.splitlines() if ln.startswith(("| rest ", "| attention ", "| vocab/loss "))]
    assert any(ln.startswith("| rest dot |") for ln in parts) and any("attention" in ln for ln in parts)
    assert os.sched_getaffinity(0) == cpus


@pytest.mark.slow
def test_step_ab_variants_train_the_same_step():
    """bench.step_ab's variants compute the same train step (compiler options, gate and up fused): equal losses and
    gradient norms, so its ratios compare speed alone."""
    from bench import step_ab
    from mtpjax.config import load_config

    cfg = load_config("configs/tiny.yaml", TOY_STEP)
    seen = {name: step_ab.stepper(cfg, name)() for name in ("default", "no_ynn", "fused_gate_up")}  # the 3rd step
    for name in ("no_ynn", "fused_gate_up"):
        for k in ("loss/main", "grad_norm"):
            np.testing.assert_allclose(float(seen[name][k]), float(seen["default"][k]), rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_decode_mesh_bench_smoke_forces_the_acceptance_it_is_given(tmp_path):
    """bench/decode_mesh.py end to end on a small model with two MTP modules: its forced loop (AtRate) accepts the
    first draft always and the second never, whatever the random weights say, so the acceptance it measures is exactly
    (1, 0) on one device and on tensor=2; plain decoding on tensor=2 reproduces one device's tokens."""
    out = tmp_path / "dm.json"
    r = subprocess.run([sys.executable, "-m", "bench.decode_mesh", "--config", "configs/tiny.yaml", "--batches", "1,2",
                        "--max-new", "6", "--prompt-len", "4", "--rounds", "1", "--alpha", "1.0,0.0", "--json",
                        str(out), "model.mtp_depth=2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert [b["batch"] for b in res] == [1, 2] and "| batch |" in r.stdout
    for b in res:
        assert b["measured_alpha"]["mtp2_tensor2"] == [1.0, 0.0] and b["measured_alpha"]["mtp1_tensor2"] == [1.0]
        assert b["plain_identical"] and b["forced_identical"]
        assert set(b["vs_plain_same_mesh"]["tensor2"]) == {"plain_tensor2", "mtp1_tensor2", "mtp2_tensor2"}
        assert b["auto"]["tensor2"]["choice"] in (0, 1, 2) and b["tensor2_vs_one"] > 0


def test_every_benchmark_checks_its_json_path_before_it_runs(tmp_path, capsys):
    """A benchmark's --json is checked as it is parsed (a lent accelerator's minutes were lost to a path the report
    could not be written to at the end), and written with its missing folders made."""
    import argparse
    import re

    from bench import checksum_cost
    from bench.common import json_path

    flags = [(p.name, m[0]) for p in sorted((ROOT / "bench").glob("*.py"))
             for m in re.finditer(r'add_argument\("--json"[^)]*\)', p.read_text())]
    assert len(flags) >= 15 and [f for f in flags if "type=json_path" not in f[1]] == []
    (tmp_path / "file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file; give another path"):
        json_path(str(tmp_path / "file" / "r.json"))
    with pytest.raises(SystemExit) as e:
        checksum_cost.main(["--json", str(tmp_path / "file" / "r.json")])
    assert e.value.code == 2 and "/file' is a file; give another path" in capsys.readouterr().err
    assert json_path(str(tmp_path / "new" / "r.json")) == str(tmp_path / "new" / "r.json")
