"""The serving engines' MiMo forward, re-implemented in torch from their source, reading only an exported directory.

Written from vLLM `model_executor/models/mimo.py`, `mimo_mtp.py`, `qwen2.py` and SGLang `models/mimo_mtp.py`:
- the trunk is Qwen2 (q/k/v biases, neox-style RoPE, GQA, SwiGLU); `MiMoModel.forward` returns
  `hidden_states + residual`, the residual stream *before* the final norm, and `compute_logits` applies
  `model.norm` then the head;
- MTP layer 0 (`MiMoMultiTokenPredictorLayer.forward`): `inputs_embeds[positions == 0] = 0`, then
  `input_proj(cat([hidden_layernorm(previous_hidden), token_layernorm(inputs_embeds)]))`, a Qwen2 decoder
  layer (its output plus its residual), `final_layernorm`, and the shared head;
- the checkpoint names the block's parameters `model.mtp_layers.0.<name>` (the loaders insert `mtp_block.`).
At position i the engine feeds the trunk's hidden state at i and the token x[i+1].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


def _load(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    out = {}
    for f in files:
        out.update({k: v.float() for k, v in load_file(str(directory / f)).items()})
    return out


class MiMoReference:
    """Trunk and MTP layer 0 of an exported MiMo directory, in float32 torch."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.cfg = json.loads((d / "config.json").read_text())
        if self.cfg.get("rope_scaling"):
            raise NotImplementedError("the reference implements default RoPE only")
        self.w = _load(d)
        c = self.cfg
        self.heads, self.kv, self.eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.theta = c["rope_theta"]

    def _rms(self, x, name):
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _lin(self, x, prefix, bias=False):
        y = x @ self.w[prefix + ".weight"].T
        return y + self.w[prefix + ".bias"] if bias else y

    def _rope(self, x, pos):  # neox style: rotate the two halves
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        ang = pos.float()[..., None] * inv  # [B, T, half]
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _layer(self, p, x, pos):
        """Qwen2DecoderLayer: returns its output plus its residual (what both engines add up)."""
        B, T, _ = x.shape
        h = self._rms(x, p + "input_layernorm.weight")
        q = self._rope(self._lin(h, p + "self_attn.q_proj", True).view(B, T, self.heads, self.head_dim), pos)
        k = self._rope(self._lin(h, p + "self_attn.k_proj", True).view(B, T, self.kv, self.head_dim), pos)
        v = self._lin(h, p + "self_attn.v_proj", True).view(B, T, self.kv, self.head_dim)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        s = torch.einsum("bthd,bshd->bhts", q, k) * self.head_dim ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, -1)
        x = x + self._lin(o, p + "self_attn.o_proj")
        h = self._rms(x, p + "post_attention_layernorm.weight")
        gated = F.silu(self._lin(h, p + "mlp.gate_proj")) * self._lin(h, p + "mlp.up_proj")
        return x + self._lin(gated, p + "mlp.down_proj")

    def head(self, h):
        w = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return h @ w.T

    def trunk(self, ids):
        """MiMoModel.forward: the residual stream after the last layer, before model.norm; positions 0..T-1."""
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.cfg["num_hidden_layers"]):
            x = self._layer(f"model.layers.{i}.", x, pos)
        return x

    def main_logits(self, ids):
        return self.head(self._rms(self.trunk(ids), "model.norm.weight"))

    def mtp_logits(self, next_ids, hidden, positions):
        """MTP layer 0 at `positions`: the trunk's hidden state there and the token that follows it."""
        p = "model.mtp_layers.0."
        e = self.w["model.embed_tokens.weight"][next_ids].clone()
        e[positions == 0] = 0  # "masking inputs at position 0, as not needed by MTP"
        x = self._lin(torch.cat([self._rms(hidden, p + "hidden_layernorm.weight"),
                                 self._rms(e, p + "token_layernorm.weight")], dim=-1), p + "input_proj")
        return self.head(self._rms(self._layer(p, x, positions), p + "final_layernorm.weight"))

    def depth1_logits(self, ids):
        """Logits of MTP layer 0 at positions 0..T-2 of a sequence, as the engine drafts them (teacher-forced)."""
        with torch.no_grad():
            h = self.trunk(ids)
            pos = torch.arange(ids.shape[1] - 1)[None].expand(ids.shape[0], -1)
            return self.mtp_logits(ids[:, 1:], h[:, :-1], pos)
