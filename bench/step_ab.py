"""Train-step variants side by side in one process: XLA CPU compiler options and one code change (gate and up
projections as one matmul), interleaved rounds, each step-time ratio to the default as the median of rounds.

    python -m bench.step_ab [--config configs/tiny.yaml] [--rounds 9] [--variants default,no_ynn,...] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleave, log, median_ratio
from bench.train_throughput import compiled_step
from mtpjax.config import load_config
from mtpjax.nn import layers

YNN = "xla_cpu_experimental_ynn_fusion_type"
# compiler options per variant (jax's Lowered.compile(compiler_options=...): per program, so one process holds all)
OPTIONS = {
    "default": {},
    "no_ynn": {YNN: ""},  # dots by XLA's own (Eigen) kernels instead of YNNPACK fusions
    "ynn_eltwise": {YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"},
    "ynn_all": {YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
    "xnn_graph": {"xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
    "no_concurrency_scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "fused_gate_up": {},  # code, not options: see fused_mlp
}


def fused_mlp(self, x):
    """layers.MLP with gate and up as one [d, 2f] matmul over their concatenated kernels (the same weights)."""
    x2 = x.reshape(-1, x.shape[-1]).astype(self.gate.dtype)
    gu = jnp.dot(x2, jnp.concatenate([self.gate.kernel[...], self.up.kernel[...]], axis=1).astype(self.gate.dtype))
    f = self.gate.kernel.shape[1]
    return self.down((jax.nn.silu(gu[:, :f]) * gu[:, f:]).reshape(*x.shape[:-1], f))


def stepper(cfg, name: str):
    """A closure running one train step of variant `name` on the fixed random batch, returning its metrics (compiled,
    warmed up)."""
    with mock.patch.object(layers.MLP, "__call__", fused_mlp) if name == "fused_gate_up" else contextlib.nullcontext():
        return compiled_step(cfg, OPTIONS[name] or None)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variants", default=",".join(OPTIONS), help=f"comma-separated, of: {', '.join(OPTIONS)}")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    names = ["default", *(n for n in args.variants.split(",") if n != "default")]
    steps = {n: stepper(cfg, n) for n in names}
    t = interleave(steps, args.rounds)
    log(f"{args.config} {' '.join(args.overrides)}, {args.rounds} interleaved rounds")
    print("| variant | ms/step | step time / default |\n|---|---|---|")
    for n in names:
        print(f"| {n} | {np.median(t[n]) * 1e3:.1f} | {median_ratio(t[n], t['default']):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
