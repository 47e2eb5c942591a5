"""Ahead-of-time compilation for a target (`python -m mtpjax compile`): the run's programs compiled for TPU or GPU
devices that are not here, and what each does per step, read from the compiled program.

The train step (micro-batches, remat, expert axis as configured), the eval step and the speculative decode loop (plain,
the MTP chain, a draft tree) compile on the config's mesh over the target's devices.
Memory is the compiler's own analysis; FLOPs, HBM traffic and collectives come from the optimized HLO
(mtpjax.parallel.hlo, loop trip counts multiplied out); the step time is a roofline estimate from the chip's published
figures (mtpjax.parallel.targets.CHIPS), never a measurement.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpjax.config import Config, MeshConfig
from mtpjax.decode.host import make_loop, request
from mtpjax.decode.loop import execute
from mtpjax.decode.mesh import check_mesh, specs
from mtpjax.errors import MtpjaxError
from mtpjax.eval.plan import plan_trees
from mtpjax.nn.flops import flops_per_token, routed_flops_per_token, train_flops_per_token
from mtpjax.nn.model import MTP_SCOPE, build_model
from mtpjax.drafts import PLAIN, chain
from mtpjax.nn.speed import expected_tokens
from mtpjax.parallel import hlo
from mtpjax.parallel import pipeline
from mtpjax.parallel.hlo_calls import GMM_CALLS, HEAD_CALL, RAGGED_CALL, attention_kind
from mtpjax.parallel.sharding import make_mesh, placement, state_shardings
from mtpjax.parallel.targets import Target, topology_devices
from mtpjax.train.setup import check_parallelism
from mtpjax.train.step import make_programs

GiB = 2**30
KNOBS = ("mesh.fsdp (parameters and optimizer state split over more devices), train.micro_batches (fewer rows' "
         "activations at once), model.remat=full (activations recomputed in the backward)")


class DoesNotFit(MtpjaxError):
    """A program needs more memory per device than the target's chip has; `table` is the memory the report prints."""

    def __init__(self, message: str, table: str):
        super().__init__(message)
        self.table = table


def memory_of(compiled) -> dict:
    """Per-device bytes from the compiler's memory analysis; total = arguments + outputs - aliased (donated inputs
    the outputs reuse) + temporaries + generated code."""
    m = compiled.memory_analysis()
    parts = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
             "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
             "generated_code": m.generated_code_size_in_bytes}
    parts["total"] = (parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
                      + parts["generated_code"])
    return parts


def refused_memory(message: str) -> dict | None:
    """The bytes a TPU compiler's RESOURCE_EXHAUSTED names (used, available), or None for another error."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    sizes = [float(n) * units.get(u, 1) for n, u in re.findall(r"(\d+(?:\.\d+)?)([KMGT])\b", message)]
    return {"total": sizes[0] if sizes else float("nan"), "available": sizes[-1] if len(sizes) > 1 else float("nan")}


def kernels_in(stats: hlo.Stats, cfg: Config, text: str = "") -> dict:
    """Which attention and MoE kernels a program contains (`text`: its HLO, whose op names say where a ragged_dot
    became plain dots)."""
    attention = sorted({attention_kind(t) for t in stats.calls if attention_kind(t)}) or ["xla (einsum)"]
    moe = None
    if cfg.model.mlp_kind == "moe":
        gmm = [name for name in GMM_CALLS.values() if stats.calls.get(name)]
        if gmm:  # mtpjax.nn.gmm: a train step's forward, input and weight gradients all grouped
            grouped = gmm[0]
        elif stats.calls.get(RAGGED_CALL):  # TPU: its weight gradient is a convolution over every local expert
            grouped = "ragged_dot (Mosaic; weight gradients: every local expert over every received row)"
        elif stats.ops.get("ragged-dot"):
            grouped = "ragged_dot"
        elif "ragged_dot_general" in text:  # GPU (jax 0.10.2): one dense dot per local expert over every row
            grouped = "ragged_dot as dense dots (every local expert over every received row)"
        else:
            grouped = "expert blocks (gathered weights)"
        moe = grouped + (", all-to-all dispatch" if "all-to-all" in stats.collectives else "")
    return {"attention": attention, "moe": moe, "head": HEAD_CALL if stats.calls.get(HEAD_CALL) else None}


def analyse(name: str, compiled, seconds: float, cfg: Config) -> dict:
    """One compiled program's report entry."""
    text = compiled.as_text()
    prog = hlo.Program(text, MTP_SCOPE)
    stats = prog.stats()
    return {"program": name, "compile_seconds": round(seconds, 1), "memory": memory_of(compiled),
            **hlo.summary(stats), "kernels": kernels_in(stats, cfg, text), "_program": prog, "_text": text}


