"""`python -m mtpjax plan`: numbers against the real built model, speculation formulas, CLI exit codes."""

import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

from mtpjax.config import load_config
from mtpjax.nn.flops import flops_per_token
from mtpjax.nn.model import build_model, param_counts
from mtpjax.cli.plan import main
from mtpjax.eval.plan import build_plan
from mtpjax.drafts import chain
from mtpjax.nn.speed import ceiling, expected_tokens

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL_OVERRIDES = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=64",
                   "model.mtp_depth=2", "model.tie_embeddings=false", "data.seq_len=32"]


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_plan_matches_real_model(dtype, itemsize):
    cfg = load_config(TINY, SMALL_OVERRIDES + [f"model.param_dtype={dtype}"])
    plan = build_plan(cfg)
    model = build_model(cfg)  # real arrays this time
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert plan["params"] == param_counts(model)
    assert plan["params"]["total"] == sum(x.size for x in params)
    assert plan["param_bytes"] == sum(x.nbytes for x in params) == itemsize * plan["params"]["total"]
    o = cfg.optim
    state = optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay).init(params)
    assert plan["optimizer_bytes"] == sum(x.nbytes for x in jax.tree.leaves(state))
    assert plan["optimizer_bytes"] == 2 * plan["param_bytes"] + 4  # mu, nu in param dtype + int32 count
    assert plan["flops"] == flops_per_token(cfg.model, cfg.data.seq_len)


