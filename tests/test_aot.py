"""`python -m mtpjax compile`: the tiny config (bfloat16, small shapes) compiled for a 4-chip TPU slice and 2 H100s
with their real compilers, no accelerator here.

The compilers (libtpu, the CUDA PJRT plugin) live apart in .aot/site (README's CI command installs them there;
MTPJAX_AOT_SITE names another place), on the path of the compile processes only: installed beside JAX, the CUDA
plugin prints a line on every process's start on a machine without CUDA, which other tests' exact stderr would see.
Every compile this file needs starts when its first test does, two processes at a time (the CI machine's cores).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from types import SimpleNamespace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mtpjax.cli.compile import main as compile_main
from mtpjax.parallel import hlo, hlo_calls, hlo_text
from mtpjax.parallel.targets import TargetError, parse_target
from mtpjax.train.aot import memory_of

pytestmark = [pytest.mark.slow, pytest.mark.as_users_compile]  # the targets' compilers, at their own settings

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("MTPJAX_AOT_SITE", ROOT / ".aot" / "site"))
# Sequence lengths such that neither T nor a micro-batch's 2·T rows is a dimension of any weight of the tiny model: an
# array with either is an activation.
T = {"tpu": 80, "gpu": 48}
SMALL_BATCH = 4
SMALL = ["model.dtype=bfloat16", "model.n_layers=2", f"train.batch_size={SMALL_BATCH}", "train.micro_batches=2",
         "loss.chunk_size=0", "decode.max_len=256"]
TPU = ("v5e-4", ["mesh.fsdp=2", "mesh.tensor=2", f"data.seq_len={T['tpu']}"], "splash (Mosaic)")
# GPU: a scanned trunk in micro-batches (two nested loops, whose bodies XLA's own count sees once)
GPU = ("h100:2", ["mesh.fsdp=2", f"data.seq_len={T['gpu']}", "model.scan_layers=true"], "pallas (Triton)")
TOO_LARGE = ["model.n_layers=1", "model.n_heads=16", "model.n_kv_heads=8"]
# DeepSeek-V3's program structure at toy widths on the TPU: MLA, an MoE block in the trunk and in each MTP module,
# 4 routed experts over expert 2 (2 per device, k = 2) dispatched by all-to-all, the experts' FFN over tensor 2.
# (2 experts, one per device, would compute no excess, but libtpu 0.0.42 fails an internal RET_CHECK (mask_aggregator)
# compiling that train step.)
MOE = {"D": 128, "F": 256, "E": 4, "k": 2, "expert": 2, "tensor": 2, "T": 128}
MLA_MOE = ["model.attention_kind=mla", "model.q_lora_rank=64", "model.kv_lora_rank=32", "model.qk_nope_head_dim=32",
           "model.qk_rope_head_dim=16", "model.v_head_dim=32", "model.n_kv_heads=4", "model.mlp_kind=moe",
           f"model.n_routed_experts={MOE['E']}", f"model.num_experts_per_tok={MOE['k']}", "model.n_shared_experts=1",
           f"model.moe_d_ff={MOE['F']}", "model.first_k_dense_replace=1", f"mesh.expert={MOE['expert']}",
           f"mesh.tensor={MOE['tensor']}", f"data.seq_len={MOE['T']}"]
# the plan's depth-1 tree of two nodes is spelled by its parents (`2` is a chain of 2: issue 48's one spelling)
DECODE = ("decode_plain", "decode_chain_1", "decode_tree_-1,-1")
RUNS = {  # name: (target, overrides, patch, flags)
    "tpu": (TPU[0], TPU[1], "none", ("--decode-batch", "2")),
    "gpu": (GPU[0], GPU[1], "none", ("--decode-batch", "2", "--alpha", "0.6")),
    "tpu_moe": (TPU[0], MLA_MOE, "none", ("--no-decode",)),
    "tpu_moe_depth2": (TPU[0], MLA_MOE + ["model.mtp_depth=2"], "none", ("--no-decode",)),
    "tpu_moe_ragged": (TPU[0], MLA_MOE, "xla_ragged_dot", ("--no-decode",)),
    "gpu_moe": ("h100:4", MLA_MOE, "none", ("--no-decode",)),
    "gpu_depth2": (GPU[0], GPU[1] + ["model.mtp_depth=2"], "none", ("--no-decode",)),
    "tpu_too_large": (TPU[0], TPU[1] + TOO_LARGE + ["model.vocab_size=2097152", "model.d_model=2048"], "none",
                      ("--no-decode",)),
    "gpu_too_large": (GPU[0], GPU[1] + TOO_LARGE + ["model.vocab_size=4194304", "model.d_model=4096"], "none",
                      ("--no-decode",)),
    "tpu_bad_mesh": (TPU[0], TPU[1] + ["mesh.fsdp=3"], "none", ("--no-decode",)),
    "tpu_host_kernel": (TPU[0], TPU[1], "host_kernel+one_chip_decode", ("--decode-batch", "2")),
    "tpu_no_shard_map": (TPU[0], TPU[1], "no_shard_map", ("--no-decode",)),
    "tpu_fills": (TPU[0], [f"data.seq_len={T['tpu']}"], "none", ()),  # no mesh given: compile fills the slice
    "gpu_search": ("h100:4", [f"data.seq_len={T['gpu']}"], "none", ("--search", "3")),
    "gpu_no_shard_map": (GPU[0], GPU[1], "no_shard_map", ("--no-decode",)),
}


def _start(tmp: Path, target: str, overrides: list, patch: str, flags) -> subprocess.Popen:
    """The compile command in a fresh process with the compilers on its path; report in tmp/report.json, HLO in
    tmp/hlo, its output in tmp/out and tmp/err."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]), "JAX_PLATFORMS": "cpu"}
    for k in ("JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_FLAGS"):
        env.pop(k, None)
    argv = [sys.executable, str(ROOT / "tests" / "aot_worker.py"), patch, "--config", str(ROOT / "configs/tiny.yaml"),
            "--target", target, "--json", str(tmp / "report.json"), "--dump-hlo", str(tmp / "hlo"), *flags,
            *SMALL, *overrides]
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(tmp / "out", "w"), stderr=open(tmp / "err", "w"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (exit status, stdout, stderr, its directory)} of every RUNS compile, two at a time."""
    if not (SITE / "libtpu").exists() or not (SITE / "jax_plugins").exists():
        pytest.fail(f"the AOT compilers are not in {SITE}; install them as README's CI command does")
    base, slots, done = tmp_path_factory.mktemp("aot"), threading.Semaphore(2), {}

    def run(name):
        d = base / name
        with slots:
            code = _start(d, *RUNS[name]).wait(timeout=900)
        done[name] = (code, (d / "out").read_text(), (d / "err").read_text(), d)

    threads = [threading.Thread(target=run, args=(name,)) for name in RUNS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def report_of(runs: dict, name: str) -> dict:
    code, _, err, d = runs[name]
    assert code == 0, err[-3000:]
    return {q["program"]: q for q in json.loads((d / "report.json").read_text())["programs"]}


def activation_gathers(hlo_dir: Path, program: str, platform: str) -> list[str]:
    """All-gathers of a floating-point activation (one with a dimension of T or 2·T rows) that feed an attention
    kernel's custom call: q/k/v, or the rows they are projected from, gathered so a compiler can run a kernel it
    cannot partition. (After the kernel, XLA gathers some
    backward outputs' rows for the FSDP weight gradients of the q/k/v projections at these tiny shapes, where they
    are smaller than the weights: docs/accelerators.md.)"""
    prog = hlo.Program((hlo_dir / f"{program}.hlo.txt").read_text())
    is_kernel = lambda i: i.op == "custom-call" and hlo_calls.attention_kind(i.attrs.split('custom_call_target="')[-1])
    out = []
    for n, idx in hlo.gathers_around(prog, is_kernel, hops=8, after=False):
        flows = hlo.arrays(prog.shapes[n]) if idx is None else hlo.arrays(prog.shapes[n])[idx:idx + 1]
        if any({T[platform], 2 * T[platform]} & set(d) and dt in ("bf16", "f32") for dt, d in flows):
            out.append(f"{n} {prog.shapes[n]}")
    return out


@pytest.mark.parametrize("name,kernel", [("tpu", TPU[2]), ("gpu", GPU[2])])
def test_every_program_compiles_with_the_platform_kernel(runs, name, kernel):
    programs = report_of(runs, name)
    assert {"train_step", "eval_step", *DECODE} <= set(programs)
    for p in ("train_step", "eval_step"):
        assert programs[p]["kernels"]["attention"] == [kernel], p
    for p in DECODE:  # the decode loop keeps XLA attention
        assert programs[p]["kernels"]["attention"] == ["xla (einsum)"], p


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_no_activation_is_gathered_to_feed_the_kernel(runs, name):
    report_of(runs, name)
    for p in ("train_step", "eval_step"):
        assert activation_gathers(runs[name][3] / "hlo", p, name) == [], p


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_memory_report_adds_up(runs, name):
    for p, entry in report_of(runs, name).items():
        m = entry["memory"]
        assert m["total"] == m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["generated_code"]
        assert m["total"] > 0 and m["arguments"] > 0, p


def test_memory_parts_are_the_compilers_analysis():
    c = jax.jit(lambda a, b: (a @ b).sum(0), donate_argnums=0).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile()
    m, ref = memory_of(c), c.memory_analysis()
    assert (m["arguments"], m["outputs"], m["aliased"], m["temporaries"], m["generated_code"]) == (
        ref.argument_size_in_bytes, ref.output_size_in_bytes, ref.alias_size_in_bytes, ref.temp_size_in_bytes,
        ref.generated_code_size_in_bytes)


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_largest_collectives_are_printed_with_their_layers(runs, name):
    """compile says where the bytes go: the largest collectives, largest first, each with the op and the layer's name
    scope it comes from; they are part of the collectives' total."""
    train = report_of(runs, name)["train_step"]
    largest = train["largest_collectives"]
    assert largest and [c["bytes"] for c in largest] == sorted((c["bytes"] for c in largest), reverse=True)
    assert sum(c["bytes"] for c in largest) <= sum(v["bytes"] for v in train["collectives"].values()) * (1 + 1e-9)
    assert any(re.search(r"\b(attention|mlp|head|embed)\b", c["op_name"]) for c in largest)
    out = runs[name][1]
    assert "largest collectives" in out and all(c["op_name"] in out and c["shape"] in out for c in largest)


