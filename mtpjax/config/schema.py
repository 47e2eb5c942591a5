"""The config schema: frozen dataclasses whose fields carry their choices (Literal), bounds and doc (metadata)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from mtpjax.config.specs import DecodeDraft, DepthLambdas, LambdaSchedule, Spec, TargetMix


@dataclass(frozen=True)
class Bounds:
    """The interval a number must lie in; None leaves that side open-ended."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        above = self.lo is None or (x > self.lo if self.lo_open else x >= self.lo)
        below = self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)
        return above and below

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(['[not self.lo_open]}{_num(self.lo)}, {_num(self.hi)}{')]'[not self.hi_open]}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)


def key(default: Any, doc: str, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
        le: float | None = None, choices: dict[str, str] | None = None, runtime: bool = False) -> Any:
    """A config field: its default, its one-line doc, the bounds a number keeps, what each choice means, and
    whether it is runtime-only (how to compute, not what: a run resumes and a checkpoint decodes with another value)."""
    meta: dict[str, Any] = {"doc": doc, "runtime": runtime}
    if (gt, ge, lt, le) != (None,) * 4:
        meta["bounds"] = Bounds(gt if gt is not None else ge, lt if lt is not None else le, gt is not None,
                                lt is not None)
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


RopeScaling = Literal["none", "llama3", "yarn"]
AttentionKind = Literal["gqa", "mla"]
MtpKind = Literal["sequential", "parallel"]
MtpInit = Literal["random", "last_block"]
MtpHidden = Literal["raw", "normed"]
Remat = Literal["none", "full", "dots"]
Dtype = Literal["float32", "bfloat16", "float16"]
ParamDtype = Literal["float32", "bfloat16"]
Attention = Literal["auto", "xla", "cudnn", "pallas", "splash"]
Source = Literal["stdlib", "text", "array", "parquet", "arrow", "induction", "algorithmic"]
LrSchedule = Literal["cosine", "linear", "constant"]
NanPolicy = Literal["stop", "skip"]
Freeze = Literal["none", "trunk"]
OwnText = Literal["off", "greedy", "sample"]
Proposer = Literal["mtp", "mtp1", "ngram", "model"]
MlpKind = Literal["dense", "moe"]
UnrollModule = Literal["first", "last"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = key(256, "vocabulary size (≥ the tokenizer's)", gt=0)
    d_model: int = key(256, "model width", gt=0)
    n_layers: int = key(4, "trunk blocks", gt=0)
    n_heads: int = key(4, "attention heads (must divide `d_model` unless `head_dim` is set)", gt=0)
    n_kv_heads: int = key(2, "key/value heads (GQA; must divide `n_heads`)", gt=0)
    head_dim: int = key(0, "per-head width (even: RoPE rotates pairs); 0 = `d_model / n_heads`", ge=0)
    d_ff: int = key(0, "SwiGLU width; 0 = 8/3 · `d_model` rounded up to a multiple of 64", ge=0)
    rope_theta: float = key(10000.0, "RoPE base", gt=0)
    rope_scaling: RopeScaling = key("none", "RoPE frequency scaling", choices={
        "none": "plain RoPE", "llama3": "Llama 3.1's long-context rule, with the four `rope_*` keys below",
        "yarn": "YaRN as DeepSeek-V3 defines it (`attention_kind: mla`): `rope_scaling_factor`, "
                "`rope_original_max_len`, `rope_beta_*`, `rope_mscale*`"})
    rope_scaling_factor: float = key(8.0, "llama3: how much long wavelengths are slowed", ge=1)
    rope_low_freq_factor: float = key(
        1.0, "llama3: wavelengths above `rope_original_max_len / low` are scaled by the factor", gt=0)
    rope_high_freq_factor: float = key(
        4.0, "llama3: wavelengths below `rope_original_max_len / high` are kept; between, interpolated "
        "(must be > `rope_low_freq_factor`)")
    rope_original_max_len: int = key(8192, "llama3, yarn: the context length the model was pretrained at", gt=0)
    rope_beta_fast: float = key(32.0, "yarn: rotations per original context above which a frequency is kept", gt=0)
    rope_beta_slow: float = key(1.0, "yarn: rotations below which a frequency is divided by the factor; between, "
                                "ramped (must be < `rope_beta_fast`)", gt=0)
    rope_mscale: float = key(1.0, "yarn: the cos/sin scale is mscale(factor, this) / mscale(factor, "
                             "`rope_mscale_all_dim`), mscale(s, m) = 0.1·m·ln s + 1", ge=0)
    rope_mscale_all_dim: float = key(1.0, "yarn: the softmax scale is multiplied by mscale(factor, this)² (0: not, "
                                     "and the cos/sin scale is mscale(factor, 1))", ge=0)
    attention_kind: AttentionKind = key("gqa", "what attention computes (trunk and MTP modules)", choices={
        "gqa": "grouped-query attention (`n_kv_heads`, `head_dim`)",
        "mla": "DeepSeek-V3's multi-head latent attention (`q_lora_rank`, `kv_lora_rank`, `qk_*_head_dim`, "
               "`v_head_dim`); decoding caches the latent and the RoPE key"})
    q_lora_rank: int = key(0, "mla: query latent rank (≤ `d_model`); 0 = no query compression", ge=0)
    kv_lora_rank: int = key(64, "mla: key/value latent rank, the cached numbers per token besides the RoPE key "
                            "(≤ `d_model`)", gt=0)
    qk_nope_head_dim: int = key(32, "mla: per-head query/key width without position", gt=0)
    qk_rope_head_dim: int = key(16, "mla: width of the RoPE part (one key shared by every head; even)", gt=0)
    v_head_dim: int = key(32, "mla: per-head value width", gt=0)
    norm_eps: float = key(1e-6, "RMSNorm epsilon")
    qkv_bias: bool = key(False, "biases on the q/k/v projections (Qwen2), zero-initialised")
    tie_embeddings: bool = key(True, "output head = embedding transposed")
    mtp_depth: int = key(1, "D, the number of MTP modules (0 = plain LM)", ge=0)
    mtp_kind: MtpKind = key("sequential", "how the MTP modules are wired", choices={
        "sequential": "the DeepSeek-V3 chain", "parallel": "independent heads on the trunk, as in Gloeckle et al."})
    mtp_hidden: MtpHidden = key("raw", "the trunk state MTP module 1 reads (every module, when parallel)", choices={
        "raw": "the residual stream before the trunk's final norm",
        "normed": "after the trunk's final norm, as DeepSeek-V3's reference code, its engines and Megatron feed it "
                  "(needed by `convert export --format deepseek_v3`)"})
    mtp_init: MtpInit = key("random", "MTP modules' initialization (on import, from the imported trunk)", choices={
        "random": "fresh weights",
        "last_block": "each module's block starts as a copy of the last trunk block; its norms and `eh_proj` fresh"})
    scan_layers: bool = key(False, "`lax.scan` over a stacked trunk (faster compiles for deep models)")
    remat: Remat = key("none", "activation rematerialization per block", choices={
        "none": "keep activations", "full": "recompute the block", "dots": "save only matmul outputs"})
    dtype: Dtype = key("float32", "activation / compute dtype")
    param_dtype: ParamDtype = key("float32", "parameter dtype")
    init_std: float = key(0.02, "init standard deviation (output projections scaled by 1/√(2L))", gt=0)
    mlp_kind: MlpKind = key("dense", "the blocks' feed-forward (MTP modules' blocks follow the trunk's)", choices={
        "dense": "one SwiGLU of width `d_ff`",
        "moe": "DeepSeek-V3's mixture of experts: sigmoid-routed SwiGLU experts of width `moe_d_ff`, group-limited "
               "top-k, shared experts, the first `first_k_dense_replace` trunk blocks dense"})
    n_routed_experts: int = key(8, "moe: routed experts (E)", gt=0)
    num_experts_per_tok: int = key(2, "moe: experts chosen per token (top-k; ≤ `n_routed_experts`)", gt=0)
    n_shared_experts: int = key(1, "moe: shared experts every token passes through (one SwiGLU of "
                                "`n_shared_experts` · `moe_d_ff`)", ge=0)
    moe_d_ff: int = key(256, "moe: each expert's SwiGLU width", gt=0)
    n_group: int = key(1, "moe: expert groups (must divide `n_routed_experts`, ≥ 2 experts each when > 1); a group's "
                       "score is the sum of its top-2 biased scores", gt=0)
    topk_group: int = key(1, "moe: groups a token's experts are chosen from (≤ `n_group`)", gt=0)
    routed_scaling_factor: float = key(1.0, "moe: the chosen experts' normalized weights are multiplied by this", gt=0)
    first_k_dense_replace: int = key(0, "moe: the first k trunk blocks keep the dense MLP (< `n_layers`)", ge=0)
    attention: Attention = key(
        "auto", "how attention is computed, not what", runtime=True, choices={
            "auto": "splash on TPU, Pallas on GPU with bf16/fp16, else XLA (for the mesh's devices)",
            "xla": "the reference",
            "cudnn": "cuDNN's fused kernel (GPU)", "pallas": "a Pallas kernel (GPU)",
            "splash": "splash attention (TPU)"})

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

    @property
    def yarn_rope(self) -> tuple | None:
        """(factor, original_max_len, beta_fast, beta_slow, mscale, mscale_all_dim) when rope_scaling is yarn."""
        if self.rope_scaling != "yarn":
            return None
        return (self.rope_scaling_factor, float(self.rope_original_max_len), self.rope_beta_fast,
                self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim)


@dataclass(frozen=True)
class LossConfig:
    mtp_lambda: LambdaSchedule = key(
        LambdaSchedule.parse("constant:0.3"), "λ(step), the MTP losses' weight (a bare number is constant): "
        "piecewise holds each value until the next step mark, linear and cosine ramp from the first value to the "
        "second over that many steps and then hold it")
    chunk_size: int = key(0, "sequence positions per cross-entropy chunk (must divide `data.seq_len`; 0 = all at "
                          "once)", ge=0)
    mtp_target: TargetMix = key(
        TargetMix.parse("data"), "what depth k learns: the token x[i+k+1] (data), the main head's distribution "
        "at i+k (self: soft cross-entropy; tv: 1 − Σ min(p, q), the chance a sampled draft is rejected; no gradient "
        "into the target either way), or a mix of them")
    distill_temperature: float = key(
        1.0, "temperature of both distributions in the `self` target's soft cross-entropy (scaled by its square)",
        gt=0)
    mtp_unroll: int = key(0, "U: the module `mtp_unroll_module` names is also applied U more times, each on its own "
                          "previous output and the next true token, each application scored as one more depth", ge=0)
    mtp_unroll_module: UnrollModule = key("first", "which module `mtp_unroll` reuses", choices={
        "first": "module 1 (the chain `decode.proposer=mtp1` and the engines run)",
        "last": "module D (the chain `decode.proposer=mtp` runs beyond D)"})
    mtp_lambda_depths: DepthLambdas = key(
        DepthLambdas.parse(""), "λ per scored application (depths 1..D, then the unrolled ones): empty = "
        "`mtp_lambda` for all; `forward:<n>[~<r>]` = application a gets `mtp_lambda` from step a·n on (ramped in "
        "over r steps); `reverse:<n>[~<r>]` = application a keeps it until step (A+1−a)·n (ramped out over the r "
        "steps before), A applications in all; or one `mtp_lambda` form per application separated by `;`")
    moe_seq_aux_loss: float = key(0.0, "`model.mlp_kind=moe`: weight of DeepSeek-V3's sequence-wise balance loss "
                                  "(summed over MoE layers, averaged over rows); 0 = bias balancing alone", ge=0)

    def __post_init__(self):
        # Python callers may pass the YAML strings; code past this point sees only the parsed values.
        for name, tp in _spec_fields(type(self)).items():
            if isinstance(value := getattr(self, name), str):
                object.__setattr__(self, name, tp.parse(value, f"loss.{name}"))


@functools.cache
def _spec_fields(cls: type) -> dict[str, type[Spec]]:
    """Section `cls`'s fields whose values are parsed from one string (Spec types)."""
    return {n: tp for n, tp in typing.get_type_hints(cls).items() if isinstance(tp, type) and issubclass(tp, Spec)}


@dataclass(frozen=True)
class MixtureSource:
    """One source of a weighted data mixture (data.mixture); the rest of DataConfig is shared."""

    name: str = key("", "the source's TensorBoard tag part (`eval/<name>/loss/main`): letters, digits, `_` `.` `-`, "
                    "unique")
    source: Source = key("text", "the source's kind (as `data.source`)")
    paths: tuple[str, ...] = key((), "its files or directories")
    weight: float = key(1.0, "share of training windows (weights are normalized)", gt=0)
    text_field: str = key("text", "the text column (Parquet/Arrow) or JSON-lines field")


@dataclass(frozen=True)
class DataConfig:
    source: Source = key("stdlib", "where documents come from", choices={
        "stdlib": "the embedded corpus", "text": "`.txt`/`.md` files, `.jsonl` lines",
        "array": "`.npy` / `.bin` token ids", "parquet": "`.parquet` files",
        "arrow": "Arrow IPC / Feather v2: `.arrow`, `.feather`, `.ipc`",
        "induction": "generated stories whose invented names repeat (scored: the repeats' letters after the first)",
        "algorithmic": "generated sums `a+b=c` (scored: exact match of `c` by greedy decoding)"})
    paths: tuple[str, ...] = key(
        (), "files or directories for every source but `stdlib` (directories are walked for the source's suffixes)")
    text_field: str = key("text", "the text column of Parquet/Arrow files and the field of JSON lines; null or "
                          "empty values are no document")
    mixture: tuple[MixtureSource, ...] = key(
        (), "weighted sources, each prepared and cached on its own; replaces `source`/`paths`/`text_field`")
    synthetic_instances: int = key(20000, "`induction`/`algorithmic`: instances generated before the split "
                                   "(repeated instances stay on one side of it)", gt=0)
    synthetic_seed: int = key(0, "`induction`/`algorithmic`: seed of the generated instances", ge=0)
    synthetic_difficulty: int = key(2, "`induction`: names per story (1-8); `algorithmic`: digits per operand", ge=1)
    task_instances: int = key(64, "`induction`/`algorithmic`: held-out instances the task metric scores at each "
                              "eval (`eval/task/...`) and in `decode.py --eval`", ge=0)
    tokenizer: str = key("byte", "`byte` (256 ids, byte 0 = end of document), `bpe` (byte-level BPE trained "
                         "offline on the train split; not with a mixture), or a path to a `tokenizer.json` or "
                         "sentencepiece `.model`")
    bpe_vocab_size: int = key(1024, "vocabulary of the trained BPE", ge=260)
    seq_len: int = key(256, "tokens per training window (T; ≥ `model.mtp_depth` + 2)")
    cache_dir: str = key("~/.cache/mtpjax", "where prepared (tokenized) corpora are cached; on several hosts, "
                         "storage they all see", runtime=True)
    val_fraction: float = key(0.05, "fraction of documents held out for validation (split by a hash of their "
                              "path, line or row)", gt=0, lt=1)
    shuffle: bool = key(True, "shuffle training windows (seeded by `train.seed`)")
    num_workers: int = key(0, "prefetch threads of the input pipeline", ge=0, runtime=True)
    prepare_workers: int = key(0, "processes that read and tokenize during preparation (0: the training "
                               "process); same arrays either way", ge=0, runtime=True)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = key(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = key(0.1, "final learning rate as a fraction of the peak", ge=0, le=1)
    warmup_steps: int = key(50, "linear warmup steps", ge=0)
    schedule: LrSchedule = key("cosine", "decay after warmup")
    weight_decay: float = key(0.1, "AdamW decoupled weight decay (not applied to 1-D parameters)", ge=0)
    b1: float = key(0.9, "Adam β1", ge=0, lt=1)
    b2: float = key(0.95, "Adam β2", ge=0, lt=1)
    eps: float = key(1e-8, "Adam ε")
    grad_clip: float = key(1.0, "global-norm clipping (0 disables)", ge=0)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = key(1000, "total optimizer steps", gt=0)
    batch_size: int = key(16, "global batch (sequences per step)", gt=0)
    micro_batches: int = key(1, "gradient accumulation: the batch is split into this many parts (must divide "
                             "`batch_size`; exactly equivalent); the eval step computes in the same parts", gt=0)
    seed: int = key(0, "parameter init and data order")
    run_dir: str = key("runs/default", "checkpoints, TensorBoard logs, config and tokenizer of the run")
    log_every: int = key(10, "steps between logged training scalars", gt=0)
    eval_every: int = key(200, "steps between validation evals (and samples)", gt=0)
    eval_batches: int = key(8, "validation batches per eval", ge=0)
    num_samples: int = key(2, "generated samples written to TensorBoard per eval", ge=0)
    eval_tasks: tuple[str, ...] = key((), "lm-eval tasks scored every `eval_tasks_every` steps, logged to "
                                      "TensorBoard as `tasks/<task>/<metric>` (the shipped ones: `mtpjax`; needs the "
                                      "`eval` extra); empty: none")
    eval_tasks_every: int = key(1000, "steps between task evals (`eval_tasks`), and the last step", gt=0)
    eval_tasks_limit: float = key(0.0, "documents per task in a task eval (0: all)", ge=0)
    nan_policy: NanPolicy = key("stop", "on a non-finite loss or gradient", choices={
        "stop": "stop the run", "skip": "skip the update"})
    max_skipped_steps: int = key(10, "`skip` policy: stop after this many skipped updates", ge=0)
    peak_flops: float = key(0.0, "per-device peak FLOP/s for MFU; 0 = the chip's published dense bf16 peak on a GPU "
                                 "or TPU (the table `compile` reports use), and only on CPU the best float32 matmul "
                                 "rate of XLA, numpy or torch, measured at start (the log says which)", ge=0)
    progress: bool = key(True, "tqdm progress bar")
    profile: str = key("", "`start:stop` (e.g. `10:13`): a `jax.profiler` trace of the steps after `start` up to "
                       "`stop` completed steps, in the run's TensorBoard directory (profile tab); empty: none")
    compilation_cache: bool = key(True, "persistent XLA compilation cache in `$MTPJAX_CACHE_DIR/xla` (default "
                                  "`~/.cache/mtpjax/xla`): a restarted run compiles nothing it compiled before")
    init_from: str = key("", "a run directory (or `convert import --out`) whose trunk, embedding and head start "
                         "this new run (step 0); read only while `train.run_dir` has no checkpoint; the `model.*` "
                         "keys of the trunk must match it")
    freeze: Freeze = key("none", "what does not train", choices={
        "none": "everything trains",
        "trunk": "only the MTP modules train and have optimizer state (needs `train.init_from` and "
                 "`model.mtp_depth` ≥ 1)"})
    bias_update_speed: float = key(0.001, "`model.mlp_kind=moe`: each step moves every expert's routing bias by "
                                   "± this toward the mean load of the global batch (0: no balancing)", ge=0)
    keep_mtp: bool = key(False, "with `train.init_from`: keep its MTP modules (same kind, at least as many) "
                         "instead of fresh ones (`model.mtp_init`)")
    own_text: OwnText = key("off", "post-training (`train.init_from`) on the trunk's own text: the training "
                            "sequences are the init_from trunk's continuations of corpus prompts, generated once by "
                            "the decoder in batches and cached in the run directory (`own_text/`)", choices={
                                "off": "train on the corpus", "greedy": "greedy continuations",
                                "sample": "continuations sampled at temperature 1 (seeded by `train.seed`)"})
    own_text_sequences: int = key(256, "`own_text`: generated sequences of `data.seq_len` tokens (at least "
                                  "`train.batch_size`); training cycles through them", gt=0)
    own_text_prompt_len: int = key(32, "`own_text`: corpus tokens each sequence starts from (the first tokens of a "
                                   "training window; less than `data.seq_len`)", gt=0)


@dataclass(frozen=True)
class MeshConfig:
    data: int = key(1, "data-parallel mesh axis", gt=0)
    fsdp: int = key(1, "fully-sharded data-parallel axis (parameters sharded, batch split)", gt=0)
    tensor: int = key(1, "tensor-parallel axis (heads, MLP and vocabulary split; divides `model.n_kv_heads` or "
                      "is a multiple of it)", gt=0)
    # expert is last among the fields (positional MeshConfig(data, fsdp, tensor) keeps its meaning); the mesh's
    # axis order is parallel.sharding.AXES
    expert: int = key(1, "expert-parallel axis: routed experts' weights split over it, the batch too (must divide "
                      "`model.n_routed_experts`)", gt=0)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = key(500, "steps between checkpoints (the last step is always saved)", gt=0)
    keep: int = key(3, "checkpoints kept", gt=0)
    async_save: bool = key(True, "save in the background while training continues")
    verify: bool = key(True, "check every restored array, the data position and the config against the xxh3-128 "
                             "digests saved with them (a mismatch falls back to the previous checkpoint); false "
                             "skips the check, for speed")


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = key(128, "default generation length of `decode.py`", gt=0)
    draft: DecodeDraft = key(DecodeDraft(), "what a round drafts (`decode.py --num-draft/--tree`): `auto` (timed per "
                             "request among plain, chains and small trees), `0` (plain), `3` (a chain of 3), children "
                             "per node at each depth (`2x2x1`) or each node's parent (`-1,-1,0,0`); `+ngramL` adds "
                             "n-gram lookup's L drafts as one more branch (`2x2+ngram3`)")
    proposer: Proposer = key("mtp", "what drafts (`decode.py --proposer`)", choices={
        "mtp": "the run's MTP modules (module k drafts token k)",
        "mtp1": "MTP module 1 drafts every token, fed its own output",
        "ngram": "prompt lookup", "model": "the `decode.py --draft-run-dir` model"})
    temperature: float = key(0.0, "sampling temperature; 0 = greedy", ge=0)
    top_k: int = key(0, "top-k filter (0 = off)", ge=0)
    top_p: float = key(1.0, "nucleus filter (1 = off)", gt=0, le=1)
    max_len: int = key(2048, "KV-cache capacity: prompt + generated tokens", gt=1)

    def __post_init__(self):
        if isinstance(self.draft, str):  # Python callers may pass the YAML string
            object.__setattr__(self, "draft", DecodeDraft.parse(self.draft))


# Keys that were replaced: a config naming one is refused with a line naming its successor.
RETIRED = {"decode.num_draft": "decode.draft", "decode.tree": "decode.draft"}


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
        """Plain nested dict (tuples as lists, parsed values as their strings), the form saved next to checkpoints."""
        return plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def plain(x):
    """x as YAML/JSON data: sections as dicts, tuples as lists, parsed values as the strings they were read from."""
    if isinstance(x, Spec):
        return str(x)
    if dataclasses.is_dataclass(x):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def walk(cls: type | None = None, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every key of section `cls` (Config: every section's), in schema order."""
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if cls is Config:
            out += walk(hints[f.name], f"{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f, hints[f.name]))
    return out


def field_doc() -> list[tuple[str, Any]]:
    """(dotted key, default) for every key, in schema order (for docs and tests)."""
    return [(k, f.default) for k, f, _ in walk()]


# Keys that change neither the weights nor the prepared tokens and their stream (a backend, worker counts, a cache
# location): a run resumes, and a checkpoint decodes, with other values.
RUNTIME_KEYS = frozenset(k for k, f, _ in walk() if f.metadata["runtime"])


def identity(cfg: Config, section: str) -> dict:
    """cfg's `section` as a plain dict without its runtime-only keys (what must match to be the same run)."""
    return {k: v for k, v in cfg.to_dict()[section].items() if f"{section}.{k}" not in RUNTIME_KEYS}


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The values field `name` of section `cls` accepts (its Literal's arguments); () if it is not a choice."""
    tp = typing.get_type_hints(cls)[name]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