def compiler_options(platform: str) -> dict:
    """What the target's compiler is told beyond its defaults. GPU: XLA's own sort, not CUB's radix sort, which sizes
    its scratch by asking a live GPU (none is here; the MoE's dispatch sorts I·k slots)."""
    return {"xla_gpu_enable_cub_radix_sort": False} if platform == "gpu" else {}


def _compile(lowered_fn, name: str, capacity: float, table_so_far, platform: str):
    """(compiled, seconds); DoesNotFit when the compiler refuses for memory (TPU)."""
    t0 = time.perf_counter()
    try:
        return lowered_fn().compile(compiler_options(platform)), time.perf_counter() - t0
    except Exception as e:  # XlaRuntimeError: a refusal for memory is the user's to fix, anything else a bug
        refused = refused_memory(str(e))
        if refused is None:
            raise
        gib = (refused["total"] - capacity) / GiB
        raise DoesNotFit(f"{name} does not fit: the compiler refused it ({refused['total'] / GiB:.2f} GiB of "
                         f"{refused['available'] / GiB:.2f} GiB; over by {gib:.2f} GiB); try {KNOBS}",
                         table_so_far(name, refused)) from None


def train_programs(cfg: Config, target: Target, mesh, report: dict, eval_step: bool = True) -> None:
    """Compile the train (and eval) steps on the config's mesh over the target's devices into report['programs']."""
    programs = make_programs(cfg, mesh)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=programs.batch_sharding)
    steps = (("train_step", programs.train_step),) + ((("eval_step", programs.eval_step),) if eval_step else ())
    for name, fn in steps:
        c, s = _compile(lambda fn=fn: fn.lower(programs.target, tok, tok), name, target.chip.hbm_bytes,
                        lambda n, refused: memory_table(report, extra=(n, refused)), target.platform)
        report["programs"].append(analyse(name, c, s, cfg))
        check_fits(report, target)


def check_fits(report: dict, target: Target) -> None:
    """DoesNotFit, with the memory table so far, when the last compiled program needs more than the chip's memory
    (GPU: the compiler does not refuse)."""
    p = report["programs"][-1]
    over = p["memory"]["total"] - target.chip.hbm_bytes
    if over > 0:
        raise DoesNotFit(f"{p['program']} does not fit on {target.chip.name} by {over / GiB:.2f} GiB per device; "
                         f"try {KNOBS}", memory_table(report))


def decode_loops(cfg: Config, alpha: float) -> list[tuple[str, dict, float]]:
    """(name, make_loop's drafting arguments, expected tokens per round at α) of the loops compiled: plain, the MTP
    chain (γ = the model's depth) and the first draft tree the plan tabulates."""
    J = cfg.model.mtp_depth
    loops = [("decode_plain", {"draft": PLAIN}, 1.0)]
    if J:
        loops.append((f"decode_chain_{J}", {"draft": chain(J)}, expected_tokens(chain(J), [[alpha]])))
        trees = plan_trees(cfg)
        if trees:
            t = trees[0]
            ranks = [alpha] + [(1 - alpha) / 2 / 2**i for i in range(max(t.rank) if t.rank else 0)]
            loops.append((f"decode_tree_{t.name()}", {"draft": t}, expected_tokens(t, [ranks] * t.max_depth)))
    return loops


def decode_programs(cfg: Config, mesh, report: dict, alpha: float, batch: int, prompt: int, new: int) -> None:
    """Compile each speculative decode loop on the target's mesh, laid out as decoding on a mesh runs it
    (decode.mesh: parameters in their training shardings, rows over the data axes); per round: FLOPs and HBM bytes."""
    where = placement(mesh)
    model = nnx.eval_shape(lambda: build_model(cfg, seed=0, placement=where))
    graph, params = nnx.split(model)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
                          state_shardings(params, mesh))
    prompts = [[1] * prompt] * batch
    for name, kw, tokens in decode_loops(cfg, alpha):
        loop = make_loop(model, prompts, max_new_tokens=new, **kw)
        req = request(loop, prompts)
        req = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                           req, specs(where, req, batch), is_leaf=lambda x: isinstance(x, P))
        t0 = time.perf_counter()
        options = compiler_options(report["chip"]["platform"])
        c = execute.lower(loop, (graph, None), (params, None), req).compile(options)
        entry = analyse(name, c, time.perf_counter() - t0, cfg)
        prog = entry["_program"]
        # The rounds: the loop whose trip count the data decides (layer scans and the like have known ones)
        rounds = max((i for c in prog.comps for i, n in prog.loops(c) if n is None),
                     key=lambda i: prog.stats(prog.body_of(i)).flops, default=None)
        body = prog.stats(prog.body_of(rounds)) if rounds is not None else hlo.Stats()
        entry["round"] = {"flops": body.flops, "hbm_bytes": body.hbm_bytes, "tokens_per_round": tokens}
        report["programs"].append(entry)