@pytest.mark.parametrize("name", ["gpu", "gpu_depth2"])
def test_flops_with_trip_counts_match_the_plan_at_two_depths(runs, name):
    train = report_of(runs, name)["train_step"]
    ratio = train["flops"] / train["analytic_flops"]
    assert abs(ratio - 1) < 0.15, ratio
    # companion: the loops' bodies counted once, as XLA's cost analysis does, miss the count by far
    once = hlo.Program((runs[name][3] / "hlo" / "train_step.hlo.txt").read_text()).stats(trip_counts=False).flops
    assert abs(once / train["analytic_flops"] - 1) > 0.15


@pytest.mark.parametrize("name", ["tpu_too_large", "gpu_too_large"])
def test_a_program_too_large_does_not_fit(runs, name):
    code, out, err, d = runs[name]
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0], err[-2000:]
    assert ("refused" in errors[0]) == name.startswith("tpu")  # TPU: the compiler's own refusal; GPU: capacity
    assert "memory per device" in out and not (d / "report.json").exists()


def test_a_mesh_that_does_not_match_the_target_is_one_line(runs):
    code, _, err, d = runs["tpu_bad_mesh"]
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: mesh"), err[-2000:]
    assert not (d / "report.json").exists()


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


def test_a_one_chip_slice_is_described():
    """v5e-1 and v6e-1 (one chip: less than a host's 2x2, which libtpu assumes unless told) have their one device."""
    code = ("from mtpjax.parallel.targets import parse_target, topology_devices\n"
            "print([len(topology_devices(parse_target(t))) for t in ('v5e-1', 'v6e-1', 'v6e-8')])\n")
    p = _python(code, JAX_PLATFORMS="cpu")
    assert p.returncode == 0 and p.stdout.split("\n")[-2] == "[1, 1, 8]", p.stderr[-2000:]