def test_speculation_formulas():
    assert expected_tokens(chain(1), [[0.8]]) == pytest.approx(1.8)
    assert expected_tokens(chain(2), [[0.8]]) == pytest.approx(1 + 0.8 + 0.64)
    assert expected_tokens(chain(3), [[0.5]]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(chain(4), [[1.0]]) == 5.0 and expected_tokens(chain(4), [[0.0]]) == 1.0
    assert ceiling(chain(2), [[0.8]], 0.1) == pytest.approx(2.44 / 1.2)
    assert ceiling(chain(3), [[0.8]], 0.0) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_default_draft_cost_counts_the_rows_mtp_drafting_computes():
    cfg = load_config(TINY, SMALL_OVERRIDES)
    plan = build_plan(cfg, alpha=0.7)
    f = plan["flops"]
    assert plan["draft_cost"] is None
    assert [s["gamma"] for s in plan["speculation"]] == [1, 2, 3, 4]  # D=2, and a bit beyond
    # one draft recomputes module 1's window of 2 rows and applies the head once; it reads the module once
    one = plan["speculation"][0]
    assert one["work_ratio"] == pytest.approx((2 * f["mtp_module"] + f["head"]) / (f["trunk"] + f["head"]))
    assert one["weight_ratio"] == pytest.approx((f["mtp_module_matmul"] + f["head"]) / (f["trunk_matmul"] + f["head"]))
    reads = (f["mtp_module_matmul"] + f["head"]) / (f["trunk_matmul"] + f["head"])  # one module per draft call
    for s in plan["speculation"]:
        g, D = s["gamma"], 2
        # modules 1..min(γ, D) each recompute γ+1 rows, then module D is reused for the drafts beyond D
        rows = min(g, D) * (g + 1) + max(g - D, 0)
        work = (rows * f["mtp_module"] + g * f["head"]) / (g * (f["trunk"] + f["head"]))
        assert (s["work_ratio"], s["weight_ratio"]) == pytest.approx((work, reads))
        e = sum(0.7 ** i for i in range(g + 1))  # E(γ) = 1 + α + ... + α^γ
        assert s["speedup"] == pytest.approx(e / (1 + g * min(work, reads)))
    assert build_plan(cfg, draft_cost=0.5, max_gamma=6)["speculation"][-1]["speedup"] == \
        pytest.approx(sum(0.8 ** i for i in range(7)) / 4.0)
    assert build_plan(load_config(TINY, ["model.mtp_depth=0"]))["speculation"] == []


def test_ceiling_divides_by_the_verification_cost_of_the_rows_verified():
    cfg = load_config(TINY, SMALL_OVERRIDES)
    free, paid = (build_plan(cfg, alpha=0.7, verify_cost=v)["speculation"] for v in (1.0, {2: 1.2, 3: 1.3}))
    for f, p in zip(free, paid):
        g, r = f["gamma"], f["floor_ratio"]
        v = 1.2 if g == 1 else 1.3  # γ+1 rows: 2 measured, 3 measured, more: the largest measured
        assert p["verify_cost"] == v and f["verify_cost"] == 1.0
        assert p["speedup"] == pytest.approx(f["tokens_per_round"] / (v + g * r))
        assert f["speedup"] == pytest.approx(f["tokens_per_round"] / (1 + g * r))  # companion: free rows


def test_plan_tabulates_auto_s_trees_and_the_configured_one():
    """Each tree's E sums, over its nodes, the product along the path of rank 1's α or rank 2's β; its ceiling
    divides by v(nodes + 1) and one module call per depth."""
    cfg = load_config(TINY, SMALL_OVERRIDES + ["decode.draft=3x1+ngram2"])
    plan = build_plan(cfg, alpha=0.7, verify_cost={3: 1.2, 5: 1.5, 7: 1.9}, alpha_rank2=0.2)
    rows = {t["tree"]: t for t in plan["trees"]}
    assert list(rows) == ["2x1", "2x2", "3x1"]  # auto's at depth 2, then decode.draft's (its n-gram branch is free)
    r = plan["speculation"][0]["floor_ratio"]
    e = {"2x1": 1 + 0.7 + 0.2 + 0.7 * 0.7 + 0.2 * 0.7,
         "2x2": 1 + 0.7 + 0.2 + (0.7 + 0.2) * (0.7 + 0.2),
         "3x1": 1 + 0.7 + 0.2 + 0.1 + (0.7 + 0.2 + 0.1) * 0.7}
    v = {"2x1": 1.5, "2x2": 1.9, "3x1": 1.9}  # 5, 7 and 7 rows
    for shape, t in rows.items():
        assert t["tokens_per_round"] == pytest.approx(e[shape]) and t["verify_cost"] == v[shape]
        assert t["speedup"] == pytest.approx(e[shape] / (v[shape] + 2 * r))
    default = build_plan(cfg, alpha=0.7)
    assert default["alpha_rank2"] == pytest.approx(0.15)  # half of rank 1's misses
    depth1 = build_plan(load_config(TINY, SMALL_OVERRIDES + ["model.mtp_depth=1"]))
    assert depth1["trees"][0]["tree"] == "-1,-1"  # two children of the root, spelled so since `2` is the chain of 2
    assert build_plan(load_config(TINY, ["model.mtp_depth=0"]))["trees"] == []


def test_cpu_deep_is_memory_bound_with_cheap_modules():
    """configs/cpu_deep.yaml as its comment states: weights >= 3x a 32 MB cache, one module r <= 0.1 of a step."""
    plan = build_plan(load_config(str(ROOT / "configs" / "cpu_deep.yaml"), []))
    assert plan["param_bytes"] >= 96e6 and plan["params"]["total"] < 32e6
    assert all(s["floor_ratio"] <= 0.1 for s in plan["speculation"])


def test_cli_prints_plan(capsys):
    assert main(["--config", TINY, *SMALL_OVERRIDES, "--alpha", "0.5", "--draft-cost", "0.25"]) == 0
    out = capsys.readouterr().out
    counts = build_plan(load_config(TINY, SMALL_OVERRIDES))["params"]
    assert f"{counts['trunk']:,d}" in out and f"{counts['mtp'][1]:,d}" in out
    assert "mtp module 2" in out and "alpha=0.5" in out and "c=0.2500" in out
    assert "1.8750" in out and "1.0714" in out  # E(3) = 1 + 0.5 + 0.25 + 0.125, over 1 + 3 * 0.25
    assert "optimizer" in out and "GiB" in out
    assert main(["--config", TINY, *SMALL_OVERRIDES, "--alpha", "0.5", "--draft-cost", "0.25",
                 "--verify-cost", "2:1.25,4:1.5"]) == 0
    out = capsys.readouterr().out  # E(γ) over v(γ+1) + γ·0.25, v(3) read as the next measured, v(4)
    assert "1.0000" in out and "0.8750" in out and "0.8333" in out and "v(g+1)" in out
    assert "draft trees" in out and "2x2     6" in out  # auto's trees at depth 2, each with its ceiling


@pytest.mark.parametrize("argv, message", [
    (["--config", "no/such.yaml"], "config file 'no/such.yaml' does not exist"),
    (["--config", TINY, "model.mtp_dpeth=2"], "did you mean 'model.mtp_depth'"),
    (["--config", TINY, "model.d_model"], "not of the form section.key=value"),
    (["--config", TINY, "--alpha", "1.5"], "--alpha 1.5 must be in [0, 1]"),
    (["--config", TINY, "--alpha", "high"], "invalid float value"),
    (["--config", TINY, "--draft-cost", "-1"], "--draft-cost -1.0 must be a finite number >= 0"),
    (["--config", TINY, "--draft-cost", "nan"], "--draft-cost nan must be a finite number >= 0"),
    (["--config", TINY, "--alpha", "0.8", "--alpha-rank2", "0.3"], "--alpha-rank2 0.3 must be in [0, 1 - alpha]"),
    (["--config", TINY, "--max-gamma", "0"], "--max-gamma 0 must be >= 1"),
    (["--config", TINY, "--verify-cost", "0.5"], "--verify-cost '0.5' must be a number >= 1"),
    (["--config", TINY, "--verify-cost", "2:x"], "--verify-cost '2:x' must be a number >= 1"),
    ([], "required: --config"),
])
def test_cli_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: ")


def test_cli_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--draft-cost" in capsys.readouterr().out


def test_module_runs_as_script(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "mtpjax", "plan", "--config", TINY, "model.mtp_depth=3"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "mtp module 3" in ok.stdout and "speedup" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1,\n")
    err = subprocess.run([sys.executable, "-m", "mtpjax", "plan", "--config", str(bad)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert err.returncode == 2 and "Traceback" not in err.stderr
    assert err.stderr.strip().splitlines() == [f"error: config file '{bad}' is not valid YAML (line 2); fix its syntax"]
