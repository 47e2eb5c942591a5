"""The rules that tie fields together (each field's own type, choices and bounds are the schema's)."""

from __future__ import annotations

import re
from typing import Any

from mtpjax.config.errors import fail
from mtpjax.config.types import parse_profile

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
NO_PATHS = ("stdlib", "induction", "algorithmic")  # sources that read no files


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise fail(key, value, allowed)


def validate(cfg) -> None:
    """ConfigError for the first impossible combination (the schema has checked each field's type and bounds)."""
    m, d = cfg.model, cfg.data
    _check(m.d_model % m.n_heads == 0 or m.head_dim > 0, "model.n_heads", m.n_heads,
           f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    _check(m.resolved_head_dim % 2 == 0, "model.head_dim", m.resolved_head_dim, "must be even (RoPE rotates pairs)")
    _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor", m.rope_high_freq_factor,
           f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}")
    _check_mla(m)
    _check(cfg.loss.chunk_size == 0 or d.seq_len % cfg.loss.chunk_size == 0, "loss.chunk_size",
           cfg.loss.chunk_size, f"must divide data.seq_len={d.seq_len} (or be 0)")

    _check(bool(d.text_field), "data.text_field", d.text_field, "must name a column / JSON field")
    _check(d.seq_len >= m.mtp_depth + 2, "data.seq_len", d.seq_len,
           f"must be >= model.mtp_depth + 2 = {m.mtp_depth + 2} so every depth has a target")
    _check_objective(cfg)
    if d.mixture:
        _check_mixture(d)
    else:
        _check(d.source in NO_PATHS or len(d.paths) > 0, "data.paths", list(d.paths),
               f"data.source={d.source} needs at least one path")

    _check_train(cfg)
    if m.mlp_kind == "moe":
        _check_moe(cfg)
    _check_stages(cfg)
    gqa_ok = m.n_kv_heads % cfg.mesh.tensor == 0 or cfg.mesh.tensor % m.n_kv_heads == 0
    _check(m.attention_kind == "mla" or gqa_ok, "mesh.tensor", cfg.mesh.tensor,
           f"must divide model.n_kv_heads={m.n_kv_heads} (or be a multiple of it)")


def _check_train(cfg) -> None:
    """The train section against itself, the model (what trains) and the data (own text's lengths)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    _check(t.batch_size % t.micro_batches == 0, "train.micro_batches", t.micro_batches,
           f"must divide train.batch_size={t.batch_size}")
    _check(bool(t.run_dir), "train.run_dir", t.run_dir, "must be a directory path")
    parse_profile(t.profile)
    _check(t.freeze == "none" or m.mtp_depth > 0, "train.freeze", t.freeze,
           "freezing the trunk leaves nothing to train with model.mtp_depth=0; set model.mtp_depth >= 1")
    _check(t.freeze == "none" or bool(t.init_from), "train.freeze", t.freeze,
           "needs train.init_from=RUN_DIR (the trained trunk to freeze)")
    _check(not t.keep_mtp or bool(t.init_from), "train.keep_mtp", t.keep_mtp,
           "needs train.init_from=RUN_DIR (the run whose MTP modules to keep)")
    if t.own_text != "off":
        _check(bool(t.init_from), "train.own_text", t.own_text, "needs train.init_from=RUN_DIR (the trunk whose "
               "text to train on)")
        _check(t.own_text_prompt_len < d.seq_len, "train.own_text_prompt_len", t.own_text_prompt_len,
               f"must be < data.seq_len={d.seq_len} (the rest of each sequence is generated)")
        _check(t.own_text_sequences >= t.batch_size, "train.own_text_sequences", t.own_text_sequences,
               f"must be >= train.batch_size={t.batch_size} (one batch of them)")


def _check_mla(m) -> None:
    """Latent ranks within the width, a rotatable RoPE part, YaRN only where its softmax scale is defined."""
    _check(m.rope_scaling != "yarn" or m.attention_kind == "mla", "model.rope_scaling", m.rope_scaling,
           "yarn is defined here for model.attention_kind=mla; use llama3, or set model.attention_kind=mla")
    _check(m.rope_beta_fast > m.rope_beta_slow, "model.rope_beta_fast", m.rope_beta_fast,
           f"must be > model.rope_beta_slow={m.rope_beta_slow}")
    if m.attention_kind != "mla":
        return
    for name in ("kv_lora_rank", "q_lora_rank"):
        _check(getattr(m, name) <= m.d_model, f"model.{name}", getattr(m, name),
               f"a latent rank above the width compresses nothing; use <= model.d_model={m.d_model}")
    _check(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim", m.qk_rope_head_dim,
           "must be even (RoPE rotates pairs)")


def _check_objective(cfg) -> None:
    """Unrolling needs a module and room for its deepest target; a per-depth λ covers every application in time."""
    lo, J, steps = cfg.loss, cfg.model.mtp_depth, cfg.train.steps
    _check(lo.mtp_unroll == 0 or J > 0, "loss.mtp_unroll", lo.mtp_unroll,
           "needs an MTP module to reuse; set model.mtp_depth >= 1 or loss.mtp_unroll=0")
    deepest = (1 if lo.mtp_unroll_module == "first" else J) + lo.mtp_unroll
    _check(lo.mtp_unroll == 0 or cfg.data.seq_len >= deepest + 2, "loss.mtp_unroll", lo.mtp_unroll,
           f"its deepest application predicts {deepest + 1} tokens ahead; data.seq_len={cfg.data.seq_len} must be "
           f">= {deepest + 2}")
    apps, lam = (J + lo.mtp_unroll) if J else 0, lo.mtp_lambda_depths
    if lam.kind == "each":
        _check(len(lam.each) == apps, "loss.mtp_lambda_depths", str(lam), f"has {len(lam.each)} schedules; give one "
               f"per scored application: {apps} (model.mtp_depth={J} + loss.mtp_unroll={lo.mtp_unroll})")
    for at in [*lam.switch_steps(apps), *(s for x in lam.each if x.kind == "piecewise" for s in x.steps)]:
        _check(at < steps, "loss.mtp_lambda_depths", str(lam),
               f"switches at step {at}, not before train.steps={steps}; use a smaller step or more train.steps")


def _check_stages(cfg) -> None:
    """Pipeline stages split a scanned trunk's stacked blocks evenly."""
    m, S = cfg.model, cfg.mesh.stage
    if S == 1:
        return
    _check(m.scan_layers, "mesh.stage", S, "splits a stacked trunk; set model.scan_layers=true")
    _check(m.n_layers % S == 0, "mesh.stage", S, f"must divide model.n_layers={m.n_layers}")