def test_companion_kernel_chosen_from_the_host(runs):
    assert report_of(runs, "tpu_host_kernel")["train_step"]["kernels"]["attention"] == ["xla (einsum)"]


def kernel_rows(hlo_dir: Path, program: str) -> set[int]:
    """The batch rows each Triton attention kernel call sees (its q is [B,T,N,H])."""
    prog = hlo.Program((hlo_dir / f"{program}.hlo.txt").read_text())
    calls = [i for c in prog.comps.values() for i in c if i.op == "custom-call" and "xla.gpu.triton" in i.attrs]
    return {hlo.arrays(prog.shapes[i.operands[0]])[0][1][0] for i in calls if i.operands}


def test_the_gpu_kernel_sees_each_device_s_rows(runs):
    report_of(runs, "gpu")
    assert kernel_rows(runs["gpu"][3] / "hlo", "train_step") == {1}  # 4 rows / 2 micro-batches / fsdp 2


def test_companion_kernel_without_shard_map(runs):
    """Mosaic cannot partition a kernel, so the TPU compile fails; on GPU the kernel runs on the whole batch, its rows
    gathered to every device."""
    code, _, err, _ = runs["tpu_no_shard_map"]
    assert code != 0 and "shard_map" in err
    report_of(runs, "gpu_no_shard_map")
    assert kernel_rows(runs["gpu_no_shard_map"][3] / "hlo", "train_step") == {2}


