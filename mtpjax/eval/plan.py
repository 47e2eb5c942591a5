"""`python -m mtpjax plan --config X [overrides...]`: the MTP plan of a run, printed before launch.

Parameter counts and memory come from the model built abstractly (`nnx.eval_shape`: no memory
allocated) and from AdamW's state built abstractly the same way; FLOPs come from `mtpjax.nn.flops`.
"""

from __future__ import annotations


import jax
import optax
from flax import nnx

from mtpjax.config import Config, ModelConfig
from mtpjax.decode.cache import AttentionCaches
from mtpjax import drafts
from mtpjax.decode.autodraft import PROBED_TREES
from mtpjax.decode.proposers import make_proposer
from mtpjax.drafts import Tree, chain
from mtpjax.nn.flops import flops_per_token
from mtpjax.nn.model import build_model, param_counts
from mtpjax.nn.speed import ceiling, expected_tokens, floor_ratio, verify_cost_of, weight_ratio, work_ratio
from mtpjax.parallel import pipeline


def tree_bytes(tree) -> int:
    """Bytes held by the arrays of a pytree."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def build_plan(cfg: Config, alpha: float = 0.8, draft_cost: float | None = None, max_gamma: int | None = None,
               verify_cost: float | dict = 1.0, alpha_rank2: float | None = None) -> dict:
    """The plan as numbers: parameters, memory, FLOPs per token by depth, and the speculation ceiling per γ and per
    draft tree (auto's shapes and `decode.draft`'s).

    r is mtpjax.nn.speed's floor ratio of MTP drafting (the smaller of the FLOPs it computes, each module
    recomputing its window, and the weights it reads), unless `draft_cost` fixes it for every γ; v(γ+1), the
    cost of verifying γ+1 rows in plain steps, is `verify_cost` (speed.verify_cost_of; 1: free rows). A tree's
    children are accepted at every depth as rank 1 with `alpha`, rank 2 with `alpha_rank2` (default (1 - α)/2:
    half of the first child's misses) and each later rank with half the rank before's."""
    model = nnx.eval_shape(lambda: build_model(cfg))
    counts = param_counts(model)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    o = cfg.optim
    tx = optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    opt_state = jax.eval_shape(tx.init, params)
    fl = flops_per_token(cfg.model, cfg.data.seq_len)
    J = cfg.model.mtp_depth
    max_gamma = J + 2 if max_gamma is None else max_gamma

    def ratios(g: int) -> dict:
        if draft_cost is not None:
            return {"work_ratio": draft_cost, "weight_ratio": draft_cost, "floor_ratio": draft_cost}
        args = (make_proposer("mtp", chain(g)), cfg.model, cfg.data.seq_len)
        return {"work_ratio": work_ratio(*args), "weight_ratio": weight_ratio(*args), "floor_ratio": floor_ratio(*args)}

    spec = []
    for g in range(1, max_gamma + 1) if draft_cost is not None or J else ():
        r, v = ratios(g), verify_cost_of(verify_cost, g + 1)
        spec.append({"gamma": g, "tokens_per_round": expected_tokens(chain(g), [[alpha]]), **r, "verify_cost": v,
                     "speedup": ceiling(chain(g), [[alpha]], r["floor_ratio"], v)})
    second = (1.0 - alpha) / 2 if alpha_rank2 is None else alpha_rank2
    trees = []
    for t in plan_trees(cfg) if spec and J else ():
        ranks = [alpha] + [second / 2 ** i for i in range(max(t.rank) if t.rank else 0)]
        a, v = [ranks] * t.max_depth, verify_cost_of(verify_cost, t.size + 1)
        trees.append({"tree": t.name(), "nodes": t.size, "tokens_per_round": expected_tokens(t, a),
                      "verify_cost": v, "speedup": ceiling(t, a, spec[0]["floor_ratio"], v)})
    blocks = tree_bytes(jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))
    return {"params": counts, "param_bytes": tree_bytes(params), "optimizer_bytes": tree_bytes(opt_state),
            "blocks_bytes": blocks,
            "param_dtype": cfg.model.param_dtype, "flops": fl,
            "cache_bytes_per_token": AttentionCaches().attention_bytes_per_row(cfg.model), "alpha": alpha,
            "draft_cost": draft_cost, "verify_cost": verify_cost, "speculation": spec, "alpha_rank2": second,
            "trees": trees}


def plan_trees(cfg: Config) -> list[Tree]:
    """The trees the plan tabulates: those `decode.draft=auto` probes at this depth, and decode.draft's if wider than a
    chain (its MTP nodes: an n-gram branch drafts for free)."""
    shapes = [drafts.parse(s) for s in PROBED_TREES.get(min(cfg.model.mtp_depth, max(PROBED_TREES)), ())]
    given = cfg.decode.draft
    base = given.part("mtp") if isinstance(given, Tree) and not given.is_chain() else None
    return shapes + ([base] if base is not None and base not in shapes else [])


def _si(n: float) -> str:
    for unit, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= s:
            return f"{n / s:.3f}{unit}"
    return f"{n:.0f}"


def format_plan(plan: dict, cfg: Config) -> str:
    """Human-readable report of build_plan's numbers."""
    p, fl, m = plan["params"], plan["flops"], cfg.model
    trunk = p["trunk"]
    lines = [f"model: d_model={m.d_model} n_layers={m.n_layers} vocab={m.vocab_size} mtp_depth={m.mtp_depth} "
             f"mtp_kind={m.mtp_kind} tied={m.tie_embeddings} seq_len={cfg.data.seq_len}",
             "parameters:",
             f"  trunk (blocks + final norm)  {p['trunk']:>14,d}",
             f"  shared embedding/head        {p['shared_embed_head']:>14,d}  "
             f"({p['shared_embed_head'] / trunk:.4f} of trunk)"]
    for k, n in enumerate(p["mtp"], 1):
        lines.append(f"  mtp module {k:<17d} {n:>14,d}  ({n / trunk:.4f} of trunk)")
    lines.append(f"  total                        {p['total']:>14,d}")
    if p["active"] != p["total"]:
        lines.append(f"  active per token             {p['active']:>14,d}  (the routed experts a token does not reach "
                     f"left out)")
    pb, ob = plan["param_bytes"], plan["optimizer_bytes"]
    lines += [f"memory ({plan['param_dtype']} params, AdamW state):",
              f"  parameters  {pb:>16,d} B  ({pb / 2**30:.3f} GiB)",
              f"  optimizer   {ob:>16,d} B  ({ob / 2**30:.3f} GiB)",
              f"  total       {pb + ob:>16,d} B  ({(pb + ob) / 2**30:.3f} GiB)",
              *_stage_lines(plan, cfg),
              f"decode cache per token ({m.attention_kind}, trunk layers + MTP modules, {m.dtype}): "
              f"{plan['cache_bytes_per_token']:,d} B",
              "FLOPs per token (matmuls 2mnk, full TxT attention; train = 3 x forward):",
              f"  trunk fwd {_si(fl['trunk'])}  mtp module fwd {_si(fl['mtp_module'])}  head fwd {_si(fl['head'])}",
              "  depth   forward      train        +train vs depth-1"]
    prev = None
    for k, f in enumerate(fl["forward_by_depth"]):
        inc = "" if prev is None else f"+{_si(3 * (f - prev))} ({(f - prev) / prev:+.2%})"
        lines.append(f"  {k:<5d}   {_si(f):<12} {_si(3 * f):<12} {inc}")
        prev = f
    return "\n".join(lines + _speculation_lines(plan, m))


def _stage_lines(plan: dict, cfg: Config) -> list[str]:
    """The pipeline's bubble and state per stage (parameters and AdamW state, which mirrors them) with mesh.stage."""
    if cfg.mesh.stage == 1:
        return []
    scale = 1 + plan["optimizer_bytes"] / plan["param_bytes"]
    blocks = plan["blocks_bytes"] * scale
    return pipeline.stage_lines(int(blocks), int((plan["param_bytes"] + plan["optimizer_bytes"]) - blocks),
                                cfg.mesh.stage, cfg.train.micro_batches, cfg.model.n_layers, cfg.mesh.stage_layers,
                                cfg.mesh.stage_repeats)


def _speculation_lines(plan: dict, m: ModelConfig) -> list[str]:
    """The report's speculation table (one row per gamma) and draft-tree table."""
    lines = []
    if not plan["speculation"]:
        lines.append("speculation: mtp_depth=0, no MTP drafter (pass --draft-cost to plan another drafter)")
    else:
        cost = (f"draft cost c={plan['draft_cost']:.4f} of a target forward" if plan["draft_cost"] is not None else
                f"per draft over a plain step: FLOPs computed (module k recomputes gamma+1 rows) and weights read; "
                f"r = the smaller; gamma > {m.mtp_depth} reuses the last module")
        v = ("v = verifying g+1 rows over one row's cost, as given (--verify-cost)" if plan["verify_cost"] != 1.0
             else "v = 1: verifying rows taken as free; pass --verify-cost from bench/cache_cliff.py --rows")
        lines += [f"speculation (alpha={plan['alpha']}, {cost}; {v}):",
                  "  gamma   E=(1-a^(g+1))/(1-a)   FLOPs    weights  v(g+1)  speedup ceiling E/(v+g*r)"]
        for s in plan["speculation"]:
            lines.append(f"  {s['gamma']:<5d}   {s['tokens_per_round']:<21.4f} {s['work_ratio']:<8.4f} "
                         f"{s['weight_ratio']:<8.4f} {s['verify_cost']:<7.3f} {s['speedup']:.4f}")
    if plan["trees"]:
        lines += [f"draft trees (children accepted as rank 1 with alpha={plan['alpha']}, rank 2 with "
                  f"{plan['alpha_rank2']:.4g} (--alpha-rank2), each later rank half the one before; one module call "
                  "per depth at r = gamma 1's):",
                  "  tree    nodes  E (tokens/round)  v(nodes+1)  speedup ceiling E/(v+depth*r)"]
        for t in plan["trees"]:
            lines.append(f"  {t['tree']:<7} {t['nodes']:<6d} {t['tokens_per_round']:<17.4f} {t['verify_cost']:<11.3f} "
                         f"{t['speedup']:.4f}")
    return lines

