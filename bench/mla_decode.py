"""MLA vs GQA at equal width: decode cache bytes per token and plain greedy decode time per token at batch 1.

    python bench/mla_decode.py [--d-model 256] [--layers 4] [--heads 8] [--rounds 5]

Random models that differ only in their attention (one process; the models' timings interleaved round by round,
each a slope between a short and a long generation of one compiled loop, so prefill and compile drop out). The
cache bytes per token count every trunk layer, from mtpjax.nn.flops.cache_numbers_per_token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtpjax.config import ModelConfig  # noqa: E402
from mtpjax.nn.flops import cache_numbers_per_token  # noqa: E402


def variants(d: int, layers: int, heads: int) -> dict[str, ModelConfig]:
    """GQA with every, half and a quarter of the heads as KV heads, and MLA with a latent of d/4 (DeepSeek-V3's
    ratio of rope to latent width, 1/8, and per-head widths of GQA's head_dim)."""
    hd = d // heads
    base = dict(d_model=d, n_layers=layers, n_heads=heads, vocab_size=1024, mtp_depth=0)
    out = {f"gqa kv={k}": ModelConfig(**base, n_kv_heads=k) for k in (heads, heads // 2, heads // 4)}
    out["mla"] = ModelConfig(**base, n_kv_heads=heads, attention_kind="mla", kv_lora_rank=d // 4, q_lora_rank=0,
                             qk_nope_head_dim=hd, qk_rope_head_dim=d // 32, v_head_dim=hd)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=448)
    ap.add_argument("--relaid", action="store_true",
                    help="add 'mla relaid': the same MLA model decoding without its up-projections laid out before the "
                         "loop (every step re-lays them, as without decode_view)")
    args = ap.parse_args(argv)
    from unittest import mock

    from flax import nnx

    from mtpjax.decode import loop as decode_loop
    from mtpjax.decode import make_loop, run
    from mtpjax.nn.model import build_model

    cfgs = variants(args.d_model, args.layers, args.heads)
    prompt = list(range(1, 65))
    loops = {}
    if args.relaid:  # another init_std: another graph, so its own compiled loop; the same weights copied in below
        cfgs["mla relaid"] = cfgs["mla"].model_copy(update={"init_std": cfgs["mla"].init_std * (1 + 1e-6)})
    for name, cfg in cfgs.items():
        model = build_model(cfg, seed=0)
        if name == "mla relaid":
            nnx.update(model, nnx.state(loops["mla"][0]))
        loops[name] = (model, make_loop(model, [prompt], max_new_tokens=args.long, draft=0,
                                        max_len=len(prompt) + args.long))

    def timed(name, budget):
        model, loop = loops[name]
        t = time.perf_counter()
        jax.block_until_ready(run(model, [prompt], loop, budget=budget).n_B)
        return time.perf_counter() - t

    for name in cfgs:  # compile
        if name == "mla relaid":
            with mock.patch.object(decode_loop, "decode_view", lambda m: m):
                timed(name, args.short)
        else:
            timed(name, args.short)
    slopes = {name: [] for name in cfgs}
    for _ in range(args.rounds):
        for name in cfgs:
            slopes[name].append((timed(name, args.long) - timed(name, args.short)) / (args.long - args.short))
    ref = "gqa kv=" + str(args.heads // 4)
    print(f"d_model={args.d_model} layers={args.layers} heads={args.heads} float32 batch 1, prompt {len(prompt)}, "
          f"tokens {args.short}..{args.long}; load average {os.getloadavg()[0]:.2f}")
    print("| attention | cache numbers per token and layer | cache bytes per token (all layers) | vs MHA | "
          f"us per token | vs {ref} |")
    print("|---|---|---|---|---|---|")
    mha = cache_numbers_per_token(cfgs[f"gqa kv={args.heads}"])
    t_ref = float(np.median(slopes[ref]))
    for name, cfg in cfgs.items():
        n = cache_numbers_per_token(cfg)
        t = float(np.median(slopes[name]))
        print(f"| {name} | {n} | {n * cfg.n_layers * 4:,d} | {n / mha:.3f} | {t * 1e6:.0f} | {t / t_ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
