"""mtpjax.train.metrics: the matmul peak MFU is measured against."""

import importlib.util

from mtpjax.train import metrics


def test_matmul_rates_time_every_library_here_within_the_budget():
    rates = metrics.matmul_rates(n=128, seconds=0.15)
    want = {"xla", "numpy"} | ({"torch"} if importlib.util.find_spec("torch") else set())
    assert set(rates) == want and all(r > 0 for r in rates.values())


def test_peak_is_the_best_library_not_xlas(monkeypatch):
    monkeypatch.setattr(metrics, "matmul_rates", lambda n, seconds: {"xla": 1e9, "numpy": 3e9, "torch": 2e9})
    assert metrics.measure_peak_flops() == 3e9
