"""HLO text as data: instructions, shapes and their bytes, computations, loop trip counts (parallel/hlo.py counts
what a program does from them)."""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass
class Instr:
    """One HLO instruction: its name, result shape text, opcode, operand names and the attribute text."""

    name: str
    shape: str
    op: str
    operands: list
    attrs: str
    args: str = ""  # the text between the opcode's parentheses (a constant's value)


_LAID_OUT = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9][0-9]*\)")  # a layout's memory space other than 0 (TPU: S(1) VMEM, S(2) SMEM)


def laid_out(shape: str) -> list[tuple[str, tuple, str]]:
    """(dtype, dims, layout text) of every array in a shape text (a tuple lists several)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x), layout) for d, dims, layout in _LAID_OUT.findall(shape)]


def arrays(shape: str) -> list[tuple[str, tuple]]:
    """(dtype, dims) of every array in a shape text."""
    return [(d, dims) for d, dims, _ in laid_out(shape)]


def array_bytes(dtype: str, dims: tuple) -> float:
    """Bytes of one array."""
    return DTYPE_BYTES.get(dtype, 4) * math.prod(dims)


def nbytes(shape: str) -> float:
    """Bytes of every array in a shape text."""
    return sum(array_bytes(d, dims) for d, dims in arrays(shape))


def in_hbm(layout: str) -> bool:
    """Whether an array with this layout text lives in HBM: a TPU program's arrays in another memory space (`S(n)`,
    n > 0: on-chip VMEM or SMEM, where memory-space assignment prefetches them) move no HBM bytes."""
    return not _ON_CHIP.search(layout)


def hbm_nbytes(shape: str) -> float:
    """Bytes of the arrays of a shape text that live in HBM."""
    return sum(array_bytes(d, dims) for d, dims, layout in laid_out(shape) if in_hbm(layout))


def _matching(text: str, i: int) -> int:
    """Index just past the bracket group opening at text[i]."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    close = pairs[text[i]]
    for j in range(i, len(text)):
        if text[j] == text[i]:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def parse_instr(line: str) -> Instr | None:
    """An instruction line `[ROOT] %name = SHAPE op(operands), attrs`; None for anything else."""
    m = re.match(r"\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    end = _matching(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op_m = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
    if not op_m:
        return None
    close = _matching(rest, op_m.end() - 1)
    args = rest[op_m.end():close - 1]
    return Instr(m[1], shape, op_m[1], re.findall(r"%([^\s,()]+)", args), rest[close:], args)


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation name: its instructions}, the entry computation's name) of an HLO module's text. An instruction
    may span lines (a Mosaic kernel's backend_config holds newlines): a line that starts no instruction continues
    the one before."""
    comps, entry, current, pending = {}, "", None, []

    def flush():
        if current is not None and pending and (ins := parse_instr(" ".join(pending))):
            current.append(ins)
        pending.clear()

    for line in text.splitlines():
        head = re.match(r"(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$", line)
        if head and not line.startswith(" "):
            flush()
            current = comps.setdefault(head[2], [])
            entry = head[2] if head[1] else entry
        elif line.strip() == "}":
            flush()
            current = None
        elif re.match(r"\s+(?:ROOT\s+)?%", line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line.strip())
    flush()
    return comps, entry


def called(ins: Instr) -> list[str]:
    """The computations an instruction calls (a fusion's, a loop's body, a conditional's branches, ...)."""
    return re.findall(r"(?:calls|to_apply|body|true_computation|false_computation)=%([^\s,}]+)", ins.attrs) + [
        n for grp in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", ins.attrs)
        for n in re.findall(r"%([^\s,]+)", grp)]


def trip_count(ins: Instr, comps: dict | None = None) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` (GPU, CPU), else read from its condition (TPU writes
    none): `i < N` with a constant N, the counter starting at 0 (a scan's); None when neither says."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if m:
        return int(m[1])
    cond = re.search(r"condition=%([^\s,}]+)", ins.attrs)
    body = (comps or {}).get(cond[1], []) if cond else []
    consts = {i.name: i for i in body if i.op == "constant"}
    for i in body:
        if i.op == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2 and i.operands[1] in consts:
            value = consts[i.operands[1]].args.strip()
            return int(value) if value.lstrip("-").isdigit() else None
    return None


def dims_of(shapes: dict, name: str) -> tuple:
    """The dimensions of the first array of instruction `name`'s shape (() if unknown)."""
    a = arrays(shapes.get(name, ""))
    return a[0][1] if a else ()
