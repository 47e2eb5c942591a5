"""PNG plots of a results.json: acceptance by draft position, tokens/round and speedup vs num_draft, training vs
depth."""

from __future__ import annotations

from pathlib import Path

from bench.common import mtp_chain


def make_plots(res: dict, out_dir: Path) -> list[str]:
    """Write the three plots next to results.json; returns their paths (empty, with a note, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return []
    paths = []
    dec = res["decode"]["batches"]

    def save(fig, name):
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(str(p))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for b in dec:
        mtps = sorted((k for k in b["variants"] if mtp_chain(k)), key=lambda k: int(k[3:]))
        if mtps:
            a = b["variants"][mtps[-1]]["acceptance_by_position"]
            ax.plot(range(1, len(a) + 1), a, "o-", label=f"batch {b['batch']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="MTP acceptance by draft position", ylim=(0, 1.05))
    ax.legend()
    save(fig, "acceptance_by_position.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for b in dec:
        v = b["variants"]
        gs = [0] + sorted(int(k[3:]) for k in v if mtp_chain(k))
        name = lambda g: "plain" if g == 0 else f"mtp{g}"  # noqa: E731
        a1.plot(gs, [v[name(g)]["tokens_per_round"] for g in gs], "o-", label=f"batch {b['batch']}")
        line = a2.plot(gs, [v[name(g)]["vs_plain"] for g in gs], "o-", label=f"batch {b['batch']} measured")
        a2.plot(gs, [1.0] + [v[name(g)]["predicted_speedup"] for g in gs[1:]], "x--", color=line[0].get_color(),
                label=f"batch {b['batch']} formula")
    a1.set(xlabel="num_draft γ", ylabel="tokens per round", title="Tokens per round")
    a2.set(xlabel="num_draft γ", ylabel="speedup vs plain greedy", title="Speedup: measured vs E/cost")
    a1.legend()
    a2.legend(fontsize=7)
    save(fig, "speedup_vs_num_draft.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, t in res["train"].items():
        if "depths" not in t:  # the PyTorch peer comparison (`<name>_peer`) has no per-depth rows
            continue
        rows = t["depths"]
        ds = sorted(int(d) for d in rows)
        if len(ds) > 1:
            line = ax.plot(ds, [rows[str(d)].get("step_time_ratio", 1.0) for d in ds], "o-", label=f"{name} step time")
            ax.plot(ds, [rows[str(d)].get("flop_ratio", 1.0) for d in ds], "x--", color=line[0].get_color(),
                    label=f"{name} FLOPs")
    ax.set(xlabel="mtp_depth", ylabel="relative to depth 0", title="Training cost vs mtp_depth")
    ax.legend()
    save(fig, "train_vs_depth.png")
    return paths

