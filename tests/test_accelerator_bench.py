"""bench/accelerator.py: its --smoke run (the same code a lent GPU runs) and the table of published chip peaks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.accelerator import published_peak

ROOT = Path(__file__).resolve().parent.parent
# What the lent machine lacks (it has jax, flax, optax, numpy, yaml): the script must run without any of it.
ABSENT = ("grain", "orbax", "orbax.checkpoint", "tensorboardX", "tokenizers", "torch", "transformers", "tqdm")


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12), ("cpu", None),
])
def test_published_peaks(kind, peak):
    assert published_peak(kind) == peak


@pytest.mark.slow
def test_smoke_runs_the_whole_check_without_what_the_device_lacks(tmp_path):
    out = tmp_path / "acc.json"
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({ABSENT!r})); "
            f"sys.argv = ['accelerator.py', '--smoke', '--json', {str(out)!r}]; "
            "runpy.run_path('bench/accelerator.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["smoke"] and res["device"]["platform"] == "cpu" and "measured" in res["device"]["peak_source"]
    (train,) = res["train"]
    assert train["attention"] == "xla" and train["tokens_per_sec"] > 0 and 0 < train["mfu"] < 1.5
    assert train["memory_bytes"] > 0
    rows = res["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["plain_tokens_per_sec"] > 0 and r["mtp_tokens_per_sec"] > 0 and r["v"] > 0 and r["c"] >= 0
        assert r["same_tokens_as_plain"]
    assert res["decode"]["alpha"] == [0.98, 0.5] and res["decode"]["ceiling"] > 0
    assert res["equality"]["identical"] == {"1": True, "2": True}
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("|")]  # one table: header, train, decode, equality
    assert table[:2] == ["| measure | setting | result |", "|---|---|---|"] and len(table) == 2 + 1 + 2 + 1
    assert "(passed in, CPU-trained run)" in table[3] and "1 draft: identical, 2 drafts: identical" in table[-1]


def test_the_compiled_estimate_sits_beside_the_measured_rows():
    from bench.accelerator import estimate_rows, table

    report = {"target": "h100:1", "chip": {"name": "NVIDIA H100 SXM"}, "mesh": {"data": 1, "fsdp": 1},
              "programs": [{"program": "train_step", "roofline": {"estimate_s": 1.5, "bound": "compute"},
                            "mfu_estimate": 0.61, "memory": {"total": 40 * 2**30}},
                           {"program": "decode_plain", "roofline": {"estimate_s": 0.1, "bound": "hbm"},
                            "memory": {"total": 2**30}}]}
    res = {"device": {"peak": 989e12, "peak_source": "published dense bf16"}, "train_config": {},
           "estimate": estimate_rows(report)}
    rows = [r for r in table(res).splitlines() if "compiled estimate" in r]
    assert rows == ["| train_step, compiled estimate | h100:1 (NVIDIA H100 SXM), mesh one device | 1.500 s/step "
                    "(compute-bound roofline), MFU 61.0%, memory 40.00 GiB (estimate, not measured) |"]


@pytest.mark.slow
def test_another_configs_train_step_alone(tmp_path):
    """--config/--set/--sections: one section of another config, its overrides named in the table."""
    from bench.accelerator import main

    out = tmp_path / "moe.json"
    assert main(["--smoke", "--config", "configs/moe_tiny.yaml", "--sections", "train", "--set", "model.n_layers=2",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "equality" not in res and "decode" not in res
    assert res["train_config"]["name"] == "moe_tiny model.n_layers=2 (smoke)"
    (train,) = res["train"]
    assert train["tokens_per_sec"] > 0, train


@pytest.fixture(scope="module")
def gmm_smoke(tmp_path_factory):
    from bench.gmm_gpu import main

    out = tmp_path_factory.mktemp("gmm") / "gmm.json"
    assert main(["--smoke", "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_gmm_check_measures_the_kernel_against_ragged_dot(gmm_smoke):
    """bench/gmm_gpu.py --smoke: the Triton kernel (interpret mode) equals ragged_dot, forward and both gradients,
    on groups with empty experts; both groupings timed forward and forward + backward."""
    eq = gmm_smoke["equality"]
    assert 0 in eq["group_sizes"] and sum(eq["group_sizes"]) < eq["shape"][0]
    assert max(eq["forward"], eq["d_lhs"], eq["d_rhs"]) < 1e-6, eq
    assert [r["grouping"] for r in gmm_smoke["speed"]] == ["kernel triton", "ragged_dot"]
    for r in gmm_smoke["speed"]:
        assert r["forward"]["ms"] > 0 and r["forward_backward"]["tflops"] > 0, r


@pytest.mark.slow
def test_companion_the_gmm_check_sees_a_kernel_that_skips_the_last_group(monkeypatch):
    """A kernel that leaves the last group's rows out reads as a forward difference of the outputs' own size."""
    from bench import gmm_gpu
    from mtpjax.nn import gmm

    real = gmm.grouped_matmul

    def skips_last(x_ID, w_EDF, sizes_E, kernel):
        return real(x_ID, w_EDF, sizes_E.at[-1].set(0), kernel)

    monkeypatch.setattr(gmm, "grouped_matmul", skips_last)
    eq = gmm_gpu.equality(gmm.Kernel("triton", interpret=True), 100, 48, 40, 5)
    assert eq["forward"] > 0.1 and eq["d_rhs"] > 0.1, eq


@pytest.mark.slow
def test_attention_check_times_every_kernel_and_compares_each_to_the_first(tmp_path):
    """bench/attention_gpu.py --smoke: every Pallas tile choice and the cuDNN call (its XLA path here) runs, each
    timed, and each masked kernel's output and gradients equal the first's within float32-on-bf16 rounding."""
    from bench.attention_gpu import main

    out = tmp_path / "attn.json"
    assert main(["--smoke", "--repeats", "1", "--tiles", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"][:6] for r in rows] == ["pallas", "pallas", "cudnn,", "cudnn,"]
    assert all(r["forward_backward_ms"] > 0 for r in rows)
    assert all(r["rel_diff"] < 2e-2 for r in rows[1:] if "causal only" not in r["kernel"])