def analytic(cfg: Config, n_devices: int) -> dict:
    """The plan's FLOPs per device per step: training (3 × forward) and evaluation (forward), every MTP application
    included (the depths and loss.mtp_unroll's); and what the tokens need of the routed experts' matmuls in each
    (`routed`). Model FLOPs, as MFU counts them: recomputed work (remat, the teachers' head logits of the self/tv
    targets and of the eval's acceptance, made again chunk by chunk) is the compiled count's, not the plan's."""
    m, T, tokens = cfg.model, cfg.data.seq_len, cfg.train.batch_size * cfg.data.seq_len
    f = flops_per_token(m, T)
    train = train_flops_per_token(m, T, cfg.train.freeze == "trunk", cfg.loss.mtp_unroll)
    r, apps = routed_flops_per_token(m), m.mtp_depth + (cfg.loss.mtp_unroll if m.mtp_depth else 0)
    routed_train = (r["trunk"] if cfg.train.freeze == "trunk" else 3 * r["trunk"]) + 3 * apps * r["module"]
    evaluate = f["forward"] + (apps - m.mtp_depth) * (f["mtp_module"] + f["head"])
    return {"train_step": train * tokens / n_devices, "eval_step": evaluate * tokens / n_devices,
            "mtp_share": 3 * apps * f["mtp_module"] / train if train else 0.0,
            "routed": {"train_step": routed_train * tokens / n_devices,
                       "eval_step": (r["trunk"] + apps * r["module"]) * tokens / n_devices}}


def roofline(flops: float, hbm: float, coll: float, target: Target) -> dict:
    """Seconds each resource needs at the chip's published peak, and the estimate: the largest (perfect overlap)."""
    c = target.chip
    link = c.host_link_bw if target.hosts > 1 else c.link_bw
    t = {"compute_s": flops / c.peak_bf16, "hbm_s": hbm / c.hbm_bw, "collective_s": coll / link if link else 0.0}
    t["estimate_s"] = max(t.values())
    t["bound"] = max(("compute", "hbm", "collective"), key=lambda k: t[f"{k}_s"])
    return t


def estimates(report: dict, cfg: Config, target: Target) -> None:
    """Add the roofline, MFU, the analytic FLOPs and the decode speedups to every program's entry."""
    ana = analytic(cfg, target.devices)
    plain = None
    for p in report["programs"]:
        coll = sum(v["bytes"] for v in p["collectives"].values())
        p["collective_bytes"] = coll
        p["collective_fraction"] = coll / (coll + p["hbm_bytes"]) if coll + p["hbm_bytes"] else 0.0
        p["roofline"] = roofline(p["flops"], p["hbm_bytes"], coll, target)
        if p["program"] in ana:
            p["analytic_flops"] = ana[p["program"]]
            p["mfu_estimate"] = ana[p["program"]] / (p["roofline"]["estimate_s"] * target.chip.peak_bf16)
            p["mtp_share"] = {"compiled": p["scoped_flops"] / p["flops"] if p["flops"] else 0.0,
                              "plan": ana["mtp_share"] if p["program"] == "train_step" else None}
            if p["kernels"]["moe"]:
                p["routed"] = {"flops": p["grouped_matmul_flops"], "need": ana["routed"][p["program"]]}
        if "round" in p:
            r = p["round"]
            r["roofline_s"] = roofline(r["flops"], r["hbm_bytes"], 0.0, target)["estimate_s"]
            plain = plain or r["roofline_s"]
            r["speedup_estimate"] = r["tokens_per_round"] * plain / r["roofline_s"] if r["roofline_s"] else None


