"""What a compiled program does per step, read from its optimized HLO text: FLOPs, HBM traffic, collectives, kernels.

XLA's own cost analysis counts the body of a `while` once (a scan over micro-batches or layers) and is absent on
GPU, so this counts from the text: every computation's instructions, a while body times its known trip count (XLA
writes `known_trip_count` into the loop's backend_config), a conditional as its costliest branch.

- FLOPs: matrix products, 2 per multiply-add, from `dot` and `convolution` (TPU writes dots as convolutions) and
  the GPU's GEMM custom calls, with their operand shapes; elementwise work is not counted (the analytic count in
  mtpjax.nn.flops has the same convention). A fused attention kernel is a custom call whose FLOPs are not in the
  text: counted from its operands' shapes as 4·T·S·H per query head (full scores), times 2.5 for a backward kernel.
- HBM bytes (an estimate): every unfused instruction reads its operands and writes its result once, except what
  it never touches (an operand only sliced or gathered, an in-place update's buffer: `Program.traffic`) and a TPU
  program's arrays in on-chip memory (`hbm_nbytes`).
- Collectives: per kind, the larger of the bytes a device sends in and gets out, times how often they run.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from mtpjax.parallel.hlo_calls import (GMM_CALLS, HEAD_CALL, RAGGED_CALL, attention_call_flops, attention_kind,
                                       call_name, head_call, head_call_flops, ragged_call_flops)
from mtpjax.parallel.hlo_text import (Instr, array_bytes, arrays, called, dims_of, hbm_nbytes, in_hbm, laid_out,
                                      nbytes, parse_module, trip_count)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
         "iota", "copy-done", "slice-done", "opt-barrier", "add-dependency"} | {c + "-done" for c in COLLECTIVES}


@dataclasses.dataclass
class Stats:
    """What one execution of a computation does (loops multiplied out)."""

    flops: float = 0.0
    attention_flops: float = 0.0  # of which: fused attention kernels, counted from their shapes
    grouped_flops: float = 0.0  # of which: the MoE's grouped-matmul kernels (GMM_CALLS), counted from their shapes
    scoped_flops: float = 0.0  # of which: ops whose name scope holds Program's `scope` (the MTP modules')
    hbm_bytes: float = 0.0
    collectives: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0.0]))
    # (kind, result shape, op_name) -> [times run, bytes]: where each collective's bytes come from (largest_collectives)
    sources: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0.0]))
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # custom-call targets
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # opcodes, times run

    def add(self, other: Stats, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.attention_flops += times * other.attention_flops
        self.grouped_flops += times * other.grouped_flops
        self.scoped_flops += times * other.scoped_flops
        self.hbm_bytes += times * other.hbm_bytes
        for mine, theirs in ((self.collectives, other.collectives), (self.sources, other.sources)):
            for k, (n, b) in theirs.items():
                mine[k][0] += times * n
                mine[k][1] += times * b
        for k, n in other.calls.items():
            self.calls[k] += times * n
        for k, n in other.ops.items():
            self.ops[k] += times * n


def _window(attrs: str, key: str, n: int, default: int) -> list:
    """One `window={...}` field per spatial dimension (`size=4x1`, `pad=3_0x0_0`), or `default` where absent."""
    m = re.search(r"window=\{[^}]*\b" + key + r"=([0-9_x-]+)", attrs)
    if not m:
        return [default] * n
    return [tuple(int(v) for v in d.split("_")) if "_" in d else int(d) for d in m[1].split("x")]


def _taps(n: int, out: int, size: int, stride: int, pad: tuple, lhs_dilate: int, rhs_dilate: int) -> int:
    """Window positions, over all `out` output positions of one spatial dimension, that land on an input element
    (not on padding, nor on a hole `lhs_dilate` puts between elements)."""
    dilated = (n - 1) * lhs_dilate + 1
    return sum(1 for o in range(out) for j in range(size)
               if 0 <= (p := o * stride + j * rhs_dilate - pad[0]) < dilated and p % lhs_dilate == 0)


def _convolution_flops(ins: Instr, lhs: tuple, out: tuple) -> float:
    """2 per multiply-add that reads an input element: a TPU writes a batched matmul as a convolution whose window
    slides over a dilated or padded batch dimension, where most window positions see zeros it does not multiply."""
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.attrs)
    if not labels or not lhs:
        return 0.0
    lhs_l, out_l = labels[1], labels[3]
    spatial = sorted(c for c in lhs_l if c.isdigit())
    k = len(spatial)
    size, stride = _window(ins.attrs, "size", k, 1), _window(ins.attrs, "stride", k, 1)
    pad = _window(ins.attrs, "pad", k, (0, 0))
    lhs_dil, rhs_dil = _window(ins.attrs, "lhs_dilate", k, 1), _window(ins.attrs, "rhs_dilate", k, 1)
    taps = math.prod(_taps(lhs[lhs_l.index(d)], out[out_l.index(d)], size[i], stride[i], pad[i], lhs_dil[i],
                           rhs_dil[i]) for i, d in enumerate(spatial))
    rest = math.prod(out) // max(1, math.prod(out[out_l.index(d)] for d in spatial))
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    return 2.0 * rest * taps * lhs[lhs_l.index("f")] / (int(groups[1]) if groups else 1)


def dot_flops(ins: Instr, shapes: dict) -> float:
    """2·(result elements)·(contracted elements) of a dot, a convolution or a GEMM custom call."""
    out = arrays(ins.shape)
    if not out or not ins.operands:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs = dims_of(shapes, ins.operands[0])
    if ins.op == "convolution":
        return _convolution_flops(ins, lhs, out[0][1])
    contract = re.search(r'lhs_contracting_dim(?:ension)?s["=:]*\{?\[?"?([0-9,"\s]*)', ins.attrs)
    dims = [int(x) for x in re.findall(r"\d+", contract[1])] if contract else []
    return 2.0 * out_elems * math.prod(lhs[d] for d in dims if d < len(lhs))


def written_bytes(ins: Instr) -> float:
    """HBM bytes an instruction writes: its result, less a GEMM custom call's workspace (the byte array that ends its
    result tuple: scratch the library may use, not data the program moves), and less an async copy's or slice's
    source, which its result tuple repeats first (`(source, destination, context)`)."""
    out = laid_out(ins.shape)
    if ins.op == "custom-call" and len(out) > 1 and out[-1][0] in ("s8", "u8") and len(out[-1][1]) == 1:
        out = out[:-1]
    if ins.op in ("copy-start", "slice-start") and len(out) >= 2:
        out = out[1:2]
    return sum(array_bytes(d, dims) for d, dims, layout in out if in_hbm(layout))


_PICKS = ("dynamic-slice", "slice", "gather", "slice-start")  # ops that read the parts of their operand 0 they return
_REMAPS = ("bitcast", "transpose", "reshape", "copy")  # inside a fusion, index arithmetic: read only where used


def _picked_bytes(u: Instr) -> float:
    """Bytes a slice or gather reads of its operand: what it returns (an async slice: its result tuple's piece)."""
    if u.op == "slice-start":
        d, dims, _ = laid_out(u.shape)[1]
        return array_bytes(d, dims)
    return nbytes(u.shape)


def _picks(name: str, users: dict) -> list[Instr] | None:
    """The slices and gathers that are all a fusion's reads of `name` come to, through index remaps; None if any
    read takes it whole (a reduction, an elementwise op, a matmul)."""
    out = []
    for u in users.get(name, []):
        if not u.operands or u.operands[0] != name or u.op not in _PICKS + _REMAPS:
            return None
        deeper = [u] if u.op in _PICKS else _picks(u.name, users)
        if deeper is None:
            return None
        out += deeper
    return out or None


class Program:
    """A compiled module's text, parsed once; `stats()` walks it from the entry (or from one computation)."""

    def __init__(self, text: str, scope: str = ""):
        self.comps, self.entry = parse_module(text)
        self.scope = scope
        self.shapes = {i.name: i.shape for c in self.comps.values() for i in c}
        self._memo: dict[tuple, Stats] = {}

    def stats(self, comp: str | None = None, fused: bool = False, trip_counts: bool = True) -> Stats:
        """Stats of one execution of `comp` (default: the entry); `fused`: inside a fusion (no HBM traffic)."""
        comp = comp or self.entry
        key = (comp, fused, trip_counts)
        if key in self._memo:
            return self._memo[key]
        s = Stats()
        for ins in self.comps.get(comp, []):
            self._instr(ins, s, fused, trip_counts)
        self._memo[key] = s
        return s

    def _instr(self, ins: Instr, s: Stats, fused: bool, trip_counts: bool) -> None:
        s.ops[ins.op] += 1
        target = call_name(ins)
        f = 0.0
        if ins.op in ("dot", "convolution") or (target and ("gemm" in target or "matmul" in target)):
            f = dot_flops(ins, self.shapes)
        if target:
            s.calls[target] += 1
            if target == HEAD_CALL:
                f = head_call_flops(ins, self.shapes)
            elif target == RAGGED_CALL or target in GMM_CALLS.values():
                f = ragged_call_flops(ins, self.shapes)
                s.grouped_flops += f if target != RAGGED_CALL else 0.0
            elif attention_kind(target):
                f = attention_call_flops(ins, self.shapes)
                s.attention_flops += f
        s.flops += f
        if f and self.scope and self.scope in ins.attrs:
            s.scoped_flops += f
        base = ins.op.removesuffix("-start")
        if base in COLLECTIVES:
            inb = sum(nbytes(self.shapes.get(o, "")) for o in ins.operands)
            outb = nbytes(ins.shape) - (inb if ins.op.endswith("-start") else 0)
            source = (base, re.sub(r"\{[^}]*\}", "", ins.shape), op_name(ins))
            for table, key in ((s.collectives, base), (s.sources, source)):
                table[key][0] += 1
                table[key][1] += max(inb, outb)
        if not fused and ins.op not in _FREE and ins.op not in ("while", "conditional", "call"):
            s.hbm_bytes += self.traffic(ins)
        calls = called(ins)
        if ins.op == "while":
            body = re.search(r"body=%([^\s,}]+)", ins.attrs)
            n = trip_count(ins, self.comps) if trip_counts else 1
            s.add(self.stats(body[1], fused, trip_counts), n or 1)
        elif ins.op == "conditional":
            branches = [self.stats(c, fused, trip_counts) for c in calls]
            if branches:
                s.add(max(branches, key=lambda b: (b.flops, b.hbm_bytes)))
        else:
            for c in calls:
                s.add(self.stats(c, fused or ins.op == "fusion", trip_counts))

    def traffic(self, ins: Instr) -> float:
        """HBM bytes an unfused instruction moves: its operands read and its result written, except the parts it
        never touches: an operand only sliced or gathered (a layer of a scanned stack; the target logit of each row)
        reads its slices, an in-place update (dynamic-update-slice: a cache's new rows) reads and writes its
        update, not the whole buffer, and the fused head reads its weight once per tile of rows."""
        reads = [hbm_nbytes(self.shapes.get(o, "")) for o in ins.operands]
        write = written_bytes(ins)
        body, params = [ins], {0: ins.operands[0]} if ins.operands else {}
        if ins.op == "fusion" and (calls := called(ins)):  # a fusion calls its fused computation alone
            body = self.comps.get(calls[0], [])
            params = {int(i.args): i.name for i in body if i.op == "parameter" and i.args.strip().isdigit()}
        users = collections.defaultdict(list)
        for i in body:
            for o in i.operands:
                users[o].append(i)
        for idx, name in params.items():
            picks = _picks(name, users) if ins.op == "fusion" else [ins] if ins.op in _PICKS else None
            if idx < len(reads) and picks and reads[idx]:
                reads[idx] = sum(_picked_bytes(u) for u in picks)
        if ins.op == "custom-call" and call_name(ins) == HEAD_CALL and len(reads) > 1:  # the weight, once per row tile
            reads[1] *= math.ceil(dims_of(self.shapes, ins.operands[0])[0] / head_call(ins)[1])
        root = body[-1] if body else None
        if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
            idx = next((i for i, n in params.items() if n == root.operands[0]), None)
            if idx is not None and idx < len(reads):
                update = hbm_nbytes(self.shapes.get(root.operands[1], ""))
                reads[idx], write = 0.0, update
        return write + sum(reads)

    def loops(self, comp: str | None = None) -> list[tuple[Instr, int | None]]:
        """The while loops a computation runs directly (with their trip counts)."""
        return [(i, trip_count(i, self.comps)) for i in self.comps.get(comp or self.entry, []) if i.op == "while"]

    def body_of(self, loop: Instr) -> str:
        return re.search(r"body=%([^\s,}]+)", loop.attrs)[1]

    def users(self) -> dict[str, list[Instr]]:
        """Who reads each instruction's result."""
        out = collections.defaultdict(list)
        for c in self.comps.values():
            for i in c:
                for o in i.operands:
                    out[o].append(i)
        return out


def gathers_around(prog: Program, is_kernel, hops: int = 4, after: bool = True) -> list[tuple[str, int | None]]:
    """(all-gather, the element of its tuple result that flows, or None for all) within `hops` data-flow steps before
    (and, with `after`, after) an instruction `is_kernel(ins)` accepts: an activation gathered to feed a kernel, or
    a kernel's output gathered. Upstream, a get-tuple-element says which element of a combined gather is read."""
    producers = {i.name: i for c in prog.comps.values() for i in c}
    users = prog.users()
    is_gather = lambda i: i.op.removesuffix("-start").removesuffix("-done") == "all-gather"
    found = set()
    for c in prog.comps.values():
        for k in (i for i in c if is_kernel(i)):
            up = [(o, None) for o in k.operands]
            down = [u.name for u in users.get(k.name, [])] if after else []
            for _ in range(hops):
                found |= {(n, idx) for n, idx in up if n in producers and is_gather(producers[n])}
                found |= {(n, None) for n in down if n in producers and is_gather(producers[n])}
                up = [(p.operands[0], int(m[1])) if p.op == "get-tuple-element" and (m := re.search(r"index=(\d+)",
                                                                                                   p.attrs))
                      else (o, None) for n, _ in up if (p := producers.get(n)) is not None and not is_gather(p)
                      for o in (p.operands if p.op != "get-tuple-element" else p.operands[:1])]
                down = [u.name for n in down for u in users.get(n, [])]
    return sorted(found, key=str)


def op_name(ins: Instr) -> str:
    """The JAX op an instruction comes from, its name scopes (the layer) included; its jit(...) prefix dropped."""
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return re.sub(r"^jit\([^)]*\)/", "", m[1]) if m else ""


def _brief(shape: str, name: str) -> tuple[str, float, str]:
    """(shape, its largest array's bytes, op name) said briefly: XLA combines collectives into one of a tuple of
    arrays, whose op name joins theirs (`(a:b:...)`); the largest array and the distinct names stand for them."""
    sizes = [(array_bytes(d, dims), f"{d}[{','.join(map(str, dims))}]") for d, dims in arrays(shape)]
    big = max(sizes, default=(0, ""))
    if len(sizes) > 1:
        shape = f"{len(sizes)} arrays, largest {big[1]}"
    parts = [p for p in dict.fromkeys(name.split(":")) if p] or [""]
    return shape, big[0], "; ".join(parts[:3]) + (f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")


def largest_collectives(stats: Stats, n: int = 8) -> list[dict]:
    """The n collectives (kind, result shape, op name) that move the most bytes per step, loops multiplied out."""
    rows = sorted(stats.sources.items(), key=lambda kv: -kv[1][1])[:n]
    return [dict(zip(("shape", "largest_array_bytes", "op_name"), _brief(shape, name)), kind=k, count=c, bytes=b)
            for (k, shape, name), (c, b) in rows]


def summary(stats: Stats) -> dict:
    """JSON-ready numbers of a Stats."""
    return {"flops": stats.flops, "attention_kernel_flops": stats.attention_flops, "scoped_flops": stats.scoped_flops,
            "grouped_matmul_flops": stats.grouped_flops,
            "hbm_bytes": stats.hbm_bytes,
            "collectives": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(stats.collectives.items())},
            "largest_collectives": largest_collectives(stats), "custom_calls": dict(sorted(stats.calls.items()))}
