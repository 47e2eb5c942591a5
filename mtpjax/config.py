"""One config schema: frozen dataclasses loaded from YAML plus dotted overrides, validated early."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtpjax.errors import MtpjaxError


class ConfigError(MtpjaxError, ValueError):
    """A config value is wrong; the message is one line naming the key, the value and what is allowed."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 0  # 0: SwiGLU width ~8/3 d_model rounded up to a multiple of 64
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | llama3 (the four rope_* fields below)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2)
    tie_embeddings: bool = True
    mtp_depth: int = 1
    mtp_kind: str = "sequential"  # sequential (DeepSeek-V3) | parallel (Gloeckle et al.)
    mtp_init: str = "random"  # random | last_block (each module's block starts as a copy of the last trunk block)
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots
    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"
    init_std: float = 0.02
    attention: str = "auto"  # auto | xla | cudnn | pallas | splash: how attention is computed, not what (runtime-only)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        return self.d_ff or -(-(8 * self.d_model // 3) // 64) * 64

    @property
    def llama3_rope(self) -> tuple | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_len) when rope_scaling is llama3, else None."""
        if self.rope_scaling != "llama3":
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                float(self.rope_original_max_len))


@dataclass(frozen=True)
class LossConfig:
    # constant:0.3 | piecewise:0.3@1000,0.1 | linear:0.3->0.1@1000 | cosine:0.3->0.1@1000 (steps)
    mtp_lambda: str = "constant:0.3"
    chunk_size: int = 0  # sequence positions per cross-entropy chunk; 0 = whole sequence at once
    mtp_target: str = "data"  # data | self (the main head's distribution at i+k) | mix:<w> (w self + (1-w) data)
    distill_temperature: float = 1.0  # temperature of both distributions in the self target's soft cross-entropy


SOURCES = ("stdlib", "text", "array", "parquet", "arrow")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class MixtureSource:
    """One source of a weighted data mixture (data.mixture); the rest of DataConfig is shared."""

    name: str = ""  # TensorBoard tag part: eval/<name>/loss/main
    source: str = "text"  # text | parquet | arrow | array | stdlib
    paths: tuple[str, ...] = ()
    weight: float = 1.0  # share of training windows (weights are normalized)
    text_field: str = "text"  # the text column (parquet/arrow) or JSON-lines field


@dataclass(frozen=True)
class DataConfig:
    # Keys that do not change the prepared tokens or the stream: a resumed run may change them.
    source: str = "stdlib"  # stdlib | text | array | parquet | arrow
    paths: tuple[str, ...] = ()
    text_field: str = "text"  # the text column of parquet/arrow files, the field of JSON lines
    mixture: tuple[MixtureSource, ...] = ()  # weighted sources; replaces source/paths/text_field
    tokenizer: str = "byte"  # byte | bpe | path to tokenizer.json or sentencepiece .model
    bpe_vocab_size: int = 1024
    seq_len: int = 256
    cache_dir: str = "~/.cache/mtpjax"
    val_fraction: float = 0.05
    shuffle: bool = True
    num_workers: int = 0
    prepare_workers: int = 0  # processes that read and tokenize during preparation (0: this process)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    micro_batches: int = 1  # gradient accumulation: batch_size is split into this many parts
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    num_samples: int = 2  # generated samples written to TensorBoard at eval time
    nan_policy: str = "stop"  # stop | skip
    max_skipped_steps: int = 10
    peak_flops: float = 0.0  # FLOP/s per device for MFU; 0 = measure a matmul at start
    progress: bool = True
    profile: str = ""  # "start:stop": a jax.profiler trace of those steps in the run's TensorBoard dir
    compilation_cache: bool = True  # persistent XLA compilation cache under $MTPJAX_CACHE_DIR
    init_from: str = ""  # a run dir (or an imported one) whose trunk starts this new run; read until it checkpoints
    freeze: str = "none"  # none | trunk (only the MTP modules train: post-training drafts on a fixed trunk)
    keep_mtp: bool = False  # with init_from: keep the source's MTP modules instead of fresh ones (model.mtp_init)


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500
    keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    num_draft: int = -1  # -1: auto (timed per request among 0..mtp_depth); 0 = plain decoding
    proposer: str = "mtp"  # mtp | ngram
    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    max_len: int = 2048  # KV cache capacity (prompt + generation)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict:
        """Plain nested dict (tuples as lists), the form saved next to checkpoints."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# Keys that say how to compute, not what: a run resumes, and a checkpoint decodes, with another value.
