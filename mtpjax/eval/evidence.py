"""Does MTP help the main model at this scale? The project's own ablation next to the published results.

`python -m mtpjax plan` prints these lines. The measured part is read from the committed sweeps
(`bench/ablation/results.json`, written by `python -m bench.ablation`, and the seed spread measured at a
smaller size, `bench/ablation/seeds/results.json`); until they exist the plan says "not yet measured".
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "ablation" / "results.json"  # mtpjax/eval/ -> the root
SEEDS = RESULTS.parent / "seeds" / "results.json"
# The sweeps of issue 41 (docs/ablation.md): the byte-level corpus at D = 0, 1, 3, 7, and the synthetic tasks
TASKS = {name: RESULTS.parent / name / "results.json" for name in ("bytes", "induction", "algorithmic")}

# One sentence on what the committed sweep shows, written by whoever commits it (None: nothing to add yet).
CONCLUSION: str | None = (
    "at equal tokens MTP changed the main head's loss by less than the seed spread (recorded: -0.03, one seed; "
    "re-run, 2 seeds: -0.030 to +0.024 against a D=0 spread of 0.043); at equal training FLOPs D=0 was better by "
    "0.045-0.146 nats/token in every seed: at 1-4M parameters MTP does not pay for itself as a pretraining objective "
    "(as Gloeckle et al. found for small models); its use here is the draft modules (docs/ablation.md)")

PUBLISHED = [
    ("DeepSeek-V3 (2024, §4.5.1): one sequential MTP module added to MoE baselines of 15.7B parameters "
    "(1.33T tokens) and 228.7B (540B tokens), same data: better on most benchmarks at both scales "
    "(equal tokens; the module is dropped at inference)"),
    ("Gloeckle et al. (2024, §3.1): 4 parallel heads at equal parameter count, code, 0.3B-13B models: worse than "
    "next-token prediction on MBPP / HumanEval for the small ones, better from ~7B (6.7B, 13B)"),
]


def _delta(s: dict) -> str:
    sd = f" ± {s['std']:.3f}" if s.get("std") is not None else ""
    return f"{s['mean']:+.3f}{sd}"


def _summary(path: Path):
    """A committed sweep's summary (None if there is none)."""
    try:
        return json.loads(Path(path).read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return None


def _rows(res: dict, indent: str) -> list[str]:
    return [f"{indent}{r['label']:<34} {_delta(r['delta_equal_tokens'])} at equal tokens, "
            f"{_delta(r['delta_equal_flops'])} at equal training FLOPs" for r in res["rows"]]


def _scale(res: dict) -> str:
    return (f"{res['trunk_params'] / 1e6:.1f}M-parameter trunk, {res['tokens'] / 1e6:.2f}M tokens, "
            f"{res['tokenizer']} tokens of the {res['source']} corpus, {res['seeds']} seed(s)")


def _best(res: dict, key) -> dict:
    return max(res["rows"], key=key)


def _task_sweep(name: str, res: dict) -> list[str]:
    """Two lines of one task sweep: its scale, and its best variant on the task metric (bytes: on the loss)."""
    head = f"  {name} sweep ({_scale(res)})"
    if not res.get("task_metric"):
        b = _best(res, lambda r: -r["delta_equal_tokens"]["mean"])
        return [head + ":", f"    best on main-head loss: {b['label']} {_delta(b['delta_equal_tokens'])} at equal "
                f"tokens, {_delta(b['delta_equal_flops'])} at equal training FLOPs"]
    b = _best(res, lambda r: r["task"]["equal_tokens"]["delta"]["mean"])
    t, f = b["task"]["equal_tokens"], b["task"]["equal_flops"]
    word = lambda x: "pays" if x["pays"] else ("one seed: no spread" if x["delta"]["std"] is None else "does not pay")
    return [f"{head}, {res['task_metric']} minus D=0's (positive: MTP helped):",
            f"    best: {b['label']} {_delta(t['delta'])} at equal tokens ({word(t)}), {_delta(f['delta'])} at equal "
            f"training FLOPs ({word(f)})"]


def task_lines(paths: dict | None = None) -> list[str]:
    """The committed task sweeps (TASKS) and the settings where an MTP variant paid on its task metric."""
    found = {n: r for n, p in (paths or TASKS).items() if (r := _summary(p)) is not None}
    if not found:
        return []
    lines = [x for n, r in found.items() for x in _task_sweep(n, r)]
    paid = [f"{n}: {r['label']} at equal {w}" for n, res in found.items() if res.get("task_metric")
            for r in res["rows"] for w in ("tokens", "flops") if r["task"][f"equal_{w}"]["pays"]]
    return lines + [f"  MTP paid on a task metric (beyond twice the seed spread) in: {'; '.join(paid)}" if paid else
                    "  MTP paid on a task metric (beyond twice the seed spread) in no recorded setting"]


def measured_lines(results_path: Path | None = None, seeds_path: Path | None = None,
                   task_paths: dict | None = None) -> list[str]:
    """The committed sweeps' differences in main-head validation loss, or a 'not yet measured' line."""
    res = _summary(results_path or RESULTS)
    if res is None:
        return ["  measured here: not yet measured (python -m bench.ablation writes bench/ablation/results.json)"]
    lines = [(f"  measured here ({_scale(res)}); main-head validation loss of each variant minus D=0's, "
             "nats/token (negative: MTP helped):"), *_rows(res, "    ")]
    spread = _summary(seeds_path or SEEDS)
    if spread is not None:
        lines += [f"  seed spread, measured at a smaller size ({_scale(spread)}):", *_rows(spread, "    ")]
    return lines + task_lines(task_paths) + ([f"  in short: {CONCLUSION}"] if CONCLUSION else [])


def evidence_lines(trunk_params: int, results_path: Path | None = None, seeds_path: Path | None = None) -> list[str]:
    """The plan's section: this config's trunk size, the measurements here, the published results."""
    head = f"does MTP help the main model? this config has a {trunk_params / 1e6:.1f}M-parameter trunk"
    res = _summary(results_path or RESULTS)
    if res is not None and res.get("trunk_params"):
        ratio = trunk_params / res["trunk_params"]
        head += f", {ratio:.3g}x the one measured here"
        # within a decade the measurement speaks for this config; beyond it, the published scales do
        head += " (the measurement applies)" if 0.1 <= ratio <= 10 else " (far from it: see the published results)"
    return [head, *measured_lines(results_path, seeds_path), *(f"  published: {p}" for p in PUBLISHED)]
