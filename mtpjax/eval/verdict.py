"""One line, under decode.py's numbers, saying why speculation lost where it did (and where it would pay instead).

The cause is read off the run's own measurements: v, verifying a round's γ+1 tokens over one plain step (1 where a
step waits on reading the weights, about γ+1 where it is compute-bound, as a small model in a CPU's cache is); c,
a draft's cost over a plain step; and the ceiling E/(1 + γr). The docs section it points to explains the regimes.
"""

from __future__ import annotations

DOCS = "docs/decoding.md#when-speculation-pays"


def eval_line(d: dict, prefix: str = "", what: str = "MTP") -> str | None:
    """For decode.py --eval's report (its `decode` part): the line when `what` decoded slower than plain, else None."""
    speedup = d.get(f"{prefix}speedup")
    if speedup is None or speedup >= 1.0:
        return None
    v, g = d["verify_cost_v"], d["gamma"]
    return (f"why {what} is slower here ({speedup:.2f}x): verifying {g + 1} tokens costs v={v:.2f} plain steps, a "
            f"draft c={d[f'{prefix}draft_cost_c']:.2f}, a round {d[f'{prefix}round_cost']:.2f} for "
            f"{d[f'{prefix}tokens_per_round']:.2f} tokens: {_regime(v, g)} (ceiling "
            f"{d[f'{prefix}speedup_ceiling']:.2f}; {DOCS})")


def stats_line(cal: dict, label: str) -> str | None:
    """For decode.py --stats after auto measured: the line when plain won, from the best chain's cost and E."""
    why = plain_reason(cal, label)
    return None if why is None else f"[why plain] {why}"


def plain_reason(cal: dict, label: str) -> str | None:
    """Why auto's measurement `cal` chose plain (the best chain's cost against its tokens); None if it drafted."""
    chains = {name: c for name, c in cal["round_cost"].items() if name.isdigit() and int(name) > 0}
    if cal["drafts"] != 0 or not chains:
        return None
    g = max(chains, key=lambda k: cal["expected_tokens"][k] / chains[k])
    e, cost = cal["expected_tokens"][g], chains[g]
    return (f"a round of {label} draft={g} costs {cost:.2f} plain steps for {e:.2f} tokens "
            f"({e / cost:.2f}x): {_regime(cost, int(g))} ({DOCS})")


def _regime(cost: float, g: int) -> str:
    """The cause a round's cost over plain names: compute-bound if it nears its γ+1 rows, else the drafts' price."""
    if cost >= 1 + 0.5 * g:
        return ("the decode step is compute-bound (a small model in the CPU's cache); speculation pays where a step "
                "waits on reading the weights")
    return "the drafts cost more than their accepted tokens save"
