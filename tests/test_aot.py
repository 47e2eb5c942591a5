"""`python -m mtpjax compile`: the tiny config (bfloat16, small shapes) compiled for a 4-chip TPU slice and 2 H100s
with their real compilers, no accelerator here.

The compilers (libtpu, the CUDA PJRT plugin) live apart in .aot/site (README's CI command installs them there;
MTPJAX_AOT_SITE names another place), on the path of the compile processes only: installed beside JAX, the CUDA
plugin prints a line on every process's start on a machine without CUDA, which other tests' exact stderr would see.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mtpjax.cli.compile import main as compile_main
from mtpjax.parallel import hlo
from mtpjax.parallel.targets import TargetError, parse_target
from mtpjax.train.aot import memory_of

pytestmark = [pytest.mark.slow, pytest.mark.as_users_compile]  # the targets' compilers, at their own settings

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("MTPJAX_AOT_SITE", ROOT / ".aot" / "site"))
T = 80  # sequence length: no weight has a dimension of 80, so a [.., 80, ..] array is an activation
SMALL = ["model.dtype=bfloat16", "model.n_layers=2", f"data.seq_len={T}", "train.batch_size=4",
         "train.micro_batches=2", "loss.chunk_size=0", "decode.max_len=256"]
TPU = ("v5e-4", ["mesh.fsdp=2", "mesh.tensor=2"], "splash (Mosaic)")
GPU = ("h100:2", ["mesh.fsdp=2"], "pallas (Triton)")


def compile_run(tmp: Path, target: str, overrides: list, patch: str = "none", *flags) -> subprocess.CompletedProcess:
    """The compile command in a fresh process with the compilers on its path; report in tmp/report.json, HLO in
    tmp/hlo."""
    if not (SITE / "libtpu").exists() or not (SITE / "jax_plugins").exists():
        pytest.fail(f"the AOT compilers are not in {SITE}; install them as README's CI command does")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]), "JAX_PLATFORMS": "cpu"}
    for k in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS"):
        env.pop(k, None)
    argv = [sys.executable, str(ROOT / "tests" / "aot_worker.py"), patch, "--config", str(ROOT / "configs/tiny.yaml"),
            "--target", target, "--json", str(tmp / "report.json"), "--dump-hlo", str(tmp / "hlo"), *flags,
            *SMALL, *overrides]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def report_of(tmp: Path, p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return {q["program"]: q for q in json.loads((tmp / "report.json").read_text())["programs"]}


@pytest.fixture(scope="module", params=[TPU, GPU], ids=["tpu", "gpu"])
def compiled(request, tmp_path_factory):
    """(target, expected kernel, {program: report entry}, the HLO directory) of one compile of every program."""
    target, mesh, kernel = request.param
    tmp = tmp_path_factory.mktemp(target.replace(":", "_"))
    return target, kernel, report_of(tmp, compile_run(tmp, target, mesh)), tmp / "hlo"


def activation_gathers(hlo_dir: Path, program: str) -> list[str]:
    """All-gathers of an activation (a dimension of T, or rank >= 3: no weight of the dense tiny model has either)
    that feed an attention kernel's custom call: what a compiler does to run a kernel it cannot partition. (After
    the kernel, XLA gathers some backward outputs' rows for the FSDP weight gradients of the q/k/v projections at
    these tiny shapes, where they are smaller than the weights: docs/accelerators.md.)"""
    prog = hlo.Program((hlo_dir / f"{program}.hlo.txt").read_text())
    is_kernel = lambda i: i.op == "custom-call" and hlo.attention_kind(i.attrs.split('custom_call_target="')[-1])
    return [f"{n} {prog.shapes[n]}" for n in hlo.gathers_around(prog, is_kernel, after=False)
            if any(T in d or len(d) >= 3 for _, d in hlo.arrays(prog.shapes[n]))]


def test_every_program_compiles_with_the_platform_kernel(compiled):
    target, kernel, programs, _ = compiled
    assert {"train_step", "eval_step", "decode_plain", "decode_chain_1", "decode_tree_2"} <= set(programs)
    for name in ("train_step", "eval_step"):
        assert programs[name]["kernels"]["attention"] == [kernel], name
    for name in ("decode_plain", "decode_chain_1", "decode_tree_2"):  # the decode loop keeps XLA attention
        assert programs[name]["kernels"]["attention"] == ["xla (einsum)"], name


def test_no_activation_is_gathered_around_the_kernel(compiled):
    _, _, programs, hlo_dir = compiled
    for name in ("train_step", "eval_step"):
        assert activation_gathers(hlo_dir, name) == [], name


def test_the_memory_report_adds_up(compiled):
    _, _, programs, _ = compiled
    for name, p in programs.items():
        m = p["memory"]
        assert m["total"] == m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["generated_code"]
        assert m["total"] > 0 and m["arguments"] > 0, name


def test_memory_parts_are_the_compilers_analysis():
    c = jax.jit(lambda a, b: (a @ b).sum(0), donate_argnums=0).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
    m, ref = memory_of(c), c.memory_analysis()
    assert (m["arguments"], m["outputs"], m["aliased"], m["temporaries"], m["generated_code"]) == (
        ref.argument_size_in_bytes, ref.output_size_in_bytes, ref.alias_size_in_bytes, ref.temp_size_in_bytes,
        ref.generated_code_size_in_bytes)


def test_flops_with_trip_counts_match_the_plan_at_two_depths(compiled, tmp_path):
    """A scanned trunk in micro-batches: two nested loops whose bodies XLA's own count sees once."""
    target, _, programs, hlo_dir = compiled
    if target != GPU[0]:
        pytest.skip("one target suffices: the count is the same code on both")
    for depth in (1, 2):
        tmp = tmp_path / f"d{depth}"
        # T = 128: the kernels' blocks, so the count is of the work the plan counts, not of padding
        p = compile_run(tmp, target, GPU[1] + ["model.scan_layers=true", f"model.mtp_depth={depth}",
                                               "data.seq_len=128"], "none", "--no-decode")
        train = report_of(tmp, p)["train_step"]
        ratio = train["flops"] / train["analytic_flops"]
        assert abs(ratio - 1) < 0.15, (depth, ratio)
        # companion: the loops' bodies counted once, as XLA's cost analysis does, miss the count by far
        once = hlo.Program((tmp / "hlo" / "train_step.hlo.txt").read_text()).stats(trip_counts=False).flops
        assert abs(once / train["analytic_flops"] - 1) > 0.15


