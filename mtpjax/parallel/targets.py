"""Compile targets: the TPU slices and NVIDIA GPUs a program is compiled for on any machine, and their chips' figures.

A target names devices that need not be here: `jax.experimental.topologies` describes them (libtpu for a TPU slice,
the CUDA PJRT plugin and one of the XLA GPU target descriptions in `gpu_specs/` for GPUs), and a mesh over those
devices lowers and compiles with the target's own compiler. Nothing runs on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import sys
import threading
from pathlib import Path

from mtpjax.errors import MtpjaxError
from mtpjax.parallel import jax_private

SPECS = Path(__file__).resolve().parent / "gpu_specs"  # XLA's GPU target descriptions (Apache-2.0, LICENSE there)


# What the CUDA plugin logs (absl, from C++, straight to file descriptor 2) on a machine without NVIDIA's driver:
# expected when compiling for GPUs elsewhere, so not shown.
PLUGIN_NOISE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|^WARNING: All log messages before "
                          r"absl::InitializeLog\(\) is called are written to STDERR")


@contextlib.contextmanager
def plugin_noise_dropped():
    """File descriptor 2 (what C++ plugins write to) passed through without the PLUGIN_NOISE lines."""
    sys.stderr.flush()
    read, write = os.pipe()
    saved, out_fd = os.dup(2), os.dup(2)
    os.dup2(write, 2)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as lines, os.fdopen(out_fd, "wb", buffering=0) as out:
            for line in lines:
                if not PLUGIN_NOISE.search(line.decode(errors="replace")):
                    out.write(line)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: forward() reads to its end and stops
        os.close(saved)
        thread.join()


def prepare_environment(platforms: str | None = None) -> None:
    """Before JAX loads: on a machine with no accelerator, only the CPU backend starts (`platforms`, JAX_PLATFORMS,
    unless the user set it), libtpu (the `tpu` extra) asks no cloud metadata server, and the CUDA plugin (the `cuda`
    extra) is loaded without its "no driver here" lines: a CPU machine that compiles for TPUs and GPUs is quiet."""
    on_tpu_vm = any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists()
    on_gpu = any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/kfd"))
    if not (on_tpu_vm or on_gpu):
        platforms = platforms or "cpu"
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        if platforms == "cpu":  # what the metadata server would say; a topology's own name overrides the type
            os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
            os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU to guard: compiles run side by side
    if platforms:
        os.environ.setdefault("JAX_PLATFORMS", platforms)
    if not on_gpu and importlib.util.find_spec("jax_cuda12_plugin") is not None:
        with plugin_noise_dropped():  # JAX loads the plugin as it starts, and the plugin logs that no driver is here
            import jax  # noqa: F401

            jax_private.register_pjrt_plugins()  # what the first backend would do; starts none


class TargetError(MtpjaxError, ValueError):
    """A target that is unknown, malformed, or whose compiler is not installed; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's published figures (dense bf16 peak, memory, bandwidths): what the roofline reads."""

    name: str
    platform: str  # "tpu" | "gpu"
    peak_bf16: float  # FLOP/s, dense (no sparsity)
    hbm_bytes: float  # memory per device
    hbm_bw: float  # bytes/s
    link_bw: float  # bytes/s one device sends over its fastest interconnect (ICI, NVLink), one direction
    host_link_bw: float = 0.0  # bytes/s a device sends off its node (GPUs: InfiniBand/RoCE, one 400 Gb/s NIC each)
    spec: str = ""  # gpu_specs file (GPUs)


GiB = 2**30
# Published figures: Google Cloud TPU system architecture pages (v5e, v5p, v6e), NVIDIA H100/H200/A100/B200 data
# sheets (SXM, dense bf16). A GPU's memory is its target description's device_memory_size.
CHIPS = {
    "v5e": Chip("TPU v5e", "tpu", 197e12, 16 * GiB, 819e9, 200e9),
    "v5p": Chip("TPU v5p", "tpu", 459e12, 95 * GiB, 2765e9, 600e9),
    "v6e": Chip("TPU v6e", "tpu", 918e12, 32 * GiB, 1640e9, 448e9),
    "h100": Chip("NVIDIA H100 SXM", "gpu", 989e12, 84942979072, 3.35e12, 450e9, 50e9, "h100_sxm.txtpb"),
    "h200": Chip("NVIDIA H200 SXM", "gpu", 989e12, 151397597184, 4.8e12, 450e9, 50e9, "h200.txtpb"),
    "a100": Chip("NVIDIA A100 SXM 80GB", "gpu", 312e12, 85100068864, 2.039e12, 300e9, 25e9, "a100_sxm_80.txtpb"),
    "b200": Chip("NVIDIA B200", "gpu", 2250e12, 191514411008, 7.7e12, 900e9, 50e9, "b200.txtpb"),
}
# jax's device_kind -> published dense bf16 peak FLOP/s, first match wins (bench/accelerator.py's MFU reads it too).
KIND_PEAKS = [
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", CHIPS["h100"].peak_bf16), ("H200 NVL", 835e12),
    ("H200", CHIPS["h200"].peak_bf16), ("A100", CHIPS["a100"].peak_bf16), ("B200", CHIPS["b200"].peak_bf16),
    ("TPU v4", 275e12), ("TPU v5 lite", CHIPS["v5e"].peak_bf16), ("TPU v5e", CHIPS["v5e"].peak_bf16),
    ("TPU v5p", CHIPS["v5p"].peak_bf16), ("TPU v5", CHIPS["v5p"].peak_bf16), ("TPU v6 lite", CHIPS["v6e"].peak_bf16),
    ("TPU v6e", CHIPS["v6e"].peak_bf16),
]