def _check_moe(cfg) -> None:
    m, E = cfg.model, cfg.model.n_routed_experts
    _check(m.num_experts_per_tok <= E, "model.num_experts_per_tok", m.num_experts_per_tok,
           f"must be <= model.n_routed_experts={E}")
    _check(E % m.n_group == 0, "model.n_group", m.n_group, f"must divide model.n_routed_experts={E}")
    _check(m.n_group == 1 or E // m.n_group >= 2, "model.n_group", m.n_group,
           f"leaves one expert per group (a group's score is its top-2 sum); use <= {E // 2} groups or 1")
    _check(m.topk_group <= m.n_group, "model.topk_group", m.topk_group, f"must be <= model.n_group={m.n_group}")
    _check(m.num_experts_per_tok <= m.topk_group * (E // m.n_group), "model.num_experts_per_tok",
           m.num_experts_per_tok, f"must be <= the experts of model.topk_group={m.topk_group} groups "
           f"({m.topk_group * (E // m.n_group)})")
    _check(m.first_k_dense_replace < m.n_layers, "model.first_k_dense_replace", m.first_k_dense_replace,
           f"must be < model.n_layers={m.n_layers} (else use model.mlp_kind=dense)")
    _check(not m.scan_layers or m.first_k_dense_replace == 0, "model.first_k_dense_replace",
           m.first_k_dense_replace, "must be 0 with model.scan_layers=true (a scanned trunk stacks one block kind)")
    _check(E % cfg.mesh.expert == 0, "mesh.expert", cfg.mesh.expert, f"must divide model.n_routed_experts={E}")


def _check_mixture(d) -> None:
    _check(not d.paths, "data.paths", list(d.paths),
           "must be empty when data.mixture is set (each source has its paths)")
    _check(d.tokenizer != "bpe", "data.tokenizer", d.tokenizer, "a mixture needs one fixed tokenizer for every "
           "source: byte, or a tokenizer.json / .model (e.g. the one `python -m mtpjax.data prepare` trained)")
    seen = set()
    for i, m in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        _check(bool(_NAME_RE.match(m.name)), f"{key}.name", m.name,
               "must be a non-empty name of letters, digits, _ . -")
        _check(m.name not in seen, f"{key}.name", m.name, "is repeated; give every source its own name")
        seen.add(m.name)
        _check(m.source in NO_PATHS or len(m.paths) > 0, f"{key}.paths", list(m.paths),
               f"source {m.source} needs at least one path")
        _check(bool(m.text_field), f"{key}.text_field", m.text_field, "must name a column / JSON field")
