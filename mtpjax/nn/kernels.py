"""Fused attention kernels behind `model.attention`, and the choice among them (`attention_backend`, for the placement's
platform; `layers.self_attention` calls it): cuDNN, Pallas GPU, TPU splash.

Each adapter computes what `layers.attend` computes for the training forward — causal attention over positions
0..T-1 (no cache), restricted to equal segment ids when they are given, grouped-query heads — from the same
inputs: q [B,T,K,R,H] already scaled by 1/sqrt(H), k and v [B,T,K,H], segment ids [B,T] or None. T is padded
up to what a kernel needs; padded keys come after every real query (causal) and carry segment id -1, so no
real query sees them, and the padded rows of the output are dropped.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from mtpjax.nn.placement import Placement

PAD_SEGMENT = -1  # data segment ids are >= 0 (0 = padding), so a padded position matches no real one


def note(message: str, topic: str = "attention") -> None:
    """One `topic: ...` line on stderr (a kernel's choice), once per process and message (process 0 only)."""
    line = f"{topic}: {message}"
    if line not in _NOTED and jax.process_index() == 0:
        try:  # tqdm.write: above a progress bar, never glued to it; a bare device image (bench/accelerator.py) lacks it
            from tqdm import tqdm
        except ImportError:
            print(line, file=sys.stderr)
        else:
            tqdm.write(line, file=sys.stderr)
    _NOTED.add(line)


_NOTED: set[str] = set()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad(x, T_pad: int, value=0):
    """x padded along axis 1 (positions) to T_pad with `value`."""
    extra = T_pad - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def cudnn_attention(q_BTKRH, k_BTKH, v_BTKH, seg_BT, *, implementation: str = "cudnn"):
    """jax.nn.dot_product_attention (cuDNN flash attention on GPU; implementation="xla" runs the same call on CPU).

    Its public signature takes no segment ids (query_seq_lengths only trims one padded tail per row), so packed
    documents go in as a dense [B,1,T,T] mask, which cuDNN reads as a bias: exact, but it moves T² values per row.
    """
    B, T, K, R, H = q_BTKRH.shape
    T_pad = _round_up(T, 2)  # cuDNN trains with a bias only on even lengths
    q = _pad(q_BTKRH.reshape(B, T, K * R, H), T_pad)
    k, v = _pad(k_BTKH, T_pad), _pad(v_BTKH, T_pad)
    mask = None
    if seg_BT is not None:
        seg = _pad(seg_BT, T_pad, PAD_SEGMENT)
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    o = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True, implementation=implementation)
    return o[:, :T].reshape(B, T, K, R, H)


