"""mtpjax.train.metrics: the peak MFU divides by (a chip's published one; the measured matmul on CPU)."""

import importlib.util

from mtpjax.train import metrics


def test_matmul_rates_time_every_library_here_within_the_budget():
    rates = metrics.matmul_rates(n=128, seconds=0.15)
    want = {"xla", "numpy"} | ({"torch"} if importlib.util.find_spec("torch") else set())
    assert set(rates) == want and all(r > 0 for r in rates.values())


def test_peak_is_the_best_library_not_xlas(monkeypatch):
    monkeypatch.setattr(metrics, "matmul_rates", lambda n, seconds: {"xla": 1e9, "numpy": 3e9, "torch": 2e9})
    assert metrics.measure_peak_flops() == 3e9


class _Writer:
    """Records what a run writes to TensorBoard."""

    def __init__(self):
        self.texts, self.scalar = {}, {}

    def text(self, step, tag, text):
        self.texts[tag] = text

    def scalars(self, step, values, prefix=""):
        self.scalar.update({prefix + k: v for k, v in values.items()})


def _report_on(monkeypatch, device, **overrides):
    """A run's report job built on a faked platform (jax.devices() answering `device`), and what it wrote."""
    from types import SimpleNamespace

    from mtpjax.config import load_config
    from mtpjax.train import loop

    monkeypatch.setattr(metrics.jax, "devices", lambda *a: [device])
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda: 7e9)
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    writer = _Writer()
    report = loop._Report(cfg, writer, SimpleNamespace(), 1)
    return report, writer


def test_gpu_and_tpu_mfu_use_the_compile_report_s_published_peak(monkeypatch):
    """On a (faked) H100 or TPU v5p the run's TensorBoard MFU divides by the chip table's peak, the one `compile`'s
    report divides by for that target, and says so (log line and TensorBoard text); nothing is measured."""
    from types import SimpleNamespace

    from mtpjax.parallel.targets import parse_target

    for kind, platform, target in (("NVIDIA H100 80GB HBM3", "gpu", "h100:8"), ("TPU v5p", "tpu", "v5p-8")):
        report, writer = _report_on(monkeypatch, SimpleNamespace(platform=platform, device_kind=kind))
        peak = parse_target(target).chip.peak_bf16
        assert report.log.peak == peak  # what Logger's "mfu" scalar divides by
        assert writer.texts["mfu/peak"] == f"MFU against {peak:.4g} FLOP/s per device: published dense bf16 peak " \
                                          f"of {kind}"
        assert metrics.mfu(1000.0, report.log.flops, report.log.peak, 1) == 1000.0 * report.log.flops / peak


def test_companion_the_measured_matmul_only_on_cpu_and_said(monkeypatch):
    """On CPU (and for an accelerator the table lacks) the measured rate is used and the source says so; a configured
    train.peak_flops wins everywhere."""
    from types import SimpleNamespace

    report, writer = _report_on(monkeypatch, SimpleNamespace(platform="cpu", device_kind="cpu"))
    assert report.log.peak == 7e9 and "measured float32 matmul rate (CPU" in writer.texts["mfu/peak"]
    unknown = metrics.device_peak(0.0, SimpleNamespace(platform="gpu", device_kind="Quantum X1"))
    assert unknown.flops == 7e9 and "not in parallel.targets' chip table; set train.peak_flops" in unknown.source
    report, writer = _report_on(monkeypatch, SimpleNamespace(platform="gpu", device_kind="NVIDIA H100"),
                                **{"train.peak_flops": 5e14})
    assert report.log.peak == 5e14 and writer.texts["mfu/peak"].endswith("train.peak_flops")


def test_a_resumed_run_says_its_mfu_peak_at_its_first_step(monkeypatch):
    """The peak MFU divides by is said in TensorBoard's text `mfu/peak` at the process's first step: a resumed run
    (on CPU the peak is measured anew) no longer adds a second, different text at step 0."""
    from types import SimpleNamespace

    from mtpjax.config import load_config
    from mtpjax.train import loop

    monkeypatch.setattr(metrics, "measure_peak_flops", lambda: 7e9)
    cfg = load_config(None, [])
    for start in (0, 250):
        said = []
        writer = SimpleNamespace(text=lambda step, tag, text, said=said: said.append((step, tag)))
        loop._Report(cfg, writer, SimpleNamespace(), 1, start)
        assert said == [(start, "mfu/peak")]