def dispatch_extra(depth: int, platform: str, kernel: bool = True) -> float:
    """FLOPs per device that MLA_MOE's train step computes beyond the plan's count (which counts what a token needs):
    each device's N tokens send their k slots into buffers sized for the worst case (every token on min(k, E_l) of
    each shard's E_l experts: R = expert·min(k, E_l)·N rows received), whose padding rows ride with the last expert.
    The gmm kernels (issue 47) run each of the 9 matmuls (3 forward, 3 input and 3 weight gradients) over every
    received row once. XLA's ragged_dot (`kernel=False`): on a TPU the Mosaic ragged_dot multiplies every received
    row once in the forward and the input gradient (2 × 3 matmuls), and the weight gradients run every local expert
    over every received row (3 × E_l); on a GPU all 9 matmuls are dense, every local expert over every received row.
    One MoE block in the trunk, one per MTP module."""
    E_l, N = MOE["E"] // MOE["expert"], SMALL_BATCH * MOE["T"] // MOE["expert"]
    R, DF = MOE["expert"] * min(MOE["k"], E_l) * N, MOE["D"] * MOE["F"] // MOE["tensor"]
    matmuls = 9 if kernel else 6 + 3 * E_l if platform == "tpu" else 9 * E_l
    executed, needed = 2 * matmuls * R * DF, 2 * 9 * MOE["k"] * N * DF
    return (1 + depth) * (executed - needed)


def head_recompute(depth: int) -> float:
    """FLOPs per device of one more pass of the shared head than the plan counts: on a TPU the head is fused with its
    cross-entropy (nn/head_ce.py), whose backward recomputes each tile of logits (the plan, with an unchunked loss,
    counts the forward and the two gradient products). Rows: the batch over expert, every depth; the vocabulary
    over tensor."""
    rows = SMALL_BATCH * MOE["T"] // MOE["expert"] * (1 + depth)
    return 2 * rows * MOE["D"] * 1024 // MOE["tensor"]  # configs/tiny.yaml's vocabulary


def moe_flops(runs: dict, name: str) -> tuple[float, float, hlo.Program]:
    """(the train step's counted FLOPs, the plan's plus dispatch_extra and the fused head's recompute, its parsed
    HLO)."""
    train = report_of(runs, name)["train_step"]
    prog = hlo.Program((runs[name][3] / "hlo" / "train_step.hlo.txt").read_text())
    depth, platform = 2 if name.endswith("depth2") else 1, name.split("_")[0]
    extra = dispatch_extra(depth, platform, not name.endswith("ragged"))
    extra += head_recompute(depth) if platform == "tpu" else 0
    return train["flops"], train["analytic_flops"] + extra, prog


@pytest.mark.parametrize("name, kernel", [("tpu_moe", hlo_calls.GMM_CALLS["megablox"]),
                                          ("tpu_moe_depth2", hlo_calls.GMM_CALLS["megablox"]),
                                          ("tpu_moe_ragged", hlo_calls.RAGGED_CALL)])
def test_mla_moe_flops_match_the_plan_with_the_dispatch_at_two_depths(runs, name, kernel):
    """Issue 47's megablox kernels, and XLA's ragged_dot (Mosaic; its weight gradients convolutions) before them."""
    counted, expected, prog = moe_flops(runs, name)
    assert abs(counted / expected - 1) < 0.15, counted / expected
    assert prog.stats().calls[kernel] > 0  # the grouped matmuls are Mosaic kernels, not attention
    # the report names the call without its closing parenthesis when it says more ("ragged_dot (Mosaic; weight ...")
    assert report_of(runs, name)["train_step"]["kernels"]["moe"].startswith(kernel.rstrip(")"))


def test_mla_moe_compiles_for_gpus_and_its_flops_match_the_plan_with_the_dispatch(runs):
    """The MoE's dispatch sorts its slots; on GPUs that compiles with XLA's sort (CUB's asks a live GPU), and the
    Triton gmm kernels run each matmul over every received row once: the plan plus the dispatch's excess, which the
    report's routed line shows."""
    counted, expected, _ = moe_flops(runs, "gpu_moe")
    assert abs(counted / expected - 1) < 0.15, counted / expected
    train = report_of(runs, "gpu_moe")["train_step"]
    assert train["kernels"]["moe"].startswith(hlo_calls.GMM_CALLS["triton"])
    E_l, N = MOE["E"] // MOE["expert"], SMALL_BATCH * MOE["T"] // MOE["expert"]
    received = MOE["expert"] * min(MOE["k"], E_l) * N
    assert train["routed"]["flops"] / train["routed"]["need"] == pytest.approx(received / (MOE["k"] * N))


