"""The rules that tie fields together (each field's own type, choices and bounds are the schema's)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from mtpjax.config.errors import fail
from mtpjax.config.types import parse_profile

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
NO_PATHS = ("stdlib", "induction", "algorithmic")  # sources that read no files
Rules = Iterator[tuple]  # (key, holds, what is allowed[, the value to name instead of the key's saved one])


def validate(cfg) -> None:
    """ConfigError for the first rule that does not hold, naming its key and the key's value as saved."""
    for key, holds, allowed, *value in _rules(cfg):
        if not holds:
            saved = cfg.to_dict()
            for part in re.findall(r"\w+", key):
                saved = saved[int(part)] if part.isdigit() else saved[part]
            raise fail(key, value[0] if value else saved, allowed)


def _rules(cfg) -> Rules:
    """Every rule, in the order they are checked (a rule may assume the ones before it hold)."""
    m, d = cfg.model, cfg.data
    yield "model.n_heads", m.d_model % m.n_heads == 0 or m.head_dim > 0, \
        f"must divide model.d_model={m.d_model} (or set model.head_dim)"
    yield "model.n_kv_heads", m.n_heads % m.n_kv_heads == 0, f"must divide model.n_heads={m.n_heads}"
    yield "model.head_dim", m.resolved_head_dim % 2 == 0, "must be even (RoPE rotates pairs)", m.resolved_head_dim
    yield "model.rope_high_freq_factor", m.rope_high_freq_factor > m.rope_low_freq_factor, \
        f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}"
    yield from _mla(m)
    yield "loss.chunk_size", cfg.loss.chunk_size == 0 or d.seq_len % cfg.loss.chunk_size == 0, \
        f"must divide data.seq_len={d.seq_len} (or be 0)"
    yield "data.text_field", bool(d.text_field), "must name a column / JSON field"
    yield "data.seq_len", d.seq_len >= m.mtp_depth + 2, \
        f"must be >= model.mtp_depth + 2 = {m.mtp_depth + 2} so every depth has a target"
    yield from _objective(cfg)
    if d.mixture:
        yield from _mixture(d)
    else:
        yield "data.paths", d.source in NO_PATHS or len(d.paths) > 0, f"data.source={d.source} needs at least one path"
    yield from _train(cfg)
    if m.mlp_kind == "moe":
        yield from _moe(cfg)
    yield from _stages(cfg)
    gqa_ok = m.n_kv_heads % cfg.mesh.tensor == 0 or cfg.mesh.tensor % m.n_kv_heads == 0
    yield "mesh.tensor", m.attention_kind == "mla" or gqa_ok, \
        f"must divide model.n_kv_heads={m.n_kv_heads} (or be a multiple of it)"


def _stages(cfg) -> Rules:
    """Pipeline stages split a scanned trunk's stacked blocks: evenly, or as mesh.stage_layers says."""
    m, S, counts = cfg.model, cfg.mesh.stage, cfg.mesh.stage_layers
    if counts:
        yield "mesh.stage_layers", len(counts) == S, f"needs one block count per stage: {S} numbers (mesh.stage={S})"
        yield "mesh.stage_layers", min(counts) > 0, "every stage needs at least one block: make each count >= 1"
        yield "mesh.stage_layers", sum(counts) == m.n_layers, f"must sum to model.n_layers={m.n_layers}"
    if S > 1:
        yield "mesh.stage", m.scan_layers, "splits a stacked trunk; set model.scan_layers=true"
        yield "mesh.stage", bool(counts) or m.n_layers % S == 0, \
            f"must divide model.n_layers={m.n_layers} (or set mesh.stage_layers, e.g. an uneven split)"
    if (R := cfg.mesh.stage_repeats) > 1:
        yield "mesh.stage_repeats", S > 1 and not counts, "needs pipeline stages split evenly: set mesh.stage >= 2 " \
            "and leave mesh.stage_layers empty"
        yield "mesh.stage_repeats", m.n_layers % (S * R) == 0, f"must divide model.n_layers / mesh.stage = " \
            f"{m.n_layers / S:g} (the blocks of a stage's chunks)"
        yield "mesh.stage_repeats", cfg.train.micro_batches >= S, f"needs train.micro_batches >= mesh.stage={S} (a " \
            "micro-batch comes round to the first stage again only after the others have entered)"


