"""The custom calls a compiled program's kernels are, read from its HLO text: which kernel (attention, the MoE's
grouped matmuls, the head fused with its cross-entropy) and its FLOPs, counted from its operands' shapes (a kernel's
work is not in the text)."""

from __future__ import annotations

import math
import re

from mtpjax.parallel.hlo_text import Instr, arrays, dims_of

# Custom calls that are attention kernels, by target: Mosaic (TPU Pallas: splash), Triton (GPU Pallas), cuDNN.
ATTENTION_CALLS = {"tpu_custom_call": "splash (Mosaic)", "__gpu$xla.gpu.triton": "pallas (Triton)",
                   "__cudnn$fmha": "cudnn flash attention"}
_FLOATS = ("bf16", "f16", "f32", "f8e4m3fn", "f8e5m2")
# A fused attention kernel's work in forward passes (2 products): its backward recomputes the scores and forms dP,
# dV, dK (dkv kernel: 2x), or the scores, dP and dQ (dq kernel: 1.5x); one kernel for all three gradients: 2.5x.
# Pallas GPU's preprocess (o·do, elementwise) does no product.
_BACKWARD = (("preprocess", 0.0), ("dkv", 2.0), ("dq", 1.5), ("bwd", 2.5), ("backward", 2.5))


def attention_call_flops(ins: Instr, shapes: dict) -> float:
    """A fused attention kernel's FLOPs from its operands: 4·(query elements)·S (scores and values over all S keys,
    the full matrix), times its backward factor (_BACKWARD, read from the kernel's name). Triton's operands and
    cuDNN's (jax lowers them in its BTNH layout) are [B,T,N,H] (S is axis 1), Mosaic splash's [.., N, T, H] (S is
    axis -2)."""
    floats = [d for d, dt in ((dims_of(shapes, o), arrays(shapes.get(o, ""))) for o in ins.operands)
              if len(d) >= 3 and dt and dt[0][0] in _FLOATS]
    if len(floats) < 2:
        return 0.0
    q, k = floats[0], floats[1]
    triton = "triton" in ins.attrs
    kernel = re.search(r'name = \\?"([^"\\]+)', ins.attrs) if triton else None
    what = (kernel[1] if kernel else ins.name).lower()
    factor = next((f for key, f in _BACKWARD if key in what), 1.0)
    if "dkv" in what and "dq" in what:
        factor = 2.5
    return 4.0 * math.prod(q) * (k[-2] if "tpu_custom_call" in ins.attrs else k[1]) * factor


RAGGED_CALL = "ragged_dot (Mosaic)"
# The MoE's grouped-matmul kernels (mtpjax.nn.gmm), named apart from attention's calls of the same targets: megablox
# by its jitted function (gmm, tgmm), the Triton kernels by the names they are built with.
GMM_CALLS = {"megablox": "gmm (Mosaic megablox)", "triton": "gmm (Pallas Triton)"}
_MEGABLOX = re.compile(r"\bjit\(t?gmm\)")
_TRITON_GMM = re.compile(r'name = \\?"mtpjax_t?gmm\\?"')


# The head fused with its cross-entropy (mtpjax.nn.head_ce), by its kernels' names, which carry the row tile.
HEAD_CALL = "head + cross-entropy (Mosaic)"
_HEAD = re.compile(r"mtpjax_head_ce_(fwd|bwd)_tile(\d+)")


def head_call(ins: Instr) -> tuple[float, int]:
    """The fused head's (forward passes over the logits: 1 forward, 2 backward (recomputed, then multiplied into the
    rows' gradient); its row tile)."""
    m = _HEAD.search(ins.attrs)
    return (1.0 if m[1] == "fwd" else 2.0), int(m[2])


def head_call_flops(ins: Instr, shapes: dict) -> float:
    """The fused head's FLOPs from its operands, rows [n, D] and the weight (either layout): 2·n·D·V per pass."""
    h, w = (dims_of(shapes, o) for o in ins.operands[:2])
    return 2.0 * math.prod(h) * math.prod(w) / h[-1] * head_call(ins)[0]


def call_name(ins: Instr) -> str | None:
    """A custom call's target; the MoE's grouped matmuls (a TPU's Mosaic ragged_dot, the gmm kernels) and the fused
    head named apart."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    if target and target[1] == "tpu_custom_call":
        if _HEAD.search(ins.attrs):
            return HEAD_CALL
        if "ragged_dot_tiling" in ins.attrs:
            return RAGGED_CALL
        if _MEGABLOX.search(ins.attrs):
            return GMM_CALLS["megablox"]
    if target and target[1].startswith("__gpu$xla.gpu.triton") and _TRITON_GMM.search(ins.attrs):
        return GMM_CALLS["triton"]
    return target[1] if target else None


def ragged_call_flops(ins: Instr, shapes: dict) -> float:
    """A grouped matmul's FLOPs: each row of its first floating input [M, K] times its group's [K, N] (2·M·K·N; a
    Mosaic ragged_dot, a gmm; tgmm's first input is [K, M] (megablox) or [M, K] (Triton), its result [G, K, N])."""
    floats = [d for d, dt in ((dims_of(shapes, o), arrays(shapes.get(o, ""))) for o in ins.operands)
              if dt and dt[0][0] in _FLOATS]
    out = arrays(ins.shape)
    return 2.0 * math.prod(floats[0]) * out[0][1][-1] if floats and out and out[0][1] else 0.0


def attention_kind(target: str) -> str | None:
    """The attention kernel a custom-call target is, or None."""
    return next((v for k, v in ATTENTION_CALLS.items() if target.startswith(k)), None)
