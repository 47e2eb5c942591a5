"""Benchmark suite: every comparison runs side by side in one process and is reported as ratios.

    python -m bench            # full suite: training MFU, MTP overhead, decoding vs the PyTorch peer, plots
    python -m bench --smoke    # seconds: tiny shapes, few steps (what tests/test_bench.py runs)
"""
