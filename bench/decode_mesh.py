"""Plain and MTP decoding on one host device and on two (tensor=2), one process, variants interleaved per round.

The process emulates two host devices (--xla_force_host_platform_device_count=2); "one device" is the model on the
first of them, "tensor=2" the same weights sharded by the training rules (mtpjax.decode.mesh.on_mesh). The model has
random weights (configs/cpu_mesh.yaml: ~1.6 GB of float32 weights, a step waits on memory), so its MTP modules'
acceptance is a random model's. Ratios are medians of per-round ratios; the load average is printed beside each.

    nice python -m bench.decode_mesh --config configs/cpu_mesh.yaml --batches 1,8,32 --json bench/decode_mesh.json
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import interleave, load, log, median_ratio  # noqa: E402
from mtpjax.config import MeshConfig, load_config  # noqa: E402
from mtpjax.decode import make_loop, run, summarize  # noqa: E402
from mtpjax.decode.mesh import on_mesh  # noqa: E402
from mtpjax.nn.model import build_model  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402


def bench_batch(models: dict, batch: int, args) -> dict:
    """Seconds per generation of each variant at this batch size, and the ratios the issue asks for."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, models["one"].cfg.vocab_size, (batch, args.prompt_len)).tolist()
    variants = {"plain_one": ("one", 0), "plain_tensor2": ("tensor2", 0), "mtp_tensor2": ("tensor2", args.num_draft)}
    fns, outputs = {}, {}
    for name, (where, gamma) in variants.items():
        model = models[where]
        loop = make_loop(model, prompts, max_new_tokens=args.max_new, num_draft=gamma)
        res = summarize(run(model, prompts, loop))  # compiles
        outputs[name] = res.tokens
        fns[name] = lambda m=model, lp=loop: jax.block_until_ready(run(m, prompts, lp).n_B)
    before = load()
    secs = interleave(fns, args.rounds)
    tokens = batch * args.max_new
    out = {"batch": batch, "load_before": before, "load_after": load(),
           "tokens_per_sec": {k: tokens / float(np.median(v)) for k, v in secs.items()},
           "tensor2_vs_one": median_ratio(secs["plain_one"], secs["plain_tensor2"]),
           "mtp_vs_plain_tensor2": median_ratio(secs["plain_tensor2"], secs["mtp_tensor2"]),
           "outputs_identical": outputs["plain_one"] == outputs["plain_tensor2"] == outputs["mtp_tensor2"]}
    log(f"batch {batch}: {json.dumps(out)}")
    return out


def markdown_table(results: list[dict]) -> str:
    rows = ["| batch | plain, 1 device (tok/s) | plain, tensor=2 (tok/s) | MTP γ=2, tensor=2 (tok/s) | tensor=2 / one "
            "| MTP / plain (tensor=2) | load (1 min) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["tokens_per_sec"]
        rows.append(f"| {r['batch']} | {t['plain_one']:.1f} | {t['plain_tensor2']:.1f} | {t['mtp_tensor2']:.1f} "
                    f"| {r['tensor2_vs_one']:.2f}x | {r['mtp_vs_plain_tensor2']:.2f}x "
                    f"| {r['load_before'][0]:.1f} - {r['load_after'][0]:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cpu_mesh.yaml")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--num-draft", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    one = build_model(cfg, seed=0)
    models = {"one": one, "tensor2": on_mesh(one, make_mesh(MeshConfig(tensor=2)))}
    log(f"{args.config}: {sum(x.nbytes for x in jax.tree.leaves(nnx.state(one))) / 2**30:.2f} GiB of weights")
    results = [bench_batch(models, int(b), args) for b in args.batches.split(",")]
    print(markdown_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "args": vars(args), "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