def test_companion_a_gpu_sort_compiled_with_cub_asks_for_a_gpu():
    """The compile option that the MoE's GPU compile stands on: without it, XLA's CUB radix sort (a sort of 10^5
    keys) fails to compile here for want of a GPU."""
    code = ("from mtpjax.parallel.targets import prepare_environment, parse_target, topology_devices\n"
            "prepare_environment('cpu')\n"
            "import jax, jax.numpy as jnp\n"
            "from mtpjax.train.aot import compiler_options\n"
            "mesh = jax.sharding.Mesh(topology_devices(parse_target('h100:1')), ('x',))\n"
            "arg = jax.ShapeDtypeStruct((100_000,), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))\n"
            "lowered = jax.jit(lambda g: jnp.argsort(g, stable=True)).lower(arg)\n"
            "lowered.compile(compiler_options('gpu'))\n"
            "print('ours compiled')\n"
            "try:\n"
            "    lowered.compile({})\n"
            "except Exception as e:\n"
            "    print('cub:', str(e).splitlines()[0])\n")
    p = _python(code, JAX_PLATFORMS="cpu")
    assert p.returncode == 0 and p.stdout.splitlines()[0] == "ours compiled", p.stderr[-2000:]
    assert "CUDA Runtime error" in p.stdout.splitlines()[1], p.stdout


@pytest.mark.parametrize("name", ["tpu_moe", "tpu_moe_depth2", "tpu_moe_ragged"])
def test_companion_mla_moe_flops_without_the_counter_s_fixes(runs, name, monkeypatch):
    """Each of the fixes undone misses the count: a grouped matmul kernel (Mosaic ragged_dot, megablox gmm) not
    counted (read as an attention kernel, it had 0 FLOPs: its input is 2-D), and, where XLA's ragged_dot remains, a
    convolution's every window position counted, holes of its dilated input included (the TPU's weight gradient of
    a ragged_dot slides an E_l-wide window over E_l·E_l - E_l + 1 positions)."""
    _, expected, _ = moe_flops(runs, name)
    text = (runs[name][3] / "hlo" / "train_step.hlo.txt").read_text()
    with monkeypatch.context() as m:
        m.setattr(hlo, "ragged_call_flops", lambda ins, shapes: 0.0)
        assert abs(hlo.Program(text).stats().flops / expected - 1) > 0.15
    if name.endswith("ragged"):
        with monkeypatch.context() as m:
            m.setattr(hlo, "_taps", lambda n, out, size, *rest: out * size)
            assert abs(hlo.Program(text).stats().flops / expected - 1) > 0.15


@pytest.mark.parametrize("lhs,rhs,stride,pad,lhs_dilation,rhs_dilation", [
    ((2, 3, 4), (5, 3, 4), 3, (0, 0), 4, 1),  # the TPU's batched matmul: a window over a dilated batch dimension
    ((2, 3, 2), (5, 3, 2), 1, (1, 1), 1, 1),  # padded both sides
    ((2, 3, 7), (5, 3, 3), 2, (2, 1), 2, 2),
    ((2, 3, 6), (5, 3, 3), 1, (0, 0), 1, 1),
])
def test_a_convolution_counts_the_products_it_computes(lhs, rhs, stride, pad, lhs_dilation, rhs_dilation):
    """2 per multiply of an input element, holes and padding excepted: with all-ones operands, twice the sum of the
    output."""
    conv = lambda a, b: jax.lax.conv_general_dilated(a, b, (stride,), [pad], lhs_dilation=(lhs_dilation,),
                                                      rhs_dilation=(rhs_dilation,))
    a, b = jnp.ones(lhs), jnp.ones(rhs)
    prog = hlo.Program(jax.jit(conv).lower(a, b).compile().as_text())
    assert prog.stats().flops == 2 * float(conv(a, b).sum())


def partitions(hlo_dir: Path, program: str) -> int:
    """The devices a compiled program is partitioned over (its module's num_partitions)."""
    m = re.search(r"num_partitions=(\d+)", (hlo_dir / f"{program}.hlo.txt").read_text().split("\n", 1)[0])
    return int(m[1]) if m else 1


@pytest.mark.parametrize("name,devices", [("tpu", 4), ("gpu", 2)])
def test_the_decode_loops_compile_on_the_target_s_mesh(runs, name, devices):
    programs = report_of(runs, name)
    for p in DECODE:
        assert partitions(runs[name][3] / "hlo", p) == devices, p
        assert programs[p]["round"]["flops"] > 0, p


def test_companion_decode_loops_on_one_chip(runs):
    """The decode loops compiled on one chip of the target (before decoding on the mesh): one partition, and each
    device holds all the parameters the mesh splits over fsdp and tensor."""
    mesh, one = report_of(runs, "tpu"), report_of(runs, "tpu_host_kernel")
    for p in DECODE:
        assert partitions(runs["tpu_host_kernel"][3] / "hlo", p) == 1, p
        assert one[p]["memory"]["arguments"] > 2 * mesh[p]["memory"]["arguments"], p


