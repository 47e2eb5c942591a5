"""results.json of a sweep from its run directories' eval logs, and the table printed on screen.

Every number comes from the runs' `eval.jsonl` (main-head validation loss and bits per byte, per-depth
loss and teacher-forced agreement, a synthetic source's task metric) plus the step times measured side by
side (`timing.py`). Differences to D=0 are paired by seed (same initialization of the shared parts, same
batches) and reported as mean and sample standard deviation over seeds.

A variant pays on the task metric (`pays`) when its mean difference to D=0 exceeds twice the larger of two
seed spreads: the sample standard deviation of the paired differences and that of D=0's own metric.
"""

from __future__ import annotations

import numpy as np

from bench.ablation.grid import (
    Run,
    Variant,
    d0_run_at,
    equal_flops_steps,
    flops_per_token,
    mode,
)
from bench.common import load
from mtpjax.config import Config, replace
from mtpjax.errors import MtpjaxError
from mtpjax.eval.log import read_evals
from mtpjax.nn.loss import expected_accept_length
from mtpjax.nn.model import build_model, param_counts


class ReportError(MtpjaxError, RuntimeError):
    """A run lacks an eval it should have; one line naming the fix."""


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one seed) and the values themselves."""
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else None, "n": len(a),
            "values": [float(x) for x in a]}


def _at(evals: dict, run: Run, step: int) -> dict:
    rec = evals[run.dir].get(step)
    if rec is None:
        raise ReportError(f"run '{run.dir}' has no eval at step {step}; re-run the sweep (it resumes) to finish it")
    return rec


def task_key(rec: dict) -> str | None:
    """The task metric an eval record holds (mtpjax.eval.task_metrics.NAMES), or None."""
    return next((k for k in sorted(rec) if k.startswith("task/")), None)


def pays(delta: dict, d0: dict) -> bool:
    """Mean difference (higher is better) above twice the larger seed spread (needs >= 2 seeds)."""
    if delta["std"] is None or d0["std"] is None:
        return False
    return delta["mean"] > 2 * max(delta["std"], d0["std"])


def _task(final: dict, d0: dict, seeds: list[int], key: str) -> dict:
    d0s = spread([d0[s][key] for s in seeds])
    delta = spread([final[s][key] - d0[s][key] for s in seeds])
    return {"value": spread([final[s][key] for s in seeds]), "d0": d0s, "delta": delta, "pays": pays(delta, d0s)}


def _curve(recs: dict, tokens_per_step: int, fpt: float) -> list[dict]:
    keep = ("loss/main", "bits_per_byte", *sorted({k for r in recs.values() for k in r if k.startswith("task/")}))
    return [{"step": s, "tokens": s * tokens_per_step, "flops": s * tokens_per_step * fpt,
             **{k: r[k] for k in keep if k in r}} for s, r in sorted(recs.items())]


def _depth_metrics(rec: dict, depth: int) -> dict:
    agree = [rec[f"agreement/mtp_{k}"] for k in range(1, depth + 1)]
    return {"mtp_loss": [rec[f"loss/mtp_{k}"] for k in range(1, depth + 1)], "agreement": agree,
            "expected_tokens_per_round": float(expected_accept_length(agree)) if depth else 1.0}


def _params(cfg: Config) -> dict:
    from flax import nnx

    return param_counts(nnx.eval_shape(lambda: build_model(cfg)))


def collect(base: Config, runs: list[Run], vs: list[Variant], seeds: list[int], steps: int,
            step_times: dict | None = None) -> dict:
    """The results dict of a finished sweep (see the module docstring)."""
    evals = {r.dir: {rec["step"]: rec for rec in read_evals(r.dir)} for r in runs}
    eq_steps = equal_flops_steps(base, vs, steps)
    tokens_per_step = base.train.batch_size * base.data.seq_len
    d0_cfg = replace(base, ["model.mtp_depth=0"])
    f0 = flops_per_token(d0_cfg)
    rows, tkey = {}, None
    for v in vs:
        mine = {r.seed: r for r in runs if r.variant == v and steps in r.stops}
        final = {s: _at(evals, mine[s], steps) for s in seeds}
        d0 = {s: _at(evals, d0_run_at(runs, s, steps), steps) for s in seeds}
        fpt = flops_per_token(mine[seeds[0]].cfg)
        per_seed = {s: _depth_metrics(final[s], v.depth) for s in seeds}
        tkey = task_key(final[seeds[0]])
        row = {"label": v.label, "depth": v.depth, "kind": v.kind if v.depth else None,
               "lambda": v.lam or None, "flops_per_token": fpt, "flops_ratio": fpt / f0,
               "loss_main": spread([final[s]["loss/main"] for s in seeds]),
               "delta_loss_main": spread([final[s]["loss/main"] - d0[s]["loss/main"] for s in seeds]),
               "mtp_loss": [spread([per_seed[s]["mtp_loss"][k] for s in seeds]) for k in range(v.depth)],
               "agreement": [spread([per_seed[s]["agreement"][k] for s in seeds]) for k in range(v.depth)],
               "expected_tokens_per_round": spread([per_seed[s]["expected_tokens_per_round"] for s in seeds])}
        if all("bits_per_byte" in final[s] for s in seeds):
            row["bits_per_byte"] = spread([final[s]["bits_per_byte"] for s in seeds])
            row["delta_bits_per_byte"] = spread([final[s]["bits_per_byte"] - d0[s]["bits_per_byte"] for s in seeds])
        if tkey:
            row["task"] = _task(final, d0, seeds, tkey)
        if v.depth:
            n = eq_steps[v.name]
            d0n = {s: _at(evals, d0_run_at(runs, s, n), n) for s in seeds}
            row["equal_flops"] = {
                "d0_steps": n, "d0_flops_ratio": n / steps,
                "d0_loss_main": spread([d0n[s]["loss/main"] for s in seeds]),
                "delta_loss_main": spread([final[s]["loss/main"] - d0n[s]["loss/main"] for s in seeds])}
            if tkey:
                row["equal_flops"]["task"] = _task(final, d0n, seeds, tkey)
        if step_times and v.name in step_times["variants"]:
            row["step_seconds"] = step_times["variants"][v.name]["seconds"]
            row["step_time_ratio"] = step_times["variants"][v.name]["ratio"]
        rows[v.name] = row
    curves = {str(r.seed) + "/" + r.dir.name: {"variant": r.variant.name, "seed": r.seed,
                                               "points": _curve(evals[r.dir], tokens_per_step, flops_per_token(r.cfg))}
              for r in runs}
    params = _params(d0_cfg)
    m = base.model
    return {
        "scale": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                  "vocab_size": m.vocab_size, "seq_len": base.data.seq_len, "batch_size": base.train.batch_size,
                  "trunk_params": params["trunk"], "shared_embed_head_params": params["shared_embed_head"],
                  "tokenizer": base.data.tokenizer, "source": base.data.source,
                  "eval_tokens": base.train.eval_batches * tokens_per_step},
        "task_metric": tkey, "load_at_report": load(),
        "steps": steps, "tokens": steps * tokens_per_step, "tokens_per_step": tokens_per_step, "seeds": seeds,
        "lr_schedule": base.optim.schedule, "equal_flops_mode": mode(base), "variants": rows, "curves": curves,
        "step_times": step_times}


def loads(out) -> dict | None:
    """The 1-minute load average after each stretch the sweep trained (sweep.LOADS): min / median / max, and the
    wall seconds of training; None before any."""
    import json
    from pathlib import Path

    from bench.ablation.sweep import LOADS

    path = Path(out) / LOADS
    if not path.is_file():
        return None
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    l1 = np.array([r["load"][0] for r in recs])
    return {"stretches": len(recs), "load1_min": float(l1.min()), "load1_median": float(np.median(l1)),
            "load1_max": float(l1.max()), "train_seconds": round(sum(r["seconds"] for r in recs), 1)}


def summary(res: dict) -> dict:
    """The few numbers `python -m mtpjax plan` states (see mtpjax.eval.evidence)."""
    rows = []
    for name, r in res["variants"].items():
        if r["depth"]:
            row = {"variant": name, "label": r["label"], "delta_equal_tokens": r["delta_loss_main"],
                   "delta_equal_flops": r["equal_flops"]["delta_loss_main"]}
            if "task" in r:
                row["task"] = {"equal_tokens": r["task"], "equal_flops": r["equal_flops"]["task"]}
            rows.append(row)
    return {"trunk_params": res["scale"]["trunk_params"], "tokens": res["tokens"], "seeds": len(res["seeds"]),
            "tokenizer": res["scale"]["tokenizer"], "source": res["scale"]["source"],
            "task_metric": res.get("task_metric"), "rows": rows}


def fmt_spread(s: dict | None, digits: int = 4, sign: bool = False) -> str:
    if s is None:
        return "-"
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f.format(s["mean"]) + (f" ± {s['std']:.{digits}f}" if s["std"] is not None else "")


HEAD = ["variant", "loss/main", "bits/byte", "Δ loss vs D=0", "Δ at equal FLOPs (D=0 steps)", "mtp_k loss",
        "agreement_k", "E tok/round", "FLOPs ×", "step time ×"]


def _head(res: dict) -> list[str]:
    t = res.get("task_metric")
    return HEAD + ([t, f"Δ {t} vs D=0", "Δ at equal FLOPs"] if t else [])


def _task_cells(r: dict) -> list[str]:
    t, eqf = r["task"], r.get("equal_flops")
    mark = lambda x: fmt_spread(x["delta"], 3, sign=True) + (" (pays)" if x["pays"] else "")
    return [fmt_spread(t["value"], 3), mark(t) if r["depth"] else "-", mark(eqf["task"]) if eqf else "-"]


def _cells(res: dict) -> list[list[str]]:
    """One row of formatted cells per variant, in _head's order."""
    out = []
    for name, r in res["variants"].items():
        eqf = r.get("equal_flops")
        out.append([
            name, fmt_spread(r["loss_main"]), fmt_spread(r.get("bits_per_byte")),
            fmt_spread(r["delta_loss_main"], sign=True) if r["depth"] else "-",
            f"{fmt_spread(eqf['delta_loss_main'], sign=True)} ({eqf['d0_steps']})" if eqf else "-",
            " / ".join(f"{s['mean']:.3f}" for s in r["mtp_loss"]) or "-",
            " / ".join(f"{s['mean']:.3f}" for s in r["agreement"]) or "-",
            f"{r['expected_tokens_per_round']['mean']:.3f}", f"{r['flops_ratio']:.3f}",
            f"{r['step_time_ratio']:.3f}" if "step_time_ratio" in r else "-",
            *(_task_cells(r) if "task" in r else [])])
    return out


