"""Main-head validation loss of every variant against training tokens and against training FLOPs."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _mean_curves(res: dict, x: str, y: str = "loss/main") -> dict[str, tuple[list[int], np.ndarray, np.ndarray]]:
    """Per run directory name (d0, d1-seq-..., d0-steps520), the seed-mean `y` at the steps all seeds share."""
    by_name: dict[str, list[dict]] = {}
    for key, c in res["curves"].items():
        by_name.setdefault(key.split("/", 1)[1], []).append({p["step"]: p for p in c["points"]})
    out = {}
    for name, per_seed in by_name.items():
        steps = sorted(set.intersection(*(set(d) for d in per_seed)))
        xs = np.array([per_seed[0][s][x] for s in steps], np.float64)
        ys = np.array([np.mean([d[s][y] for d in per_seed]) for s in steps], np.float64)
        out[name] = (steps, xs, ys)
    return out


def make_plots(res: dict, out_dir: Path) -> list[str]:
    """loss_vs_tokens.png and loss_vs_flops.png in out_dir (and task_vs_... for a task metric); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    steps = res["steps"]
    metrics = [("loss/main", "loss", "main-head validation loss (nats/token)")]
    if res.get("task_metric"):
        metrics.append((res["task_metric"], "task", f"{res['task_metric']} (held-out)"))
    for (y, prefix, ylabel), (x, xlabel) in ((a, b) for a in metrics for b in (("tokens", "training tokens"),
                                                                          ("flops", "training FLOPs"))):
        fname = f"{prefix}_vs_{x}.png"
        fig, ax = plt.subplots(figsize=(7, 4.5))
        curves = _mean_curves(res, x, y)
        for name, (_, xs, ys) in curves.items():
            if name.startswith("d0-steps"):  # separate-mode D=0 runs: only their annealed end point is fair
                ax.plot(xs[-1:], ys[-1:], "k*", ms=9, label=f"D=0 trained {name[8:]} steps" if x == "flops" else None)
                continue
            style = {"color": "black", "lw": 2} if name == "d0" else {}
            ax.plot(xs, ys, "-", label=res["variants"][name]["label"], **style)
        if x == "flops" and res["equal_flops_mode"] == "curve":  # where each variant's equal-FLOPs D=0 is read
            d0_steps, d0x, d0y = curves["d0"]
            at = [d0_steps.index(r["equal_flops"]["d0_steps"]) for r in res["variants"].values() if r["depth"]]
            ax.plot(d0x[at], d0y[at], "ko", mfc="none", ms=8, label="D=0 at each variant's FLOPs")
        if x == "tokens":
            ax.axvline(steps * res["tokens_per_step"], color="grey", ls=":", lw=1)
        n = len(res["seeds"])
        ax.set(xlabel=xlabel, ylabel=ylabel,
               title=f"MTP ablation: {prefix} vs {xlabel} (mean of {n} seed{'s' * (n > 1)})")
        lo = min(ys[len(ys) // 4:].min() for _, _, ys in curves.values() if len(ys))
        hi = max(ys[len(ys) // 4:].max() for _, _, ys in curves.values() if len(ys))
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = Path(out_dir) / fname
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(str(p))
    return paths
