"""The serving engines' DeepSeek-V3 forward with its MTP layer, re-implemented in torch, reading only an exported
directory.

Written from DeepSeek-V3's `inference/model.py`, vLLM `model_executor/models/deepseek_v2.py` and `deepseek_mtp.py`:
- MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)); kv_a_proj_with_mqa(x) splits into the latent
  (kv_a_layernorm) and one RoPE key shared by every head; kv_b_proj expands the latent into per-head no-RoPE keys
  and values; softmax scale (qk_nope + qk_rope)^-1/2. RoPE rotates *interleaved* pairs (x[2i], x[2i+1]) by
  frequency i (DeepSeek's complex multiply, the engines' is_neox_style=False);
- MoE layers (index >= first_k_dense_replace): sigmoid scores, e_score_correction_bias added for the choice only,
  groups scored by their top-2 biased scores, topk_group groups kept, top-k experts; weights the chosen unbiased
  scores normalized over the k, times routed_scaling_factor; plus the shared experts;
- the trunk returns model.norm of the last layer's output: the *normed* state, what the MTP layer reads;
- MTP layer L (`DeepSeekMultiTokenPredictorLayer.forward`): `inputs_embeds[positions == 0] = 0`, then
  eh_proj(cat([enorm(embed(x[i+1])), hnorm(h[i])])), the decoder layer (output plus residual),
  shared_head.norm and shared_head.head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from mimo_reference import _load


class DeepSeekReference:
    """Trunk and MTP layer L of an exported DeepSeek-V3 directory, in float32 torch."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.cfg = c = json.loads((d / "config.json").read_text())
        if c.get("rope_scaling") or not c.get("rope_interleave", True):
            raise NotImplementedError("the reference implements default, interleaved RoPE only")
        self.w = _load(d)
        self.eps, self.heads, self.theta = c["rms_norm_eps"], c["num_attention_heads"], c["rope_theta"]
        self.nope, self.rope, self.vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.rank, self.L = c["kv_lora_rank"], c["num_hidden_layers"]

    def _rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _lin(self, x, name):
        return x @ self.w[name].T

    def _rope(self, x, pos):  # interleaved pairs as complex numbers
        inv = 1.0 / (self.theta ** (torch.arange(0, self.rope, 2, dtype=torch.float32) / self.rope))
        ang = pos.float()[..., None] * inv  # [B, T, r/2]
        rot = torch.polar(torch.ones_like(ang), ang)
        while rot.dim() < x.dim():
            rot = rot.unsqueeze(-2)
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * rot).flatten(-2)

    def _attention(self, p, x, pos):
        B, T, _ = x.shape
        a = p + "self_attn."
        if a + "q_a_proj.weight" in self.w:
            q = self._lin(self._rms(self._lin(x, a + "q_a_proj.weight"), a + "q_a_layernorm.weight"),
                          a + "q_b_proj.weight")
        else:
            q = self._lin(x, a + "q_proj.weight")
        q = q.view(B, T, self.heads, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], self._rope(q[..., self.nope:], pos)
        kv = self._lin(x, a + "kv_a_proj_with_mqa.weight")
        latent = self._rms(kv[..., :self.rank], a + "kv_a_layernorm.weight")
        k_pe = self._rope(kv[..., self.rank:], pos)  # [B, T, r], one for every head
        kvb = self._lin(latent, a + "kv_b_proj.weight").view(B, T, self.heads, self.nope + self.vdim)
        k_nope, v = kvb[..., :self.nope], kvb[..., self.nope:]
        s = (torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe))
        s = s * (self.nope + self.rope) ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, -1)
        return self._lin(o, a + "o_proj.weight")

    def _swiglu(self, x, p):
        return self._lin(F.silu(self._lin(x, p + "gate_proj.weight")) * self._lin(x, p + "up_proj.weight"),
                         p + "down_proj.weight")

    def _moe(self, x, p):
        c = self.cfg
        E, k, G = c["n_routed_experts"], c["num_experts_per_tok"], c["n_group"]
        flat = x.reshape(-1, x.shape[-1])
        scores = (flat @ self.w[p + "gate.weight"].T).sigmoid()
        biased = scores + self.w[p + "gate.e_score_correction_bias"]
        group = biased.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(c["topk_group"], dim=-1)[1], 1.0)
        biased = biased.masked_fill(~keep.repeat_interleave(E // G, dim=1).bool(), float("-inf"))
        idx = biased.topk(k, dim=-1)[1]
        wts = scores.gather(1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        out = torch.zeros_like(flat)
        for e in range(E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if len(rows):
                out[rows] += wts[rows, slot, None] * self._swiglu(flat[rows], f"{p}experts.{e}.")
        if c.get("n_shared_experts"):
            out = out + self._swiglu(flat, p + "shared_experts.")
        return out.view(x.shape)

    def _layer(self, i, x, pos):
        """A decoder layer: its output plus its residual."""
        p = f"model.layers.{i}."
        x = x + self._attention(p, self._rms(x, p + "input_layernorm.weight"), pos)
        h = self._rms(x, p + "post_attention_layernorm.weight")
        moe = i >= self.cfg["first_k_dense_replace"]
        return x + (self._moe(h, p + "mlp.") if moe else self._swiglu(h, p + "mlp."))

    def trunk(self, ids):
        """DeepseekV2Model.forward: model.norm of the last layer's output (the state the MTP layer reads)."""
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        x = self.w["model.embed_tokens.weight"][ids]
        for i in range(self.L):
            x = self._layer(i, x, pos)
        return self._rms(x, "model.norm.weight")

    def main_logits(self, ids):
        with torch.no_grad():
            return self._lin(self.trunk(ids), "lm_head.weight")

    def mtp_logits(self, next_ids, hidden, positions):
        """MTP layer L at `positions`: the trunk's normed state there and the token that follows it."""
        p = f"model.layers.{self.L}."
        e = self.w[p + "embed_tokens.weight"][next_ids].clone()
        e[positions == 0] = 0  # "masking inputs at position 0, as not needed by MTP"
        x = self._lin(torch.cat([self._rms(e, p + "enorm.weight"), self._rms(hidden, p + "hnorm.weight")], -1),
                      p + "eh_proj.weight")
        h = self._layer(self.L, x, positions)
        return self._lin(self._rms(h, p + "shared_head.norm.weight"), p + "shared_head.head.weight")

    def depth1_logits(self, ids):
        """Logits of MTP layer L at positions 0..T-2 of a sequence, as the engine drafts them (teacher-forced)."""
        with torch.no_grad():
            h = self.trunk(ids)
            pos = torch.arange(ids.shape[1] - 1)[None].expand(ids.shape[0], -1)
            return self.mtp_logits(ids[:, 1:], h[:, :-1], pos)