def title(res: dict) -> str:
    return (f"{res['steps']} steps = {res['tokens']:,} tokens per run, {len(res['seeds'])} seed(s) (mean ± sd over "
            f"seeds); trunk {res['scale']['trunk_params'] / 1e6:.2f}M params; validation "
            f"{res['scale']['eval_tokens']:,} tokens; Δ = variant − D=0, paired by seed; equal FLOPs: D=0 after "
            f"steps × FLOPs ratio ({res['equal_flops_mode']} mode, lr schedule {res['lr_schedule']})")


def table(res: dict) -> str:
    """The results as a fixed-width table (one row per variant)."""
    head = _head(res)
    lines = [head, *_cells(res)]
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join([title(res)] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines])


def markdown(res: dict) -> str:
    """The same table in Markdown, for docs/ablation.md: `python -m bench.ablation.report <results.json>`."""
    head = _head(res)
    rows = [head, ["---"] * len(head), *_cells(res)]
    return "\n".join([title(res) + ":", ""] + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    """Print the Markdown table of each results.json given."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m bench.ablation.report", description=markdown.__doc__)
    ap.add_argument("results", nargs="+", help="a sweep's results.json (python -m bench.ablation --report DIR)")
    for path in map(Path, ap.parse_args(argv).results):
        if not path.is_file():
            ap.error(f"{path} is not a file; give a sweep's results.json")
        print(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
