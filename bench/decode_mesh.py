"""Plain and MTP decoding on one host device and on two (tensor=2), one process, variants interleaved per round.

The process emulates two host devices (--xla_force_host_platform_device_count=2); "one device" is the model on the
first of them, "tensor=2" the same weights sharded by the training rules (mtpjax.decode.mesh.on_mesh). The model has
random weights (configs/cpu_mesh.yaml: ~1.6 GB of float32 weights, a step waits on memory), so its own drafts are
never accepted. The MTP rows therefore run at a given acceptance (`--alpha`, e.g. one measured on a trained run): each
round does the real decoder's work (draft, verify γ+1 tokens, commit, propose) and then advances as if draft k had
been accepted with probability α_k given the ones before it (`AtRate`), so a round's cost is measured and its length
is a trained model's. `--num-draft auto` is what `autodraft.calibrate` chooses among plain and the chains 1..depth
(its trees are left out: AtRate forces chains only) on each mesh and batch, under the same acceptance. Ratios are
medians of per-round ratios; the load average is printed beside each.

    nice python -m bench.decode_mesh --config configs/cpu_mesh.yaml --batches 1,8,32 --alpha 0.8,0.6 \
        --json bench/decode_mesh.json
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import interleave, json_path, load, log, median_ratio, write_json  # noqa: E402
from mtpjax.config import MeshConfig, load_config  # noqa: E402
from mtpjax.decode import autodraft, make_loop, run, summarize  # noqa: E402
from mtpjax.decode.cache import take_rows  # noqa: E402
from mtpjax.decode.loop import Loop  # noqa: E402
from mtpjax.drafts import chain  # noqa: E402
from mtpjax.decode.mesh import on_mesh  # noqa: E402
from mtpjax.decode.sampling import row_keys  # noqa: E402
from mtpjax.nn.model import build_model  # noqa: E402
from mtpjax.parallel.sharding import make_mesh  # noqa: E402

FORCED = 3  # the row_keys tag of AtRate's draws (the loop's own samplers use 0-2)


@dataclasses.dataclass(frozen=True)
class AtRate(Loop):
    """A greedy chain's loop whose rounds accept draft k with probability alpha[k] given the ones before it, whatever
    the target says; the target's token after the accepted drafts is committed as usual, so the caches stay a
    prefill of the committed sequence and every round does a real round's work."""

    alpha: tuple = ()

    def accept(self, logits_BYV, st, it):
        B, Y, _ = logits_BYV.shape
        u_BG = jax.vmap(lambda k: jax.random.uniform(k, (Y - 1,)))(row_keys(st.key, FORCED, it, B))
        a_B = jnp.cumprod(u_BG < jnp.asarray(self.alpha[: Y - 1])[None, :], axis=1).sum(axis=1).astype(jnp.int32)
        bonus_B = take_rows(jnp.argmax(logits_BYV, axis=-1).astype(jnp.int32), a_B)
        i = jnp.arange(Y)[None, :]
        toks_BY = jnp.where(i < a_B[:, None], jnp.pad(st.drafts_BG, ((0, 0), (0, 1))), bonus_B[:, None])
        return a_B, toks_BY, jnp.broadcast_to(i, (B, Y))


def loops_for(model, prompts, args) -> dict:
    """γ -> the loop: plain, and the chains 1..mtp_depth at the forced acceptance."""
    out = {}
    for g in range(model.cfg.mtp_depth + 1):
        loop = make_loop(model, prompts, max_new_tokens=args.max_new, draft=g)
        out[chain(g)] = loop if g == 0 else AtRate(**{f.name: getattr(loop, f.name) for f in dataclasses.fields(loop)},
                                            alpha=tuple(args.alpha))
    return out


