"""The attention fix side by side: train steps with layers.attend (head-major, hand-written backward) and with
the autodiff formulation it replaced, interleaved rounds in one process, step-time ratio as the median of rounds.

    python -m bench.attention_ab [--config configs/tiny.yaml] [--rounds 7] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleave, log, median_ratio
from bench.train_throughput import make_stepper
from mtpjax.config import load_config
from mtpjax.nn import layers


def autodiff_attend(q_BTKRH, k_BSKH, v_BSKH, bias_BTS, causal_blocks: int = 1):
    """The formulation before issue 29: token-major full T×T scores, backward by autodiff (no causal blocks)."""
    s_BKRTS = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=jnp.float32)
    s_BKRTS = s_BKRTS + bias_BTS[:, None, None]
    e_BKRTS = jnp.exp(s_BKRTS - jax.lax.stop_gradient(s_BKRTS.max(axis=-1, keepdims=True)))
    l_BKRT = e_BKRTS.sum(axis=-1)
    o_BTKRH = jnp.einsum("bkrts,bskh->btkrh", e_BKRTS.astype(v_BSKH.dtype), v_BSKH, preferred_element_type=jnp.float32)
    return o_BTKRH / l_BKRT.transpose(0, 3, 1, 2)[..., None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    new = make_stepper(cfg)  # traced and compiled now, with the current attend
    current, layers.attend = layers.attend, autodiff_attend
    try:
        old = make_stepper(cfg)
    finally:
        layers.attend = current
    cpu: dict = {}
    t = interleave({"head-major": new, "autodiff": old}, args.rounds, cpu=cpu)
    log(f"{args.config} {' '.join(args.overrides)}: head-major {np.median(t['head-major']) * 1e3:.0f} ms/step, "
        f"autodiff {np.median(t['autodiff']) * 1e3:.0f} ms/step, step time ratio new/old "
        f"{median_ratio(t['head-major'], t['autodiff']):.3f}, CPU time ratio "
        f"{median_ratio(cpu['head-major'], cpu['autodiff']):.3f} (medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