@pytest.mark.parametrize("name,alpha", [("gpu", 0.6), ("tpu", 0.8)])  # --alpha given / its default
def test_decode_rounds_and_the_speedup_at_the_run_s_alpha(runs, name, alpha):
    """Each round's FLOPs and bytes are reported (a verification round computes more than a plain one); the predicted
    speedup is E(α) × t(plain round) / t(round)."""
    programs = report_of(runs, name)
    plain, chain = programs["decode_plain"]["round"], programs["decode_chain_1"]["round"]
    assert plain["tokens_per_round"] == 1 and chain["tokens_per_round"] == pytest.approx(1 + alpha)
    assert chain["hbm_bytes"] > 0 and plain["hbm_bytes"] > 0 and chain["flops"] > plain["flops"] > 0
    assert chain["speedup_estimate"] == pytest.approx((1 + alpha) * plain["roofline_s"] / chain["roofline_s"])


SLICED_AND_UPDATED = """HloModule m

%layer (p0: f32[18,64,32], p1: s32[]) -> bf16[1,64,32] {
  %p0 = f32[18,64,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,64,32]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,32}
  ROOT %cv = bf16[1,64,32]{2,1,0} convert(%ds)
}

%append (q0: bf16[8,256,16], q1: bf16[8,1,16], q2: s32[]) -> bf16[8,256,16] {
  %q0 = bf16[8,256,16]{2,1,0} parameter(0)
  %q1 = bf16[8,1,16]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[8,256,16]{2,1,0} dynamic-update-slice(%q0, %q1, %z, %q2, %z)
}

ENTRY %main (a: f32[18,64,32], i: s32[], cache: bf16[8,256,16], new: bf16[8,1,16]) -> (bf16[1,64,32], bf16[8,256,16]) {
  %a = f32[18,64,32]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %cache = bf16[8,256,16]{2,1,0} parameter(2)
  %new = bf16[8,1,16]{2,1,0} parameter(3)
  %f = bf16[1,64,32]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%layer
  %u = bf16[8,256,16]{2,1,0} fusion(%cache, %new, %i), kind=kLoop, calls=%append
  ROOT %t = (bf16[1,64,32]{2,1,0}, bf16[8,256,16]{2,1,0}) tuple(%f, %u)
}
"""


GATHERED = """HloModule g

%pick (p0: f32[64,512], p1: s32[64,2]) -> f32[64,1] {
  %p0 = f32[64,512]{1,0} parameter(0)
  %p1 = s32[64,2]{1,0} parameter(1)
  %t = f32[512,64]{1,0} transpose(%p0), dimensions={1,0}
  %r = f32[512,64]{0,1} bitcast(%t)
  ROOT %g = f32[64,1]{1,0} gather(%r, %p1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0,1},
    index_vector_dim=1, slice_sizes={1,1}
}

ENTRY %main (x: f32[64,512], i: s32[64,2]) -> f32[64,1] {
  %x = f32[64,512]{1,0} parameter(0)
  %i = s32[64,2]{1,0} parameter(1)
  ROOT %f = f32[64,1]{1,0} fusion(%x, %i), kind=kLoop, calls=%pick
}
"""


def test_hbm_traffic_of_a_gather_through_a_transpose_reads_the_picked_elements():
    """The target logit of each row (take_along_axis, fused after the head's layout transpose) reads 64 floats of
    the [64, 512] logits, not all of them (small on h100:8: 2.15 GB of a step's 62.4 GB counted before)."""
    assert hlo.Program(GATHERED).stats().hbm_bytes == 64 * 4 + 64 * 2 * 4 + 64 * 4


def test_companion_a_gather_counted_as_a_whole_read(monkeypatch):
    """Without gathers among the ops that read only what they pick, the whole logits are read."""
    monkeypatch.setattr(hlo, "_PICKS", ("dynamic-slice", "slice"))
    assert hlo.Program(GATHERED).stats().hbm_bytes == 64 * 512 * 4 + 64 * 2 * 4 + 64 * 4


