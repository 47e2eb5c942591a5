"""The PyTorch peer: a Hugging Face `transformers` Llama of the same shape, carrying our trunk's weights.

Our trunk is a Llama (pre-norm RMSNorm, GQA with half-split RoPE, SwiGLU, tied head), so the peer
computes the same function; `max_logit_diff` checks that before any timing is trusted.
"""

from __future__ import annotations

import numpy as np


def available() -> str | None:
    """None when torch + transformers import, else the reason the peer is skipped."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install -e '.[peer]')"
    return None


def _np(x):
    return np.asarray(x, np.float32)


def build_peer(model, threads: int = 2):
    """A LlamaForCausalLM with the same d_model, layers, heads, kv heads, d_ff and vocab, and our trunk's weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    c = model.cfg
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.resolved_d_ff,
                         num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.resolved_head_dim, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                         max_position_embeddings=4096, tie_word_embeddings=c.tie_embeddings,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, attention_bias=False, mlp_bias=False)
    peer = LlamaForCausalLM(hf_cfg).eval()
    sd = {"model.embed_tokens.weight": _np(model.embed[...]), "model.norm.weight": _np(model.final_norm.scale[...])}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = _np(model.head[...]).T
    for i in range(c.n_layers):
        if c.scan_layers:
            pick = lambda v, i=i: _np(v[...])[i]  # noqa: E731
            blk = model.blocks
        else:
            pick = lambda v: _np(v[...])  # noqa: E731
            blk = model.blocks[i]
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": pick(blk.attn_norm.scale),
                   p + "post_attention_layernorm.weight": pick(blk.mlp_norm.scale)})
        for ours, theirs in [("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")]:
            sd[p + f"self_attn.{theirs}.weight"] = pick(getattr(blk.attn, ours).kernel).T
        for ours, theirs in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
            sd[p + f"mlp.{theirs}.weight"] = pick(getattr(blk.mlp, ours).kernel).T
    state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in sd.items()}  # writable copies
    missing, unexpected = peer.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (c.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"peer weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    if c.tie_embeddings:
        peer.tie_weights()
    return peer


def max_logit_diff(model, peer, tokens) -> float:
    """Largest |logit difference| between our trunk+head and the peer on one prompt (float32)."""
    import torch

    h, _ = model.trunk(np.asarray([tokens], np.int32))
    ours = np.asarray(model.logits(model.final_norm(h)))
    with torch.inference_mode():
        theirs = peer(torch.tensor([tokens])).logits.numpy()
    return float(np.abs(ours - theirs).max())


def peer_generate(peer, prompts, max_new: int, lookup: int = 0):
    """Greedy `generate` (prompt-lookup assisted when lookup > 0) of exactly max_new tokens per prompt; token lists."""
    import torch

    ids = torch.tensor(prompts)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                            do_sample=False, **kw)
    return out[:, ids.shape[1]:].tolist()


def peer_train_step(model, ocfg, tokens_BT, threads: int = 2, compile: bool = False):
    """A closure running one training step of the peer on `tokens_BT`: forward with SDPA attention and
    the shifted cross-entropy, backward, global-norm clipping and AdamW as `ocfg` (the optim section) sets
    them; `compile` wraps the forward in torch.compile (its backward is compiled with it). Returns the loss."""
    import torch

    peer = build_peer(model, threads).train()
    peer.config._attn_implementation = "sdpa"  # PyTorch's fused attention, what a user gets by default
    decay = [p for p in peer.parameters() if p.ndim > 1]  # as ours: no decay on 1-D parameters (norm scales)
    rest = [p for p in peer.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ocfg.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=ocfg.lr, betas=(ocfg.b1, ocfg.b2), eps=ocfg.eps)
    ids = torch.tensor(np.asarray(tokens_BT), dtype=torch.long)
    forward = lambda x: peer(input_ids=x, labels=x).loss  # noqa: E731
    if compile:
        forward = torch.compile(forward)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = forward(ids)
        loss.backward()
        if ocfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(peer.parameters(), ocfg.grad_clip)
        opt.step()
        return float(loss.detach())

    return step
