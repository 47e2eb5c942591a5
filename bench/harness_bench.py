"""lm-eval throughput: our backend vs the harness's `hf` backend on the same weights (our Qwen2-layout export), one
process, interleaved rounds.

    python bench/harness_bench.py --run-dir runs/tiny [--docs 200] [--prompts 32] [--max-gen 64] [--rounds 3]

Loglikelihood: the shipped multiple-choice task's requests (docs x 4 choices), tokens/s = the requests' context +
continuation tokens over seconds. Generation: the shipped generation task's prompts, greedy, no stop sequence, so
both backends generate exactly --max-gen tokens per row (the `hf` backend's stopping would otherwise end its
batches early while our loop runs its whole budget); tokens/s = generated tokens over seconds, ours at
num_draft 0, 1 and what `auto` chose. Same batch size for both; each is run once before the timed rounds
(our compiles, torch's first-call costs). Greedy outputs are checked equal on the way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleave, json_path, load, log, write_json  # noqa: E402


def requests(docs: int, prompts: int, max_gen: int):
    """(loglikelihood Instances, generate_until Instances) from the shipped tasks' data."""
    from lm_eval.api.instance import Instance

    from mtpjax.eval.tasks import HERE

    read = lambda name, n: [json.loads(x) for x in (HERE / name).read_text().splitlines()[:n]]
    ll = [Instance(request_type="loglikelihood", doc=d, arguments=(d["context"], c), idx=i)
          for d in read("nextline.jsonl", docs) for i, c in enumerate(d["choices"])]
    kw = {"until": [], "max_gen_toks": max_gen, "do_sample": False}
    gen = [Instance(request_type="generate_until", doc=d, arguments=(d["prompt"], dict(kw)), idx=0)
           for d in read("funcret.jsonl", prompts)]
    return ll, gen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", default="runs/tiny")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-gen", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=json_path)
    a = p.parse_args(argv)

    import absl.logging
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    from mtpjax.cli.lm_eval import load_lm
    from mtpjax.convert import export_run

    absl.logging.set_verbosity(absl.logging.ERROR)
    hf_dir = Path(tempfile.mkdtemp(prefix="harness-bench-")) / "hf"
    export_run(a.run_dir, hf_dir, step=a.step)
    ours = {g: load_lm(a.run_dir, a.step, batch_size=a.batch_size, draft=g, max_gen_toks=a.max_gen)
            for g in (0, 1, "auto")}
    # the same truncation as ours (data.seq_len; the export's max_position_embeddings is longer)
    hf = HFLM(pretrained=str(hf_dir), tokenizer=PreTrainedTokenizerFast.from_pretrained(str(hf_dir)),
              backend="causal", dtype="float32", batch_size=a.batch_size, device="cpu", max_length=ours[0].max_length)
    ll, gen = requests(a.docs, a.prompts, a.max_gen)
    tok = ours[0].tok
    ll_tokens = sum(len(tok.encode(r.args[0] + r.args[1])) for r in ll)
    gen_tokens = len(gen) * a.max_gen

    log("warm-up: compiles, auto's calibration, and the greedy outputs compared")
    ref = hf.generate_until(gen)
    same = {g: lm.generate_until(gen) == ref for g, lm in ours.items()}
    hf.loglikelihood(ll)
    ours[0].loglikelihood(ll)
    chosen = ours["auto"].chosen
    fns = {"ll_ours": lambda: ours[0].loglikelihood(ll), "ll_hf": lambda: hf.loglikelihood(ll),
           "gen_hf": lambda: hf.generate_until(gen)}
    fns |= {f"gen_ours_{g}": (lambda lm=lm: lm.generate_until(gen)) for g, lm in ours.items()}
    cpu: dict = {}
    t0 = time.perf_counter()
    secs = interleave(fns, a.rounds, cpu=cpu)
    med = {k: float(np.median(v)) for k, v in secs.items()}
    rate = {k: (ll_tokens if k.startswith("ll") else gen_tokens) / v for k, v in med.items()}
    out = {"run_dir": a.run_dir, "batch_size": a.batch_size, "ll_requests": len(ll), "ll_tokens": ll_tokens,
           "gen_rows": len(gen), "gen_tokens": gen_tokens, "auto_chose": chosen, "greedy_equal_to_hf": same,
           "seconds_median": med, "cpu_seconds_median": {k: float(np.median(v)) for k, v in cpu.items()},
           "tokens_per_sec": rate, "ll_ratio": rate["ll_ours"] / rate["ll_hf"],
           "gen_ratio_vs_hf": {g: rate[f"gen_ours_{g}"] / rate["gen_hf"] for g in ours},
           "load": load(), "wall_seconds": time.perf_counter() - t0}
    print(json.dumps(out, indent=1))
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