def bench_batch(models: dict, batch: int, args) -> dict:
    """Seconds per generation of each variant at this batch size, auto's choice per mesh, and the issue's ratios."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, models["one"].cfg.vocab_size, (batch, args.prompt_len)).tolist()
    fns, outputs, auto, alpha = {}, {}, {}, {}
    for where, model in models.items():
        loops = loops_for(model, prompts, args)
        cal = autodraft.calibrate(model, prompts, loops)  # compiles every loop, which the timing below reuses
        named = cal.as_dict()
        auto[where] = {"choice": cal.choice.size, "round_cost": named["round_cost"],
                       "expected_tokens": named["expected_tokens"], "alpha_by_position": cal.alpha_by_position}
        for t, loop in loops.items():
            g = t.size
            name = f"{'plain' if g == 0 else f'mtp{g}'}_{where}"
            if where == "one" and t not in (chain(0), cal.choice):
                continue  # one device: plain and auto's choice only (the goals compare MTP on tensor=2)
            res = summarize(run(model, prompts, loop), loop.tree)
            outputs[name] = res.tokens
            if g:
                alpha[name] = res.stats["acceptance_by_position"]
            fns[name] = lambda m=model, lp=loop: jax.block_until_ready(run(m, prompts, lp).n_B)
    before = load()
    secs = interleave(fns, args.rounds)
    tokens = batch * args.max_new
    vs = {w: {k: median_ratio(secs[f"plain_{w}"], secs[k]) for k in secs if k.endswith(w)} for w in models}
    out = {"batch": batch, "load_before": before, "load_after": load(),
           "tokens_per_sec": {k: tokens / float(np.median(v)) for k, v in secs.items()},
           "vs_plain_same_mesh": vs, "auto": auto, "measured_alpha": alpha,
           "tensor2_vs_one": median_ratio(secs["plain_one"], secs["plain_tensor2"]),
           "plain_identical": outputs["plain_one"] == outputs["plain_tensor2"],
           "forced_identical": all(outputs[k] == outputs[k.replace("one", "tensor2")]
                                   for k in outputs if k.startswith("mtp") and k.endswith("one"))}
    log(f"batch {batch}: {json.dumps(out, default=str)}")
    return out


def _auto(r: dict, where: str) -> str:
    c = r["auto"][where]["choice"]
    return "plain" if c == 0 else f"γ={c} ({r['vs_plain_same_mesh'][where][f'mtp{c}_{where}']:.2f}x)"


def markdown_table(results: list[dict], depth: int) -> str:
    mtp = [f"mtp{g}_tensor2" for g in range(1, depth + 1)]
    rows = ["| batch | plain, 1 device (tok/s) | plain, tensor=2 (tok/s) | tensor=2 / one | "
            + " | ".join(f"MTP γ={g} / plain, tensor=2" for g in range(1, depth + 1))
            + " | auto's choice, 1 device (/ plain) | auto's choice, tensor=2 (/ plain) | α reached (γ=" + str(depth)
            + ", tensor=2) | load (1 min) |", "|---" * (8 + depth) + "|"]
    for r in results:
        t, v = r["tokens_per_sec"], r["vs_plain_same_mesh"]["tensor2"]
        rows.append(f"| {r['batch']} | {t['plain_one']:.2f} | {t['plain_tensor2']:.2f} | {r['tensor2_vs_one']:.2f}x | "
                    + " | ".join(f"{v[k]:.2f}x" for k in mtp)
                    + f" | {_auto(r, 'one')} | {_auto(r, 'tensor2')} | "
                    + ", ".join(f"{a:.2f}" for a in r["measured_alpha"][mtp[-1]])
                    + f" | {r['load_before'][0]:.1f} - {r['load_after'][0]:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cpu_mesh.yaml")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--alpha", type=lambda s: [float(a) for a in s.split(",")], required=True,
                    help="acceptance by draft position the MTP rows run at (one per MTP module), e.g. 0.8,0.6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=json_path, help="write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides (a smaller model to try the bench)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if len(args.alpha) != cfg.model.mtp_depth:
        ap.error(f"--alpha gives {len(args.alpha)} acceptances; the model has {cfg.model.mtp_depth} MTP modules")
    one = build_model(cfg, seed=0)
    models = {"one": one, "tensor2": on_mesh(one, make_mesh(MeshConfig(tensor=2)))}
    log(f"{args.config}: {sum(x.nbytes for x in jax.tree.leaves(nnx.state(one))) / 2**30:.2f} GiB of weights")
    results = [bench_batch(models, int(b), args) for b in args.batches.split(",")]
    print(markdown_table(results, cfg.model.mtp_depth))
    if args.json:
        write_json(args.json, {"config": args.config, "args": vars(args), "results": results}, 1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
