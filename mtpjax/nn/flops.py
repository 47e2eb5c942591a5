"""Explicit FLOP accounting per token (for MFU and the MTP plan): every matmul counts 2·m·n·k.

Conventions, chosen once and used everywhere:
- Attention scores (QK^T) and values (PV) are counted over the full T×T matrix, not the causal half:
  the implementation computes the full masked matrix, and this matches the PaLM MFU convention.
  Per token that is 2·T·head_dim per query head for each of the two products.
- The embedding lookup is a gather: 0 FLOPs. Norms, RoPE, softmax and SwiGLU's elementwise product
  are not matmuls and are not counted.
- The shared head runs once per prediction depth (M = J + 1 times per token), tied or not.
- A mixture of experts counts what a token computes (active): the router, its k routed experts and the shared
  experts; the experts it does not reach are parameters (param_counts' total), not FLOPs.
- Training = 3 × forward (backward ≈ 2 × forward); rematerialization's recompute is not counted, so
  MFU stays comparable across remat settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpjax.config import ModelConfig


def _block_flops(m: ModelConfig, seq_len: int, moe: bool = False) -> dict[str, float]:
    """Forward FLOPs per token of one transformer block (`moe`: its MLP a mixture of experts), split into weight
    matmuls and attention."""
    d, h, kv, hd, f = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.resolved_d_ff
    proj = 2 * d * (h * hd) + 2 * 2 * d * (kv * hd) + 2 * (h * hd) * d  # wq, wk, wv, wo
    mlp = 3 * 2 * d * f  # gate, up, down
    if moe:  # router, then k routed and every shared expert (gate, up, down each)
        mlp = 2 * d * m.n_routed_experts + 3 * 2 * d * m.moe_d_ff * (m.num_experts_per_tok + m.n_shared_experts)
    attn = 2 * (2 * seq_len * hd * h)  # scores and values over all T keys, every query head
    if m.attention_kind == "mla":  # the expanded form training runs: q (through its latent), kv_a, kv_b, wo
        ql, c, qk, v = m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q = 2 * d * ql + 2 * ql * h * qk if ql else 2 * d * h * qk
        proj = q + 2 * d * (c + m.qk_rope_head_dim) + 2 * c * h * (m.qk_nope_head_dim + v) + 2 * h * v * d
        attn = 2 * seq_len * h * (qk + v)
    return {"matmul": float(proj + mlp), "attention": float(attn), "total": float(proj + mlp + attn)}


def cache_numbers_per_token(m: ModelConfig) -> int:
    """Numbers one attention layer caches per token for decoding: GQA's keys and values of every KV head, or
    MLA's latent and shared RoPE key."""
    if m.attention_kind == "mla":
        return m.kv_lora_rank + m.qk_rope_head_dim
    return 2 * m.n_kv_heads * m.resolved_head_dim


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> dict:
    """Forward FLOPs per token: trunk, each MTP module, each head application, and totals (train = 3× fwd)."""
    m, J = model_cfg, model_cfg.mtp_depth
    moe = m.mlp_kind == "moe"
    blk, dense = _block_flops(m, seq_len, moe), _block_flops(m, seq_len)
    eh_proj = 2 * (2 * m.d_model) * m.d_model if m.mtp_kind == "sequential" else 0
    n_dense = m.first_k_dense_replace if moe else m.n_layers  # the rest are blk (MoE)
    trunk = n_dense * dense["total"] + (m.n_layers - n_dense) * blk["total"]
    trunk_matmul = n_dense * dense["matmul"] + (m.n_layers - n_dense) * blk["matmul"]
    module = eh_proj + blk["total"]
    head = 2.0 * m.d_model * m.vocab_size
    forward = trunk + head + J * (module + head)
    return {
        "block": blk["total"],
        "block_matmul": blk["matmul"],
        "block_attention": blk["attention"],
        "trunk": trunk,
        "trunk_matmul": trunk_matmul,  # 2 x the weights a row reads (the head apart)
        "mtp_module": float(module),
        "mtp_module_matmul": float(eh_proj + blk["matmul"]),
        "mtp": [float(module)] * J,
        "head": head,
        "head_applications": J + 1,
        "forward": forward,
        "forward_by_depth": [trunk + head + k * (module + head) for k in range(J + 1)],
        "train": 3.0 * forward,
    }


def train_flops_per_token(model_cfg: ModelConfig, seq_len: int, frozen_trunk: bool = False, unroll: int = 0) -> float:
    """Training (forward + backward) FLOPs per token, MTP modules and every head application included, and `unroll`
    (loss.mtp_unroll) more applications of one module with their heads, costed like one more depth each.

    With a frozen trunk (train.freeze=trunk) the trunk and the main head run forward only, the MTP modules forward
    and backward, and their head applications forward plus the input gradient (the head's weights are frozen).
    λ does not enter: every application is computed in the one jitted step, whatever its weight at that step.
    """
    f = flops_per_token(model_cfg, seq_len)
    J = model_cfg.mtp_depth
    apps = J + (unroll if J else 0)
    if not frozen_trunk:
        return f["train"] + 3.0 * (apps - J) * (f["mtp_module"] + f["head"])
    return f["trunk"] + f["head"] + apps * (3 * f["mtp_module"] + 2 * f["head"])



def routed_flops_per_token(model_cfg: ModelConfig) -> dict[str, float]:
    """Forward FLOPs per token of the routed experts' matmuls (k experts: gate, up, down) in the trunk's MoE blocks
    and in one MTP module's: what the tokens need of the grouped matmuls (zero without a mixture of experts)."""
    m = model_cfg
    if m.mlp_kind != "moe":
        return {"trunk": 0.0, "module": 0.0}
    one = float(m.num_experts_per_tok * 3 * 2 * m.d_model * m.moe_d_ff)
    return {"trunk": (m.n_layers - m.first_k_dense_replace) * one, "module": one}


@dataclass(frozen=True)
class TokenFlops:
    """Forward FLOPs per token of one model's parts (`*_matmul`: the weight matmuls alone, 2 x the weights a row
    reads): what a proposer's draft cost and a plain decode step are counted in (mtpjax.nn.speed)."""

    trunk: float
    trunk_matmul: float
    module: float  # one MTP module's block (and input projection)
    module_matmul: float
    head: float  # one application of the shared head
    mtp_depth: int  # MTP modules

    @classmethod
    def per_token(cls, model_cfg: ModelConfig, seq_len: int) -> TokenFlops:
        """The record of flops_per_token's counts at this context length."""
        f = flops_per_token(model_cfg, seq_len)
        return cls(trunk=f["trunk"], trunk_matmul=f["trunk_matmul"], module=f["mtp_module"],
                   module_matmul=f["mtp_module_matmul"], head=f["head"], mtp_depth=model_cfg.mtp_depth)

    @property
    def plain_step(self) -> float:
        """A plain decode step's FLOPs per row: the trunk and the head."""
        return self.trunk + self.head

    @property
    def plain_reads(self) -> float:
        """The weights a plain decode step reads, as matmul FLOPs of one row."""
        return self.trunk_matmul + self.head