# Keys that change neither the weights nor the prepared tokens and their stream (a backend, worker counts, a cache
# location): a run resumes, and a checkpoint decodes, with other values.
RUNTIME_KEYS = frozenset({"model.attention", "data.cache_dir", "data.num_workers", "data.prepare_workers"})
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "pallas", "splash")


def identity(cfg: Config, section: str) -> dict:
    """cfg's `section` as a plain dict without its runtime-only keys (what must match to be the same run)."""
    return {k: v for k, v in cfg.to_dict()[section].items() if f"{section}.{k}" not in RUNTIME_KEYS}


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# ----------------------------------------------------------------------------- parsing


class _Loader(yaml.SafeLoader):
    """YAML without base-60 integers: `train.profile=10:15` stays the string "10:15", not 615."""


_Loader.yaml_implicit_resolvers = {
    c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:int"]
    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item_tp, *_) = typing.get_args(tp)
        if isinstance(value, str) and not dataclasses.is_dataclass(item_tp):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _fail(key, value, "expected a list")
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _fail(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _fail(key, value, "expected an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML reads 3e-4 (no dot) as a string
            except ValueError:
                pass
        if number is None or not math.isfinite(number):  # .inf would pass every "> 0" check
            raise _fail(key, value, "expected a number (not inf or nan)")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _fail(key, value, "expected a string")
    raise TypeError(f"unsupported config type {tp} for {key}")


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _fail(prefix.rstrip(".") or "<root>", raw, "expected a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _coerce(full, value, tp)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. train.steps=100)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{item}' has an empty key part; use section.key=value")
    try:
        value = _yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return parts, value


def _set(tree: dict, parts: list[str], value: Any, full: str) -> None:
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:  # an empty YAML section (`model:`) reads as None
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{full}': '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config (None: all defaults), apply dotted overrides, validate; raises ConfigError."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist; pass a path such as configs/tiny.yaml")
        try:
            raw = _yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"config file '{p}' is not valid YAML{where}; fix its syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, train:, ...)")
    for item in overrides:
        parts, value = _parse_override(item)
        _set(raw, parts, value, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def from_dict(raw: dict) -> Config:
    """Build and validate a Config from a nested dict (e.g. one saved with a checkpoint)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def replace(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """A copy of cfg with dotted overrides applied and validated."""
    raw = cfg.to_dict()
    for item in overrides:
        parts, value = _parse_override(item)
        _set(raw, parts, value, item)
    return from_dict(raw)


# ----------------------------------------------------------------------------- validation

_LAMBDA_RE = {
    "constant": re.compile(r"^(?P<v>[-+.\deE]+)$"),
    "piecewise": re.compile(r"^(?:[-+.\deE]+@\d+,)+[-+.\deE]+$"),
    "linear": re.compile(r"^(?P<a>[-+.\deE]+)->(?P<b>[-+.\deE]+)@(?P<n>\d+)$"),
    "cosine": re.compile(r"^(?P<a>[-+.\deE]+)->(?P<b>[-+.\deE]+)@(?P<n>\d+)$"),
}
LAMBDA_FORMS = "constant:0.3 | piecewise:0.3@1000,0.1 | linear:0.3->0.1@1000 | cosine:0.3->0.1@1000"


def parse_lambda(spec: str) -> tuple[str, dict]:
    """Parse a lambda schedule string into (kind, params); raises ConfigError naming loss.mtp_lambda."""
    bad = _fail("loss.mtp_lambda", spec, f"expected one of {LAMBDA_FORMS}")
    spec = spec.replace(" ", "")
    kind, _, body = spec.partition(":")
    if not body:
        kind, body = "constant", spec
    pattern = _LAMBDA_RE.get(kind)
    if pattern is None or not pattern.match(body):
        raise bad
    try:
        if kind == "constant":
            return kind, {"value": float(body)}
        if kind == "piecewise":
            *pieces, last = body.split(",")
            values = [float(p.split("@")[0]) for p in pieces] + [float(last)]
            bounds = [int(p.split("@")[1]) for p in pieces]
            if any(b1 >= b2 for b1, b2 in zip(bounds, bounds[1:])):
                raise bad
            return kind, {"values": values, "boundaries": bounds}
        m = pattern.match(body)
        if int(m["n"]) <= 0:
            raise bad
        return kind, {"init": float(m["a"]), "end": float(m["b"]), "steps": int(m["n"])}
    except ValueError:
        raise bad from None


MTP_TARGET_FORMS = "data | self | mix:<w> with 0 <= w <= 1 (w self + (1-w) data)"


def parse_mtp_target(spec: str) -> float:
    """loss.mtp_target -> the weight of the self target (data 0, self 1, mix:w w); ConfigError otherwise."""
    if spec in ("data", "self"):
        return float(spec == "self")
    m = re.fullmatch(r"mix:\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", spec.strip())
    if not m or not 0 <= float(m[1]) <= 1:
        raise _fail("loss.mtp_target", spec, f"expected {MTP_TARGET_FORMS}")
    return float(m[1])


def parse_profile(spec: str) -> tuple[int, int] | None:
    """train.profile "start:stop" -> (start, stop) with 0 <= start < stop; "" -> None; ConfigError otherwise."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if not m or int(m[1]) >= int(m[2]):
        raise _fail("train.profile", spec, "expected start:stop with 0 <= start < stop (steps), e.g. 10:15, or empty")
    return int(m[1]), int(m[2])


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise _fail(key, value, allowed)


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    _check(value in options, key, value, f"expected one of {', '.join(options)}")


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first impossible value."""
    m = cfg.model
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads"):
        _check(getattr(m, k) > 0, f"model.{k}", getattr(m, k), "must be > 0")
    _check(m.d_model % m.n_heads == 0 or m.head_dim > 0, "model.n_heads", m.n_heads,
           f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
           f"must divide model.n_heads={m.n_heads}")
    _check(m.head_dim >= 0 and m.resolved_head_dim % 2 == 0, "model.head_dim", m.resolved_head_dim,
           "must be even (RoPE rotates pairs)")
    _check(m.d_ff >= 0, "model.d_ff", m.d_ff, "must be >= 0 (0 picks ~8/3 d_model)")
    _check(m.mtp_depth >= 0, "model.mtp_depth", m.mtp_depth, "must be >= 0 (0 is a plain LM)")
    _choice("model.mtp_kind", m.mtp_kind, ("sequential", "parallel"))
    _choice("model.remat", m.remat, ("none", "full", "dots"))
    _choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _choice("model.param_dtype", m.param_dtype, ("float32", "bfloat16"))
    _check(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be > 0")
    _choice("model.rope_scaling", m.rope_scaling, ("none", "llama3"))
    _check(m.rope_scaling_factor >= 1, "model.rope_scaling_factor", m.rope_scaling_factor, "must be >= 1")
    _check(m.rope_low_freq_factor > 0, "model.rope_low_freq_factor", m.rope_low_freq_factor, "must be > 0")
    _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor", m.rope_high_freq_factor,
           f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}")
    _check(m.rope_original_max_len > 0, "model.rope_original_max_len", m.rope_original_max_len, "must be > 0")
    _choice("model.mtp_init", m.mtp_init, ("random", "last_block"))
    _check(m.init_std > 0, "model.init_std", m.init_std, "must be > 0")
    _choice("model.attention", m.attention, ATTENTION_BACKENDS)

    parse_lambda(cfg.loss.mtp_lambda)
    parse_mtp_target(cfg.loss.mtp_target)
    _check(cfg.loss.distill_temperature > 0, "loss.distill_temperature", cfg.loss.distill_temperature, "must be > 0")
    _check(cfg.loss.chunk_size >= 0, "loss.chunk_size", cfg.loss.chunk_size, "must be >= 0 (0 = no chunking)")
    _check(cfg.loss.chunk_size == 0 or cfg.data.seq_len % cfg.loss.chunk_size == 0, "loss.chunk_size",
           cfg.loss.chunk_size, f"must divide data.seq_len={cfg.data.seq_len} (or be 0)")

    d = cfg.data
    _choice("data.source", d.source, SOURCES)
    _check(bool(d.text_field), "data.text_field", d.text_field, "must name a column / JSON field")
    _check(d.seq_len >= m.mtp_depth + 2, "data.seq_len", d.seq_len,
           f"must be >= model.mtp_depth + 2 = {m.mtp_depth + 2} so every depth has a target")
    _check(0.0 < d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in (0, 1)")
    _check(d.bpe_vocab_size >= 260, "data.bpe_vocab_size", d.bpe_vocab_size, "must be >= 260")
    _check(d.num_workers >= 0, "data.num_workers", d.num_workers, "must be >= 0")
    _check(d.prepare_workers >= 0, "data.prepare_workers", d.prepare_workers, "must be >= 0 (0: this process)")
    if d.mixture:
        _validate_mixture(d)
    else:
        _check(d.source == "stdlib" or len(d.paths) > 0, "data.paths", list(d.paths),
               f"data.source={d.source} needs at least one path")

    o = cfg.optim
    _check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _choice("optim.schedule", o.schedule, ("cosine", "linear", "constant"))
    _check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _check(0 <= o.b1 < 1, "optim.b1", o.b1, "must be in [0, 1)")
    _check(0 <= o.b2 < 1, "optim.b2", o.b2, "must be in [0, 1)")
    _check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 disables)")

    t = cfg.train
    _check(t.steps > 0, "train.steps", t.steps, "must be > 0")
    _check(t.batch_size > 0, "train.batch_size", t.batch_size, "must be > 0")
    _check(t.micro_batches > 0 and t.batch_size % t.micro_batches == 0, "train.micro_batches",
           t.micro_batches, f"must be > 0 and divide train.batch_size={t.batch_size}")
    for k in ("log_every", "eval_every"):
        _check(getattr(t, k) > 0, f"train.{k}", getattr(t, k), "must be > 0")
    _check(t.eval_batches >= 0, "train.eval_batches", t.eval_batches, "must be >= 0")
    _check(t.num_samples >= 0, "train.num_samples", t.num_samples, "must be >= 0")
    _choice("train.nan_policy", t.nan_policy, ("stop", "skip"))
    _check(t.max_skipped_steps >= 0, "train.max_skipped_steps", t.max_skipped_steps, "must be >= 0")
    _check(t.peak_flops >= 0, "train.peak_flops", t.peak_flops, "must be >= 0 (0 = measure)")
    _check(bool(t.run_dir), "train.run_dir", t.run_dir, "must be a directory path")
    parse_profile(t.profile)
    _choice("train.freeze", t.freeze, ("none", "trunk"))
    _check(t.freeze == "none" or m.mtp_depth > 0, "train.freeze", t.freeze,
           "freezing the trunk leaves nothing to train with model.mtp_depth=0; set model.mtp_depth >= 1")
    _check(t.freeze == "none" or bool(t.init_from), "train.freeze", t.freeze,
           "needs train.init_from=RUN_DIR (the trained trunk to freeze)")
    _check(not t.keep_mtp or bool(t.init_from), "train.keep_mtp", t.keep_mtp,
           "needs train.init_from=RUN_DIR (the run whose MTP modules to keep)")

    for k in ("data", "fsdp", "tensor"):
        _check(getattr(cfg.mesh, k) > 0, f"mesh.{k}", getattr(cfg.mesh, k), "must be > 0")
    _check(m.n_kv_heads % cfg.mesh.tensor == 0 or cfg.mesh.tensor % m.n_kv_heads == 0, "mesh.tensor",
           cfg.mesh.tensor, f"must divide model.n_kv_heads={m.n_kv_heads} (or be a multiple of it)")

    c = cfg.checkpoint
    _check(c.every > 0, "checkpoint.every", c.every, "must be > 0")
    _check(c.keep > 0, "checkpoint.keep", c.keep, "must be > 0")

    dc = cfg.decode
    _check(dc.max_new_tokens > 0, "decode.max_new_tokens", dc.max_new_tokens, "must be > 0")
    _check(dc.num_draft >= -1, "decode.num_draft", dc.num_draft, "must be >= 0 (or -1 = auto: timed per request)")
    _choice("decode.proposer", dc.proposer, ("mtp", "ngram"))
    _check(dc.temperature >= 0, "decode.temperature", dc.temperature, "must be >= 0 (0 = greedy)")
    _check(dc.top_k >= 0, "decode.top_k", dc.top_k, "must be >= 0 (0 disables)")
    _check(0 < dc.top_p <= 1, "decode.top_p", dc.top_p, "must be in (0, 1]")
    _check(dc.max_len > 1, "decode.max_len", dc.max_len, "must be > 1")


def _validate_mixture(d: DataConfig) -> None:
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
        _choice(f"{key}.source", m.source, SOURCES)
        _check(m.source == "stdlib" or len(m.paths) > 0, f"{key}.paths", list(m.paths),
               f"source {m.source} needs at least one path")
        _check(m.weight > 0, f"{key}.weight", m.weight, "must be > 0")
        _check(bool(m.text_field), f"{key}.text_field", m.text_field, "must name a column / JSON field")


def field_doc() -> list[tuple[str, Any]]:
    """(dotted key, default) for every key, in schema order (for docs and tests)."""
    out, hints = [], typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(hints[sec.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{sec.name}.{f.name}", default))
    return out