def published_peak(kind: str) -> float | None:
    """The published dense bf16 peak of a jax device_kind, or None for a chip not listed."""
    return next((peak for name, peak in KIND_PEAKS if name.lower() in kind.lower()), None)


# Cloud slice names -> the topology libtpu understands; v5p's suffix counts TensorCores (two per chip), v5e/v6e's
# chips.
_TPU_TOPOLOGY = {"v5e": "v5e", "v6e": "v6e", "v5p": "v5"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16", 8960: "16x20x28"}
_HELP = ("a TPU slice (v5e-4, v5p-16, v6e-8, or JAX's v5e:2x2 / v5:2x2x2) or NVIDIA GPUs (h100:8, h200:8, a100:8, "
         "b200:8; several hosts as h100:2x8)")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a program is compiled for: the chip, how many devices, and the topology arguments that describe them."""

    name: str
    chip: Chip
    devices: int
    topology: str  # libtpu's topology name (v5e:2x2), or the GPU topology "hosts x 1 x per-host"
    hosts: int = 1

    @property
    def platform(self) -> str:
        return self.chip.platform


def _tpu(name: str, gen: str, shape: str) -> Target:
    dims = [int(d) for d in shape.split("x")]
    return Target(name, CHIPS[gen], math.prod(dims), f"{_TPU_TOPOLOGY[gen]}:{shape}")


def parse_target(name: str) -> Target:
    """The Target a name means; TargetError (with the accepted forms) otherwise."""
    text = name.strip().lower()
    if m := re.fullmatch(r"(v5e|v5litepod|v6e|v5p)-(\d+)", text):
        gen, n = {"v5litepod": "v5e"}.get(m[1], m[1]), int(m[2])
        chips, table = (n // 2, _SHAPES_3D) if gen == "v5p" else (n, _SHAPES_2D)
        if (gen == "v5p" and n % 2) or chips not in table:
            sizes = sorted(2 * c for c in _SHAPES_3D) if gen == "v5p" else sorted(_SHAPES_2D)
            raise TargetError(f"target {name!r}: {gen}-{n} is not a slice size; use one of "
                              f"{', '.join(f'{gen}-{s}' for s in sizes)}")
        return _tpu(name, gen, table[chips])
    if m := re.fullmatch(r"(v5e|v6e|v5|v5p):(\d+(?:x\d+){1,2})", text):
        return _tpu(name, {"v5": "v5p"}.get(m[1], m[1]), m[2])
    if m := re.fullmatch(r"(h100|h200|a100|b200):(?:(\d+)x)?(\d+)", text):
        hosts, per = int(m[2] or 1), int(m[3])
        if hosts < 1 or not 1 <= per <= 8:
            raise TargetError(f"target {name!r}: a GPU host holds 1 to 8 GPUs; write hosts x GPUs, e.g. {m[1]}:2x8")
        return Target(name, CHIPS[m[1]], hosts * per, f"{hosts}x1x{per}", hosts)
    raise TargetError(f"unknown target {name!r}; use {_HELP}")


def topology_devices(target: Target) -> list:
    """The target's devices (jax.Device objects of its platform, not attached here); TargetError without its
    compiler."""
    from jax.experimental import topologies

    prepare_environment("cpu")
    try:
        if target.platform == "tpu":
            dims = [int(d) for d in target.topology.partition(":")[2].split("x")]
            # a slice smaller than a host's 2x2 chips (v5e-1, v6e-1) is one host of that many chips
            small = {"chips_per_host_bounds": (dims + [1, 1])[:3]} if math.prod(dims) < 4 else {}
            topo = topologies.get_topology_desc(topology_name=target.topology, platform="tpu",
                                                chip_config_name="default", **small)
        else:
            spec = (SPECS / target.chip.spec).read_text()
            topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=spec,
                                                topology=target.topology)
    except Exception as e:  # the plugin absent, or it refused the topology: the message says which
        extra = "tpu" if target.platform == "tpu" else "cuda"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"cannot describe target {target.name!r} ({first[:160]}); install its compiler: "
                          f"pip install -e \".[{extra}]\"") from None
    devices = list(topo.devices)
    if len(devices) != target.devices:
        raise TargetError(f"target {target.name!r} gave {len(devices)} devices, expected {target.devices}")
    return devices