def pallas_gpu_attention(q_BTKRH, k_BTKH, v_BTKH, seg_BT, *, interpret: bool = False, block: int = 128,
                         bwd_block: int = 32, num_warps: int | None = None, num_stages: int = 2):
    """The Pallas GPU (Triton) flash-attention kernel with segment ids; it wants as many KV heads as query heads.
    Tiles: `block` for the forward's, `bwd_block` for the backward's (bench/attention_gpu.py times choices)."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    B, T, K, R, H = q_BTKRH.shape
    block = min(block, 1 << max(4, (T - 1).bit_length()))  # a power of two, no larger than T needs
    T_pad = _round_up(T, block)
    q = _pad(q_BTKRH.reshape(B, T, K * R, H), T_pad)
    k, v = (_pad(jnp.repeat(x, R, axis=2), T_pad) for x in (k_BTKH, v_BTKH))  # head k*R + r reads KV head k
    seg = None if seg_BT is None else _pad(seg_BT, T_pad, PAD_SEGMENT)
    bwd = min(bwd_block, block)
    sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd, block_kv_dkv=bwd,
                                     block_q_dq=bwd, block_kv_dq=bwd)
    o = gpu_attention.mha(q, k, v, seg, sm_scale=1.0, causal=True, block_sizes=sizes, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret)
    return o[:, :T].reshape(B, T, K, R, H)


@functools.cache
def _splash_kernel(T_pad: int, n_heads: int, block: int, interpret: bool):
    """A causal splash-attention kernel for one row ([N,T,H] queries, [K,T,H] keys), built once per shape."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((T_pad, T_pad)) for _ in range(n_heads)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # its mask arrays concrete, never a trace's: the kernel outlives the trace
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q_BTKRH, k_BTKH, v_BTKH, seg_BT, *, interpret: bool = False, block: int | None = None):
    """The Pallas TPU splash-attention kernel (grouped-query heads and segment ids natively), vmapped over rows."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    B, T, K, R, H = q_BTKRH.shape
    block = block or (512 if T > 256 else 128)
    T_pad = _round_up(T, block)
    q_BNTH = _pad(q_BTKRH.reshape(B, T, K * R, H), T_pad).transpose(0, 2, 1, 3)
    k_BKTH, v_BKTH = (_pad(x, T_pad).transpose(0, 2, 1, 3) for x in (k_BTKH, v_BTKH))
    kernel = _splash_kernel(T_pad, K * R, block, interpret)
    if seg_BT is None:
        o_BNTH = jax.vmap(kernel)(q_BNTH, k_BKTH, v_BKTH)
    else:
        seg = _pad(seg_BT, T_pad, PAD_SEGMENT)
        o_BNTH = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(s, s)))(q_BNTH, k_BKTH, v_BKTH, seg)
    return o_BNTH.transpose(0, 2, 1, 3)[:, :T].reshape(B, T, K, R, H)


def pad_heads(q_BTKRH, k_BTKH, v_BTKH, width: int):
    """q, k and v zero-padded on their last axis to `width`."""
    pad = lambda x: x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    return pad(q_BTKRH), pad(k_BTKH), pad(v_BTKH)


def per_device(kernel, placement: Placement, q_BTKRH, k_BTKH, v_BTKH, seg_BT):
    """`kernel(q, k, v, seg)` run on each device's rows and heads (jax.shard_map): the batch split over the
    placement's batch axes (`rows_axes`), the KV heads over its head axis (else the query heads of each group, k and v
    then replicated), so a multi-device mesh neither gathers q/k/v around the kernel nor asks the compiler to
    partition it (Mosaic kernels cannot be). A mesh of one device calls the kernel directly."""
    mesh, head_axis = placement.mesh, placement.head_axis
    if mesh is None or mesh.size == 1:
        return kernel(q_BTKRH, k_BTKH, v_BTKH, seg_BT)
    from jax.sharding import PartitionSpec as P

    B, _, K, R, _ = q_BTKRH.shape
    rows = placement.rows_axes(B) or None
    t = mesh.shape[head_axis] if head_axis else 1
    kv_h = head_axis if t > 1 and K % t == 0 else None
    q_h = head_axis if t > 1 and kv_h is None and R % t == 0 else None
    q_spec, kv_spec = P(rows, None, kv_h, q_h, None), P(rows, None, kv_h, None)
    args, specs = (q_BTKRH, k_BTKH, v_BTKH), (q_spec, kv_spec, kv_spec)
    if seg_BT is not None:
        args, specs = args + (seg_BT,), specs + (P(rows, None),)
    body = lambda q, k, v, *seg: kernel(q, k, v, seg[0] if seg else None)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


# ----------------------------------------------------------------------------- the choice


KERNEL_PLATFORM = {"cudnn": "gpu", "pallas": "gpu", "splash": "tpu"}  # where each fused kernel compiles
INTERPRET_ENV = "MTPJAX_ATTENTION_INTERPRET"  # "1": a Pallas kernel off its platform runs interpreted, not replaced


def _cudnn_ok(dtype: str, head_dim: int) -> bool:
    # cuDNN's flash attention takes bf16/fp16 with head dims that are multiples of 8 (<= 128 before Hopper).
    return dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and head_dim <= 128


def _auto_attention(platform: str, dtype: str) -> str:
    # GPU: Pallas (Triton), which takes segment ids natively where cuDNN's public call needs a dense [B,1,T,T] mask,
    # and compiles without the cuDNN library (ahead of time included); a float32 model keeps the XLA reference.
    return {"tpu": "splash", "gpu": "pallas" if dtype in ("bfloat16", "float16") else "xla"}.get(platform, "xla")


@functools.cache
def attention_backend(name: str, platform: str, dtype: str, head_dim: int, interpret_ok: bool) -> tuple[str, bool]:
    """(backend, interpret) that `model.attention=name` runs as on `platform` (the mesh's devices'); every choice and
    fallback is noted once.

    auto: splash on TPU, Pallas on GPU (bf16/fp16), else the XLA reference. An explicit kernel off its platform
    falls back to auto's choice, or runs in Pallas interpret mode when `interpret_ok` (pallas, splash; tests).
    """
    auto = _auto_attention(platform, dtype)
    if name == "auto":
        note(f"model.attention=auto runs {auto} on {platform} ({dtype}, head_dim {head_dim})")
        return auto, False
    if name == "xla" or (KERNEL_PLATFORM[name] == platform and (name != "cudnn" or _cudnn_ok(dtype, head_dim))):
        return name, False
    if interpret_ok and name != "cudnn":
        note(f"model.attention={name} runs in Pallas interpret mode on {platform} (slow; for tests)")
        return name, True
    need = ("a GPU with bf16/fp16 compute and head_dim <= 128" if name == "cudnn" else
            f"a {KERNEL_PLATFORM[name].upper()}")
    note(f"model.attention={name} needs {need} (this is {platform}, {dtype}); using {auto}")
    return auto, False


def fused_attention(backend: str, interpret: bool, q_BTKRH, k_BTKH, v_BTKH, seg_BT, placement: Placement):
    """A fused kernel's causal attention, run per device over the placement's batch and head axes
    (per_device); values narrower than queries and keys (MLA) are zero-padded to their width and cut back."""
    qk, hv = q_BTKRH.shape[-1], v_BTKH.shape[-1]
    width = max(qk, hv)
    if qk != hv:
        note(f"{backend}: query/key width {qk} and value width {hv} differ; values zero-padded to {width} "
             f"(attention FLOPs x{2 * width / (qk + hv):.2f}, value reads x{width / hv:.2f})")
        q_BTKRH, k_BTKH, v_BTKH = pad_heads(q_BTKRH, k_BTKH, v_BTKH, width)
    if backend == "cudnn":
        if seg_BT is not None:
            note("cudnn: jax.nn.dot_product_attention takes no segment ids; packed documents are masked "
                 "with a dense [B,1,T,T] mask (exact, but T^2 values per row: compare model.attention=pallas)")
        fn = cudnn_attention
    elif backend == "pallas":  # tiles measured on an H200 (bench/attention_gpu.py): a backward tile of 64 runs
        # forward + backward 1.8x faster than 32 at width 128; wider heads need smaller tiles (shared memory)
        block, bwd = (128, 64) if width <= 128 else (64, 32)
        fn = functools.partial(pallas_gpu_attention, interpret=interpret, block=block, bwd_block=bwd)
    else:
        fn = functools.partial(splash_attention, interpret=interpret)
    return per_device(fn, placement, q_BTKRH, k_BTKH, v_BTKH, seg_BT)[..., :hv]
