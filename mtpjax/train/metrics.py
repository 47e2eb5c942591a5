"""TensorBoard writing (process 0 only) and MFU: FLOPs/token from mtpjax.nn.flops against a peak FLOP/s (device_peak:
the chip's published peak wherever the platform is known, the measured matmul rate only on CPU)."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.parallel.targets import published_peak


def _rate(call, flops: float, seconds: float) -> float:
    """FLOP/s of `call` (one warm-up, then repeated for about `seconds`)."""
    call()
    calls, t0 = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return flops * calls / dt


def matmul_rates(n: int = 1024, seconds: float = 1.0) -> dict[str, float]:
    """FLOP/s of a float32 n×n matmul chain in each library that runs here (xla, numpy, torch), `seconds` in all."""
    flops = 3 * 2.0 * n**3  # 3 matmuls per call keeps dispatch overhead small
    x = jnp.ones((n, n), jnp.float32) / n
    f = jax.jit(lambda a: a @ a @ a @ a)
    a = np.ones((n, n), np.float32) / n
    calls = {"xla": lambda: f(x).block_until_ready(), "numpy": lambda: a @ a @ a @ a}
    if importlib.util.find_spec("torch") is not None:  # optional: the peer benchmark's library
        import torch

        t = torch.from_numpy(a)
        calls["torch"] = lambda: t @ t @ t @ t
    return {name: _rate(call, flops, seconds / len(calls)) for name, call in calls.items()}


def measure_peak_flops(n: int = 1024, seconds: float = 1.0) -> float:
    """The best float32 matmul FLOP/s this machine reaches with any library here (matmul_rates), not XLA's alone:
    MFU then says how far the step is from what the hardware is known to do."""
    return max(matmul_rates(n, seconds).values())


@dataclass(frozen=True)
class Peak:
    """The per-device peak FLOP/s a run's MFU divides by, and where it came from (said in the log and TensorBoard)."""

    flops: float
    source: str


def device_peak(configured: float = 0.0, device=None) -> Peak:
    """train.peak_flops when set; else, on a GPU or TPU, the chip's published dense bf16 peak from
    parallel.targets' table (the one a `compile` report divides by); the measured float32 matmul rate only on CPU,
    or for an accelerator the table does not list (then said, with the fix)."""
    if configured:
        return Peak(configured, "train.peak_flops")
    dev = device or jax.devices()[0]
    if dev.platform == "cpu":
        return Peak(measure_peak_flops(), "measured float32 matmul rate (CPU: no published peak)")
    peak = published_peak(dev.device_kind)
    if peak:
        return Peak(peak, f"published dense bf16 peak of {dev.device_kind}")
    return Peak(measure_peak_flops(), f"measured float32 matmul rate ({dev.device_kind} is not in parallel.targets' "
                                      "chip table; set train.peak_flops to its peak)")


def mfu(tokens_per_sec: float, flops_per_token: float, peak_flops_per_device: float, n_devices: int) -> float:
    """Model FLOPs utilization: achieved training FLOP/s over the devices' combined peak."""
    return tokens_per_sec * flops_per_token / (peak_flops_per_device * n_devices)


class Writer:
    """tensorboardX SummaryWriter under `<run_dir>/tensorboard`; a no-op when disabled (processes > 0)."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, purge_step: int | None = None):
        self.tb, self.held = None, None  # held: (step, scalars) of `latest`, not yet written
        if enabled:
            from tensorboardX import SummaryWriter

            # a resumed run purges what an interrupted one logged past its checkpoint: each step is logged once
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge_step)

    def scalars(self, step: int, values: dict, prefix: str = "") -> None:
        """One scalar per key (keys are TensorBoard tags)."""
        if self.tb is None:
            return
        for k, v in values.items():
            v = float(np.asarray(v))
            if np.isfinite(v):
                self.tb.add_scalar(prefix + k, v, step)

    def latest(self, step: int, values: dict) -> None:
        """Scalars a run may update again at the same step (goodput at an eval, a checkpoint and the end of one step):
        one point per step, the last values given, written once a later step's come or at `close`."""
        if self.held is not None and self.held[0] != step:
            self.scalars(*self.held)
        self.held = (step, values)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text entry (config, generated samples); markdown, so wrap code in a block."""
        if self.tb is not None:
            self.tb.add_text(tag, "```\n" + text + "\n```", step)

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        if self.held is not None:
            self.scalars(*self.held)
            self.held = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