@pytest.mark.parametrize("target,mesh,overflow", [
    (TPU[0], TPU[1], ["model.vocab_size=2097152", "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=8"]),
    (GPU[0], GPU[1], ["model.vocab_size=4194304", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8"])],
    ids=["tpu", "gpu"])
def test_a_program_too_large_does_not_fit(tmp_path, target, mesh, overflow):
    p = compile_run(tmp_path, target, mesh + overflow + ["model.n_layers=1"], "none", "--no-decode")
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0], p.stderr[-2000:]
    assert ("refused" in errors[0]) == (target == TPU[0])  # TPU: the compiler's own refusal; GPU: against capacity
    assert "memory per device" in p.stdout and not (tmp_path / "report.json").exists()


def test_a_mesh_that_does_not_match_the_target_is_one_line(tmp_path):
    p = compile_run(tmp_path, TPU[0], ["mesh.fsdp=3"], "none", "--no-decode")
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: mesh")
    assert not (tmp_path / "report.json").exists()


def test_an_unknown_target_is_one_line(capsys, tmp_path):
    with pytest.raises(TargetError):
        parse_target("v7x-3")
    out = tmp_path / "r.json"
    assert compile_main(["--config", str(ROOT / "configs/tiny.yaml"), "--target", "tpu9", "--json", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: unknown target 'tpu9'") and not out.exists()


def test_target_names():
    assert (parse_target("v5p-16").devices, parse_target("v5p-16").topology) == (8, "v5:2x2x2")  # TensorCores
    assert (parse_target("v5e-4").topology, parse_target("v6e-8").topology) == ("v5e:2x2", "v6e:2x4")
    assert (parse_target("h100:2x8").devices, parse_target("h100:2x8").hosts) == (16, 2)
    assert parse_target("v5e:2x2").devices == 4


def test_companion_kernel_chosen_from_the_host(tmp_path):
    p = compile_run(tmp_path, TPU[0], TPU[1], "host_kernel", "--no-decode")
    assert report_of(tmp_path, p)["train_step"]["kernels"]["attention"] == ["xla (einsum)"]


@pytest.mark.parametrize("target,mesh", [TPU[:2], GPU[:2]], ids=["tpu", "gpu"])
def test_companion_kernel_without_shard_map(tmp_path, target, mesh):
    """Mosaic cannot partition a kernel, so the TPU compile fails; on GPU the compiler gathers q/k/v for it."""
    p = compile_run(tmp_path, target, mesh, "no_shard_map", "--no-decode")
    if target == TPU[0]:
        assert p.returncode != 0 and "shard_map" in p.stderr
    else:
        assert activation_gathers(tmp_path / "hlo", "train_step")