def compile_report(cfg: Config, target: Target, *, alpha: float = 0.8, decode: bool = True, batch: int = 1,
                   prompt: int = 128, new: int = 128, eval_step: bool = True) -> dict:
    """Every program compiled for `target` and its numbers (JSON-ready but for each entry's `_program`)."""
    devices = topology_devices(target)
    mesh = {k: v for k, v in cfg.mesh.model_dump().items()  # its axes, and a split or repeats where set
            if k not in ("stage_layers", "stage_repeats") or v != MeshConfig.model_fields[k].default}
    report = {"target": target.name, "chip": dataclasses.asdict(target.chip), "devices": target.devices,
              "mesh": mesh, "alpha": alpha, "programs": [], "notes": [],
              "tokens_per_step": cfg.train.batch_size * cfg.data.seq_len, "steps": cfg.train.steps}
    mesh = make_mesh(cfg.mesh, devices)
    if decode:
        check_mesh(cfg.model, mesh)
    check_parallelism(cfg, mesh)  # a batch the run would refuse is refused here too
    train_programs(cfg, target, mesh, report, eval_step)
    if decode:
        decode_programs(cfg, mesh, report, alpha, batch, min(prompt, cfg.data.seq_len), new)
    estimates(report, cfg, target)
    if cfg.mesh.stage > 1:
        m = cfg.mesh
        report["pipeline"] = {"stages": m.stage, "micro_batches": cfg.train.micro_batches, "repeats": m.stage_repeats,
                              "bubble": pipeline.bubble(m.stage, cfg.train.micro_batches, m.stage_repeats),
                              "n_layers": cfg.model.n_layers, "stage_layers": list(m.stage_layers)}
    return report


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def memory_table(report: dict, extra: tuple | None = None) -> str:
    """Per-device memory of every program compiled so far (and `extra`: a refused one's (name, {total, ...}))."""
    cap = report["chip"]["hbm_bytes"]
    lines = [f"memory per device (GiB) on {report['target']} ({report['chip']['name']}, {cap / GiB:.2f} GiB):",
             f"  {'program':<28} {'args':>8} {'outputs':>8} {'aliased':>8} {'temps':>8} {'code':>8} {'total':>8}  "
             "fits"]
    rows = [(p["program"], p["memory"]) for p in report["programs"]] + ([extra] if extra else [])
    for name, m in rows:
        over = m["total"] - cap
        verdict = (f"does not fit by {over / GiB:.2f} GiB" if over > 0 else
                   f"fits ({-over / cap:.0%} headroom)")
        parts = "".join(_gib(m[k]) + " " if k in m else f"{'-':>8} " for k in
                        ("arguments", "outputs", "aliased", "temporaries", "generated_code"))
        lines.append(f"  {name:<28} {parts}{_gib(m['total'])}  {verdict}")
    return "\n".join(lines)


def _si(n: float) -> str:
    for unit, s in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= s:
            return f"{n / s:.3g}{unit}"
    return f"{n:.0f}"


def _program_lines(p: dict) -> list[str]:
    r = p["roofline"]
    lines = [f"{p['program']} (compiled in {p['compile_seconds']} s):",
             f"  FLOPs per device {_si(p['flops'])} (HLO, loop trip counts multiplied out; fused attention kernels "
             f"{_si(p['attention_kernel_flops'])} from their shapes)"
             + (f", plan {_si(p['analytic_flops'])} ({p['flops'] / p['analytic_flops']:.3f}x)"
                if p.get("analytic_flops") else "")]
    if p.get("mtp_share") and p["mtp_share"]["plan"] is not None:
        share = p["mtp_share"]
        lines.append(f"  MTP modules' share of FLOPs {share['compiled']:.1%} (plan {share['plan']:.1%}; module blocks, "
                     "head applications apart)")
    lines.append(f"  HBM bytes (estimate: each unfused op reads its inputs, writes its output, in HBM) "
                 f"{_si(p['hbm_bytes'])}B; "
                 f"collectives {_si(p['collective_bytes'])}B = {p['collective_fraction']:.1%} of the bytes moved")
    for kind, v in p["collectives"].items():
        lines.append(f"    {kind:<20} x{v['count']:<8g} {_si(v['bytes'])}B")
    if p["largest_collectives"]:
        lines.append("  largest collectives (bytes per step; the op, and its layer's name scope, that needs them):")
    for c in p["largest_collectives"]:
        name = c["op_name"] or "(no op name: made by XLA)"
        lines.append(f"    {_si(c['bytes']):>6}B {c['kind']:<18} x{c['count']:<5g} {c['shape']:<34} {name}")
    lines.append(f"  roofline ESTIMATE: compute {r['compute_s'] * 1e3:.2f} ms, HBM {r['hbm_s'] * 1e3:.2f} ms, "
                 f"collectives {r['collective_s'] * 1e3:.2f} ms -> {r['estimate_s'] * 1e3:.2f} ms ({r['bound']}-bound)"
                 + (f", MFU {p['mfu_estimate']:.1%}" if "mfu_estimate" in p else ""))
    if "round" in p:
        q = p["round"]
        lines.append(f"  one round: {_si(q['flops'])} FLOPs, {_si(q['hbm_bytes'])}B read/written, "
                     f"{q['roofline_s'] * 1e6:.1f} us; {q['tokens_per_round']:.3f} tokens/round at alpha -> "
                     f"speedup ESTIMATE {q['speedup_estimate']:.2f}x over plain")
    k = p["kernels"]
    lines.append(f"  kernels: attention {', '.join(k['attention'])}" + (f"; MoE {k['moe']}" if k["moe"] else "")
                 + (f"; {k['head']}" if k.get("head") else ""))
    if "routed" in p:
        lines.append(routed_line(p["routed"], k["moe"]))
    return lines


