"""DeepSeek-V3's FP8 checkpoint format: float8 e4m3 linear weights, each with float32 block scales beside it.

A quantized `X.weight` [out, in] (safetensors F8_E4M3) has `X.weight_scale_inv` [ceil(out/bo), ceil(in/bi)]
(F32) for config.json's `quantization_config.weight_block_size` [bo, bi] (DeepSeek: [128, 128]); the weight is
float32(X.weight) * its block's scale, the edge blocks partial (DeepSeek's inference/kernel.py weight_dequant,
which fp8_cast_bf16.py runs and rounds to bfloat16). DeepSeek quantizes the attention and MLP / expert
projections only: embeddings, heads (shared_head.head too), norms, the router (`mlp.gate`), its bias and the MTP
layer's eh_proj stay bfloat16 (float32 for the bias).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from mtpjax.convert.errors import ConvertError

DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
SCALE = "_scale_inv"  # the suffix of a weight's scale tensor
BLOCK = (128, 128)
# the linear layers DeepSeek-V3's release stores in float8 (its inference/model.py Linear, with the fp8 dtype)
_QUANTIZED = re.compile(r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                        r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")


def config(block: tuple[int, int] = BLOCK) -> dict:
    """config.json's quantization_config for weights written by `quantize`."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def block_of(hf: dict) -> tuple[int, int] | None:
    """The weight block size config.json's quantization_config declares (None without one); ConvertError for a
    quantization mtpjax cannot read."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        what = f"{q.get('quant_method', '?')} {q.get('fmt', '')}".strip() if isinstance(q, dict) else repr(q)
        raise ConvertError(f"the checkpoint is quantized as {what}; import reads DeepSeek-V3's fp8 e4m3 block-scaled "
                           "checkpoints only: dequantize it to bfloat16 first and import that")
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConvertError(f"quantization_config.weight_block_size is {block!r}; it must be two positive integers "
                           "(DeepSeek-V3: [128, 128])")
    return int(block[0]), int(block[1])


def quantized(name: str) -> bool:
    """Whether DeepSeek-V3's release stores this tensor in float8 (with block scales)."""
    return _QUANTIZED.search(name) is not None


def scale_shape(shape: tuple, block: tuple[int, int]) -> tuple[int, int]:
    """The block-scale grid of a weight: ceil(out / bo) x ceil(in / bi)."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


def _blocks(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """w zero-padded to whole blocks, as [rows of blocks, bo, columns of blocks, bi]."""
    (r, c), (bo, bi) = scale_shape(w.shape, block), block
    padded = np.zeros((r * bo, c * bi), w.dtype)
    padded[:w.shape[0], :w.shape[1]] = w
    return padded.reshape(r, bo, c, bi)


def dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32(w) times its block's scale (partial edge blocks included), float32."""
    x = _blocks(np.asarray(w).astype(np.float32), block) * np.asarray(scale_inv, np.float32)[:, None, :, None]
    return x.reshape(x.shape[0] * block[0], -1)[:w.shape[0], :w.shape[1]]


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8 e4m3 weight, float32 scale_inv): each block scaled so that its largest magnitude is 448, as
    DeepSeek's and transformers' quantizers do (an all-zero block gets scale 1)."""
    x = _blocks(np.asarray(w, np.float32), block)
    amax = np.abs(x).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / MAX, 1.0).astype(np.float32)
    q = np.clip(x / scale_inv[:, None, :, None], -MAX, MAX).astype(DTYPE)
    return q.reshape(x.shape[0] * block[0], -1)[:w.shape[0], :w.shape[1]], scale_inv


class BlockScaled:
    """A safetensors Reader whose float8 weights read as float32, dequantized by their block scales; the scale
    tensors themselves are hidden. Checked up front: every float8 weight has a scale of the right grid."""

    def __init__(self, reader, block: tuple[int, int] | None):
        self.reader, self.block = reader, block
        scales = {n for n in reader.entries if n.endswith(SCALE)}
        self.entries = {}
        for name, e in reader.entries.items():
            if e.dtype == DTYPE:
                self._check(name, e.shape, scales)
                self.entries[name] = e._replace(dtype=np.dtype(np.float32))
            elif name not in scales:
                self.entries[name] = e
        for s in scales:
            if s.removesuffix(SCALE) not in self.entries or reader.entries[s.removesuffix(SCALE)].dtype != DTYPE:
                raise ConvertError(f"the checkpoint has block scales {s} for a tensor that is not float8; it does "
                                   "not match DeepSeek-V3's fp8 layout")

    def _check(self, name: str, shape: tuple, scales: set) -> None:
        where = "; the checkpoint does not match its quantization_config"
        if self.block is None:
            raise ConvertError(f"tensor {name} is float8 but config.json has no quantization_config (its "
                               "weight_block_size); add DeepSeek-V3's or dequantize the checkpoint to bfloat16 first")
        if len(shape) != 2:
            raise ConvertError(f"tensor {name} is float8 of shape {list(shape)}; only 2-D block-scaled weights are "
                               "read")
        if name + SCALE not in scales:
            raise ConvertError(f"tensor {name} is float8 but the checkpoint lacks its block scales {name + SCALE}; "
                               "restore the file that holds them")
        got, want = self.reader.entries[name + SCALE].shape, scale_shape(shape, self.block)
        if got != want:
            raise ConvertError(f"block scales {name + SCALE} have shape {list(got)}, but weight_block_size "
                               f"{list(self.block)} over {list(shape)} gives {list(want)}{where}")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def array(self, name: str) -> np.ndarray:
        """The tensor as stored, or a float8 weight dequantized (a float32 copy)."""
        a = self.reader.array(name)
        if a.dtype != DTYPE:
            return a
        return dequantize(a, self.reader.array(name + SCALE), self.block)