def _train(cfg) -> Rules:
    """The train section against itself, the model (what trains) and the data (own text's lengths)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    yield "train.micro_batches", t.batch_size % t.micro_batches == 0, f"must divide train.batch_size={t.batch_size}"
    yield "train.run_dir", bool(t.run_dir), "must be a directory path"
    if window := parse_profile(t.profile):
        yield "train.profile", window[0] < t.steps, f"starts at or past the run's end (train.steps={t.steps}), so " \
            f"nothing would be traced; use a start below {t.steps}"
    yield "train.freeze", t.freeze == "none" or m.mtp_depth > 0, \
        "freezing the trunk leaves nothing to train with model.mtp_depth=0; set model.mtp_depth >= 1"
    yield "train.freeze", t.freeze == "none" or bool(t.init_from), \
        "needs train.init_from=RUN_DIR (the trained trunk to freeze)"
    yield "train.keep_mtp", not t.keep_mtp or bool(t.init_from), \
        "needs train.init_from=RUN_DIR (the run whose MTP modules to keep)"
    if t.own_text != "off":
        yield "train.own_text", bool(t.init_from), "needs train.init_from=RUN_DIR (the trunk whose text to train on)"
        yield "train.own_text_prompt_len", t.own_text_prompt_len < d.seq_len, \
            f"must be < data.seq_len={d.seq_len} (the rest of each sequence is generated)"
        yield "train.own_text_sequences", t.own_text_sequences >= t.batch_size, \
            f"must be >= train.batch_size={t.batch_size} (one batch of them)"


def _mla(m) -> Rules:
    """Latent ranks within the width, a rotatable RoPE part, YaRN where its scale is defined, no q/k/v bias ignored."""
    yield "model.rope_scaling", m.rope_scaling != "yarn" or m.attention_kind == "mla", \
        "yarn is defined here for model.attention_kind=mla; use llama3, or set model.attention_kind=mla"
    yield "model.rope_beta_fast", m.rope_beta_fast > m.rope_beta_slow, \
        f"must be > model.rope_beta_slow={m.rope_beta_slow}"
    if m.attention_kind != "mla":
        return
    yield "model.qkv_bias", not m.qkv_bias, "biases gqa's q/k/v projections; model.attention_kind=mla has none, " \
        "so it would be ignored: set model.qkv_bias=false"
    for name in ("kv_lora_rank", "q_lora_rank"):
        yield f"model.{name}", getattr(m, name) <= m.d_model, \
            f"a latent rank above the width compresses nothing; use <= model.d_model={m.d_model}"
    yield "model.qk_rope_head_dim", m.qk_rope_head_dim % 2 == 0, "must be even (RoPE rotates pairs)"


def _objective(cfg) -> Rules:
    """Unrolling needs a module and room for its deepest target; a per-depth λ covers every application in time."""
    lo, J, steps = cfg.loss, cfg.model.mtp_depth, cfg.train.steps
    yield "loss.mtp_unroll", lo.mtp_unroll == 0 or J > 0, \
        "needs an MTP module to reuse; set model.mtp_depth >= 1 or loss.mtp_unroll=0"
    deepest = (1 if lo.mtp_unroll_module == "first" else J) + lo.mtp_unroll
    yield "loss.mtp_unroll", lo.mtp_unroll == 0 or cfg.data.seq_len >= deepest + 2, \
        f"its deepest application predicts {deepest + 1} tokens ahead; data.seq_len={cfg.data.seq_len} must be " \
        f">= {deepest + 2}"
    apps, lam = (J + lo.mtp_unroll) if J else 0, lo.mtp_lambda_depths
    if lam.kind == "each":
        yield "loss.mtp_lambda_depths", len(lam.each) == apps, f"has {len(lam.each)} schedules; give one per scored " \
            f"application: {apps} (model.mtp_depth={J} + loss.mtp_unroll={lo.mtp_unroll})"
    for at in [*lam.switch_steps(apps), *(s for x in lam.each if x.kind == "piecewise" for s in x.steps)]:
        yield "loss.mtp_lambda_depths", at < steps, \
            f"switches at step {at}, not before train.steps={steps}; use a smaller step or more train.steps"


def _moe(cfg) -> Rules:
    m, E = cfg.model, cfg.model.n_routed_experts
    yield "model.num_experts_per_tok", m.num_experts_per_tok <= E, f"must be <= model.n_routed_experts={E}"
    yield "model.n_group", E % m.n_group == 0, f"must divide model.n_routed_experts={E}"
    yield "model.n_group", m.n_group == 1 or E // m.n_group >= 2, \
        f"leaves one expert per group (a group's score is its top-2 sum); use <= {E // 2} groups or 1"
    yield "model.topk_group", m.topk_group <= m.n_group, f"must be <= model.n_group={m.n_group}"
    yield "model.num_experts_per_tok", m.num_experts_per_tok <= m.topk_group * (E // m.n_group), \
        f"must be <= the experts of model.topk_group={m.topk_group} groups ({m.topk_group * (E // m.n_group)})"
    yield "model.first_k_dense_replace", m.first_k_dense_replace < m.n_layers, \
        f"must be < model.n_layers={m.n_layers} (else use model.mlp_kind=dense)"
    yield "model.first_k_dense_replace", not m.scan_layers or m.first_k_dense_replace == 0, \
        "must be 0 with model.scan_layers=true (a scanned trunk stacks one block kind)"
    yield "mesh.expert", E % cfg.mesh.expert == 0, f"must divide model.n_routed_experts={E}"


def _mixture(d) -> Rules:
    yield "data.paths", not d.paths, "must be empty when data.mixture is set (each source has its paths)"
    for name in ("source", "text_field"):  # silently replaced, they would look used
        yield f"data.{name}", getattr(d, name) == type(d).model_fields[name].default, \
            "is replaced by data.mixture (each source sets its own); leave it out"
    yield "data.tokenizer", d.tokenizer != "bpe", "a mixture needs one fixed tokenizer for every source: byte, or a " \
        "tokenizer.json / .model (e.g. the one `python -m mtpjax.data prepare` trained)"
    for i, m in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        yield f"{key}.name", bool(_NAME_RE.match(m.name)), "must be a non-empty name of letters, digits, _ . -"
        yield f"{key}.name", m.name not in [s.name for s in d.mixture[:i]], \
            "is repeated; give every source its own name"
        yield f"{key}.paths", m.source in NO_PATHS or len(m.paths) > 0, f"source {m.source} needs at least one path"
        yield f"{key}.text_field", bool(m.text_field), "must name a column / JSON field"