def routed_line(routed: dict, kernel: str) -> str:
    """The routed experts' matmul FLOPs the grouped kernels ran beside what the tokens need (k experts per token, gate,
    up and down; 3x in a train step); a grouping other than the gmm kernels' is not told apart in the HLO."""
    need = f"the tokens need {_si(routed['need'])}"
    if not routed["flops"]:
        return f"  routed expert matmuls: {need} (not told apart from the other dots: {kernel.split(' (')[0]})"
    return (f"  routed expert matmuls {_si(routed['flops'])} FLOPs (grouped kernels), {need} "
            f"({routed['flops'] / routed['need']:.2f}x)")


def format_report(report: dict) -> str:
    """The report a user reads before booking the hardware."""
    c = report["chip"]
    lines = [memory_table(report),
             f"chip figures (published): {c['peak_bf16'] / 1e12:.0f} TFLOP/s bf16 dense, HBM {c['hbm_bw'] / 1e12:.2f} "
             f"TB/s, link {c['link_bw'] / 1e9:.0f} GB/s; mesh {report['mesh']}; decode alpha {report['alpha']}"]
    if "pipeline" in report:
        pp = report["pipeline"]
        lines.append(f"pipeline: {pipeline.schedule_line(pp['stages'], pp['micro_batches'], pp.get('repeats', 1))}; "
                     "every stage runs the same program (memory per device above is each stage's), and the bubble's "
                     "ticks are in its FLOPs")
        if len(set(pp["stage_layers"])) > 1:
            lines.append(f"  {pipeline.uneven_line(tuple(pp['stage_layers']), pp['n_layers'])}")
    for p in report["programs"]:
        lines += _program_lines(p)
    lines += [f"note: {n}" for n in report.get("notes", ())]
    lines.append("estimates are rooflines from published peaks (no overlap loss, no kernel efficiency): an upper bound "
                 "on speed, not a measurement")
    return "\n".join(lines + bottom_line(report))


def _duration(seconds: float) -> str:
    for unit, s, most in (("s", 1, 120), ("min", 60, 120), ("h", 3600, 48)):
        if seconds < most * s:
            return f"{seconds / s:.3g} {unit}"
    return f"{seconds / 86400:.3g} days"


def bottom_line(report: dict) -> list[str]:
    """The train step's estimate as a booking reads it: step time, tokens/s, hours for the config's steps, MFU."""
    p = next((p for p in report["programs"] if p["program"] == "train_step" and "roofline" in p), None)
    if p is None:
        return []
    step = p["roofline"]["estimate_s"]
    return [f"bottom line (train step ESTIMATE on {report['target']}): {step * 1e3:.1f} ms per step, "
            f"{_si(report['tokens_per_step'] / step)} tokens/s, {_duration(report['steps'] * step)} for "
            f"train.steps={report['steps']}, MFU {p['mfu_estimate']:.1%} ({p['roofline']['bound']}-bound)"]


def report_json(report: dict) -> dict:
    """The report without its parsed programs."""
    return {**report, "programs": [{k: v for k, v in p.items() if not k.startswith("_")} for p in report["programs"]]}