ON_CHIP = """HloModule t

%neg (p0: f32[1024,128]) -> f32[1024,128] {
  %p0 = f32[1024,128]{1,0:T(8,128)S(1)} parameter(0)
  ROOT %n = f32[1024,128]{1,0:T(8,128)S(1)} negate(%p0)
}

ENTRY %main (x: s8[1048576]) -> f32[1024,128] {
  %x = s8[1048576]{0:T(1024)} parameter(0)
  %s0 = ((s8[1048576]{0:T(1024)}), s8[262144]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%x), slice={[0:262144]}
  %s1 = ((s8[1048576]{0:T(1024)}), s8[262144]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%x), slice={[262144:524288]}
  %d0 = s8[262144]{0:T(1024)S(1)} slice-done(%s0)
  %d1 = s8[262144]{0:T(1024)S(1)} slice-done(%s1)
  %c = f32[1024,128]{1,0:T(8,128)S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
  %y = f32[1024,128]{1,0:T(8,128)S(1)} fusion(%c), kind=kLoop, calls=%neg
  %e = (f32[1024,128]{1,0:T(8,128)S(1)}, f32[1024,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%y)
  ROOT %o = f32[1024,128]{1,0:T(8,128)} copy-done(%e)
}
"""


def test_hbm_traffic_of_a_tpu_program_leaves_out_on_chip_memory():
    """A TPU program's memory-space assignment prefetches half of an HBM buffer into VMEM (`S(1)`) as two async
    slices, joins them, computes there and evicts the result: HBM moves the two pieces in and the result out, not
    the whole source per piece, nor the on-chip reads and writes (small on v6e-8: 255 GB a step counted before)."""
    assert hlo.Program(ON_CHIP).stats().hbm_bytes == 2 * 262144 + 1024 * 128 * 4


def test_companion_memory_spaces_ignored(monkeypatch):
    monkeypatch.setattr(hlo_text, "_ON_CHIP", re.compile(r"$^"))
    assert hlo.Program(ON_CHIP).stats().hbm_bytes > 3 * (2 * 262144 + 1024 * 128 * 4)


def test_hbm_traffic_reads_a_layer_of_a_stack_and_writes_a_cache_s_new_rows():
    """A scanned stack's layer sliced and cast (f32 read, bf16 written), a cache's row written in place."""
    layer = 64 * 32 * 4 + 4 + 64 * 32 * 2
    append = 8 * 16 * 2 + 4 + 8 * 16 * 2
    assert hlo.Program(SLICED_AND_UPDATED).stats().hbm_bytes == layer + append


def test_companion_hbm_traffic_of_whole_operands(monkeypatch):
    """Counting every operand whole (the stack, the cache) reads what the program never touches."""
    monkeypatch.setattr(hlo.Program, "traffic", lambda self, ins: hlo.written_bytes(ins) + sum(
        hlo.nbytes(self.shapes.get(o, "")) for o in ins.operands))
    assert hlo.Program(SLICED_AND_UPDATED).stats().hbm_bytes > 10 * (64 * 32 * 6 + 8 * 16 * 4 + 8)


def test_a_mesh_decoding_cannot_use_is_one_line_before_anything_compiles(monkeypatch, capsys, tmp_path):
    from mtpjax.train import aot

    monkeypatch.setattr(aot, "topology_devices", lambda target: [])
    monkeypatch.setattr(aot, "make_mesh", lambda mesh, devices: SimpleNamespace(shape={"tensor": mesh.tensor,
                                                                                        "expert": mesh.expert}))
    monkeypatch.setattr(aot, "train_programs", lambda *a: pytest.fail("compiled before the mesh was checked"))
    out = tmp_path / "r.json"
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--target", "h100:2", "mesh.expert=2", "--json", str(out)]
    assert compile_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: mesh.expert=2 splits routed experts") and not out.exists()


def test_a_batch_the_run_would_refuse_is_one_line_before_anything_compiles(monkeypatch, capsys, tmp_path):
    """train.py refuses a batch that does not split over the batch shards and micro-batches; so does compile (its
    MoE would otherwise run unsharded)."""
    from mtpjax.train import aot

    monkeypatch.setattr(aot, "topology_devices", lambda target: [])
    monkeypatch.setattr(aot, "make_mesh", lambda mesh, devices: SimpleNamespace(shape=mesh.model_dump()))
    monkeypatch.setattr(aot, "train_programs", lambda *a: pytest.fail("compiled a batch the run would refuse"))
    out = tmp_path / "r.json"
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--target", "h100:2", "mesh.fsdp=2", "train.batch_size=6",
            "train.micro_batches=2", "--json", str(out)]
    assert compile_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.batch_size=6 is not divisible") and not out.exists()


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh process with the compilers (libtpu, the CUDA plugin) on its path, as the extras put them."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY")},
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]), **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


PLUGIN_LINES = ("cudart_stub", "absl::InitializeLog", "libtpu", "TPU_WORKER_HOSTNAMES", "Jax plugin configuration")


def test_a_cpu_machine_with_the_compilers_installed_is_quiet(runs):
    """train.py, decode.py and `python -m mtpjax` prepare the environment before JAX loads: with libtpu and the CUDA
    plugin installed on a machine without either device, JAX starts on the CPU and nothing of the plugins is printed;
    nor does a compile for GPUs print any."""
    p = _python("from mtpjax.parallel.targets import prepare_environment; prepare_environment()\n"
                "import jax, jax.numpy as jnp; print(jax.default_backend(), float(jnp.ones(2).sum()))")
    assert p.returncode == 0 and p.stdout.split() == ["cpu", "2.0"] and p.stderr == "", p.stderr[-2000:]
    _, _, err, _ = runs["gpu"]
    assert not [line for line in err.splitlines() if any(k in line for k in PLUGIN_LINES)], err[-2000:]


def test_companion_without_the_prepared_environment_the_plugins_speak():
    """The same start without prepare_environment: the plugins' lines (what the test above would catch)."""
    p = _python("import jax, jax.numpy as jnp; print(jax.default_backend(), float(jnp.ones(2).sum()))")
    assert p.returncode == 0 and "cudart_stub" in p.stderr, p.stderr[-2000:]


def test_the_plugin_filter_drops_only_the_plugin_s_lines(capfd):
    """What passes through the filter on file descriptor 2: every line but the CUDA plugin's "no driver" lines."""
    from mtpjax.parallel.targets import plugin_noise_dropped

    capfd.readouterr()
    with plugin_noise_dropped():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
                    b"I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not "
                    b"be used.\nour line\n")
        sys.stderr.write("python's line\n")  # one write: under capfd it bypasses the relay, so it races the relay's
    assert sorted(capfd.readouterr().err.splitlines()) == ["our line", "python's line"]  # capfd: its own order


def test_with_no_mesh_given_compile_fills_the_target_and_says_which(runs):
    """tiny (one device) on a 4-chip slice: a mesh over all 4 (its batch of 4 in 2 micro-batches splits over 2 batch
    shards, so heads take the other 2), said on stderr; the report ends in the booking's bottom line; what the decode
    layer logs (a decode row does not split over the mesh) is a note of the report, not a logging record."""
    code, out, err, d = runs["tpu_fills"]
    assert code == 0, err[-3000:]
    report = json.loads((d / "report.json").read_text())
    assert report["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1, "stage": 1}
    assert "compiling on fsdp 2 x tensor 2 (mesh.data=1 mesh.fsdp=2 mesh.expert=1 mesh.tensor=2;" in err, err
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"bottom line \(train step ESTIMATE on v5e-4\): [\d.]+ ms per step, [\d.]+[KMGT]? tokens/s, "
                        r"[\d.]+ (s|min|h|days) for train.steps=\d+, MFU [\d.]+% \(\w+-bound\)", last), last
    assert any(n.startswith("decode: a batch of 1 rows does not split") for n in report["notes"]), report["notes"]
    assert "note: decode: a batch of 1 rows" in out
    assert "WARNING" not in out + err


def test_search_ranks_the_meshes_that_fit_by_the_estimate(runs):
    """`--search 3`: three meshes over 4 H100s compiled (train step only) and ranked fastest first; the best one's
    overrides are the last line."""
    code, out, err, d = runs["gpu_search"]
    assert code == 0, err[-3000:]
    rows = json.loads((d / "report.json").read_text())["search"]
    assert [r["mesh"] for r in rows] and len({r["mesh"] for r in rows}) == 3, rows
    assert all(r["fits"] for r in rows)
    assert [r["estimate_s"] for r in rows] == sorted(r["estimate_s"] for r in rows)
    assert out.strip().splitlines()[-1] == "best: " + " ".join(rows[0]["overrides"])
    assert out.startswith("mesh search on h100:4")
def test_a_program_over_the_chip_s_memory_raises_does_not_fit_with_its_table():
    """compile_report has no table argument to forget: a program over capacity is DoesNotFit carrying the memory
    table (once a TypeError when compile_report's `table=None` was called); companion: one that fits passes."""
    import inspect

    from mtpjax.train.aot import DoesNotFit, check_fits, compile_report

    assert "table" not in inspect.signature(compile_report).parameters
    target = parse_target("h100:1")
    cap = target.chip.hbm_bytes
    report = {"target": target.name, "chip": dataclasses.asdict(target.chip), "programs": [
        {"program": "train_step", "memory": {"total": cap + 2**30, "arguments": cap, "temporaries": 2**30}}]}
    with pytest.raises(DoesNotFit, match=r"^train_step does not fit on .* by 1.00 GiB per device") as e:
        check_fits(report, target)
    assert "memory per device (GiB) on h100:1" in e.value.table and "does not fit by 1.00 GiB" in e.value.table
    report["programs"][0]["memory"]["total"] = cap // 2
    check_fits(report, target)
