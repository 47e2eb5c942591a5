"""The config schema: frozen pydantic models whose fields carry their type, bounds, doc and choices (`Field`)."""

import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mtpjax import drafts
from mtpjax.config.errors import ConfigError, fail, one_line
from mtpjax.config.types import Bool, Float, Int, Ints, Str, Strs, choice, listed, one_of, parsed
from mtpjax.objective import DepthLambdas, LambdaSchedule, TargetMix
from mtpjax.config.validate import validate

RUNTIME = {"runtime": True}  # how to compute, not what: a run resumes, and a checkpoint decodes, with another value


class _Validated(type(BaseModel)):
    """Calling a section validates as loading does: values by keyword or in field order, errors as one line."""

    def __call__(cls, *args: Any, **kwargs: Any):
        kwargs.update(zip(cls.model_fields, args))
        try:
            return super().__call__(**kwargs)
        except ValidationError as e:
            raise one_line(e, cls, _PREFIX.get(cls, ""), kwargs) from None


class Section(BaseModel, metaclass=_Validated):
    """A config section: frozen, unknown keys refused, a ConfigError naming the key for a bad value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, raw: Any) -> Any:
        if raw is None:  # an empty YAML section (`train:`)
            return {}
        if isinstance(raw, dict):
            return {str(k): v for k, v in raw.items()}  # a YAML key such as `1:` is an unknown key, named
        if isinstance(raw, cls):
            return raw
        raise fail(None, raw, "expected a mapping of keys to values")



class ModelConfig(Section):
    vocab_size: Int = Field(256, description="vocabulary size (≥ the tokenizer's)", gt=0)
    d_model: Int = Field(256, description="model width", gt=0)
    n_layers: Int = Field(4, description="trunk blocks", gt=0)
    n_heads: Int = Field(4, description="attention heads (must divide `d_model` unless `head_dim` is set)", gt=0)
    n_kv_heads: Int = Field(2, description="key/value heads (GQA; must divide `n_heads`)", gt=0)
    head_dim: Int = Field(0, description="per-head width (even: RoPE rotates pairs); 0 = `d_model / n_heads`", ge=0)
    d_ff: Int = Field(0, description="SwiGLU width; 0 = 8/3 · `d_model` rounded up to a multiple of 64", ge=0)
    rope_theta: Float = Field(10000.0, description="RoPE base", gt=0)
    rope_scaling: one_of("RoPE frequency scaling", none="plain RoPE", llama3="Llama 3.1's long-context rule, with the "
        "four `rope_*` keys below", yarn="YaRN as DeepSeek-V3 defines it (`attention_kind: mla`): "
        "`rope_scaling_factor`, `rope_original_max_len`, `rope_beta_*`, `rope_mscale*`")
    rope_scaling_factor: Float = Field(8.0, description="llama3: how much long wavelengths are slowed", ge=1)
    rope_low_freq_factor: Float = Field(1.0, description="llama3: wavelengths above `rope_original_max_len / low` are "
        "scaled by the factor", gt=0)
    rope_high_freq_factor: Float = Field(4.0, description="llama3: wavelengths below `rope_original_max_len / high` "
        "are kept; between, interpolated (must be > `rope_low_freq_factor`)")
    rope_original_max_len: Int = Field(8192, description="llama3, yarn: the context length the model was pretrained at",
        gt=0)
    rope_beta_fast: Float = Field(32.0, description="yarn: rotations per original context above which a frequency is "
        "kept", gt=0)
    rope_beta_slow: Float = Field(1.0, description="yarn: rotations below which a frequency is divided by the factor; "
        "between, ramped (must be < `rope_beta_fast`)", gt=0)
    rope_mscale: Float = Field(1.0, description="yarn: the cos/sin scale is mscale(factor, this) / mscale(factor, "
        "`rope_mscale_all_dim`), mscale(s, m) = 0.1·m·ln s + 1 (either 0: mscale(factor, 1), as DeepSeek-V3's)",
        ge=0)
    rope_mscale_all_dim: Float = Field(1.0, description="yarn: the softmax scale is multiplied by mscale(factor, "
        "this)² (0: not, and the cos/sin scale is mscale(factor, 1))", ge=0)
    attention_kind: one_of("what attention computes (trunk and MTP modules)", gqa="grouped-query attention "
        "(`n_kv_heads`, `head_dim`)", mla="DeepSeek-V3's multi-head latent attention (`q_lora_rank`, `kv_lora_rank`, "
        "`qk_*_head_dim`, `v_head_dim`); decoding caches the latent and the RoPE key")
    q_lora_rank: Int = Field(0, description="mla: query latent rank (≤ `d_model`); 0 = no query compression", ge=0)
    kv_lora_rank: Int = Field(64, description="mla: key/value latent rank, the cached numbers per token besides the "
        "RoPE key (≤ `d_model`)", gt=0)
    qk_nope_head_dim: Int = Field(32, description="mla: per-head query/key width without position", gt=0)
    qk_rope_head_dim: Int = Field(16, description="mla: width of the RoPE part (one key shared by every head; even)",
        gt=0)
    v_head_dim: Int = Field(32, description="mla: per-head value width", gt=0)
    norm_eps: Float = Field(1e-6, description="RMSNorm epsilon", ge=0)
    qkv_bias: Bool = Field(False, description="biases on the q/k/v projections (Qwen2; `gqa`), zero-initialised")
    tie_embeddings: Bool = Field(True, description="output head = embedding transposed")
    mtp_depth: Int = Field(1, description="D, the number of MTP modules (0 = plain LM)", ge=0)
    mtp_kind: one_of("how the MTP modules are wired", sequential="the DeepSeek-V3 chain", parallel="independent heads "
        "on the trunk, as in Gloeckle et al.")
    mtp_hidden: one_of("the trunk state MTP module 1 reads (every module, when parallel)", raw="the residual stream "
        "before the trunk's final norm", normed="after the trunk's final norm, as DeepSeek-V3's reference code, its "
        "engines and Megatron feed it (needed by `convert export --format deepseek_v3`)")
    mtp_init: one_of("fresh MTP modules' initialization, from the trunk the run starts with (random, "
        "`train.init_from`'s or imported)", random="fresh weights", last_block="each module's block starts as a copy "
        "of the last trunk block; its norms and `eh_proj` fresh")
    scan_layers: Bool = Field(False, description="`lax.scan` over a stacked trunk (faster compiles for deep models)")
    remat: one_of("activation rematerialization per block", runtime=True, none="keep activations",
        full="recompute the block", dots="save only matmul outputs", save_kernels="recompute the block but its "
        "kernels' work: attention's and the grouped matmuls' outputs and the routed experts' rows kept (no kernel or "
        "dispatch rerun)")
    dtype: choice("float32", "bfloat16", "float16") = Field("float32", description="activation / compute dtype")
    param_dtype: choice("float32", "bfloat16") = Field("float32", description="parameter dtype")
    init_std: Float = Field(0.02, description="init standard deviation (output projections scaled by 1/√(2L))", gt=0)
    mlp_kind: one_of("the blocks' feed-forward (MTP modules' blocks follow the trunk's)", dense="one SwiGLU of width "
        "`d_ff`", moe="DeepSeek-V3's mixture of experts: sigmoid-routed SwiGLU experts of width `moe_d_ff`, "
        "group-limited top-k, shared experts, the first `first_k_dense_replace` trunk blocks dense")
    n_routed_experts: Int = Field(8, description="moe: routed experts (E)", gt=0)
    num_experts_per_tok: Int = Field(2, description="moe: experts chosen per token (top-k; ≤ `n_routed_experts`)", gt=0)
    n_shared_experts: Int = Field(1, description="moe: shared experts every token passes through (one SwiGLU of "
        "`n_shared_experts` · `moe_d_ff`)", ge=0)
    moe_d_ff: Int = Field(256, description="moe: each expert's SwiGLU width", gt=0)
    n_group: Int = Field(1, description="moe: expert groups (must divide `n_routed_experts`, ≥ 2 experts each when > "
        "1); a group's score is the sum of its top-2 biased scores", gt=0)
    topk_group: Int = Field(1, description="moe: groups a token's experts are chosen from (≤ `n_group`)", gt=0)
    routed_scaling_factor: Float = Field(1.0, description="moe: the chosen experts' normalized weights are multiplied "
        "by this", gt=0)
    first_k_dense_replace: Int = Field(0, description="moe: the first k trunk blocks keep the dense MLP (< `n_layers`; "
        "0 with `scan_layers`, whose stacked trunk is one block kind)", ge=0)
    moe_buffer_factor: Float = Field(0.0, description="moe with `mesh.expert` > 1: each expert shard receives this "
        "many times its balanced share of token-slots (every device's N·k), the all-to-all moving ceil(factor · N·k / "
        "expert) rows per pair of shards; slots past that are dropped, counted (`moe/<layer>/dropped_fraction`), "
        "lowest routing weight first; 0 = the worst case, dropless (decoding is always dropless)", ge=0)
    attention: one_of("how attention is computed, not what", runtime=True, auto="splash on TPU, Pallas on GPU with "
        "bf16/fp16, else XLA (for the mesh's devices)", xla="the reference", cudnn="cuDNN's fused kernel (GPU)",
        pallas="a Pallas kernel (GPU)", splash="splash attention (TPU)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        return self.d_ff or -(-(8 * self.d_model // 3) // 64) * 64


class LossConfig(Section):
    mtp_lambda: parsed(LambdaSchedule) = Field(LambdaSchedule.parse("constant:0.3"), description="λ(step), the MTP "
        "losses' weight, ≥ 0 (a bare number is constant): piecewise holds each value until the next step mark, linear "
        "and cosine ramp from the first value to the second over that many steps and then hold it")
    chunk_size: Int = Field(0, description="sequence positions per cross-entropy chunk (must divide `data.seq_len`; 0 "
        "= all at once)", ge=0)
    mtp_target: parsed(TargetMix) = Field(TargetMix.parse("data"), description="what depth k learns: the token "
        "x[i+k+1] (data), the main head's distribution at i+k (self: soft cross-entropy; tv: 1 − Σ min(p, q), the "
        "chance a sampled draft is rejected; no gradient into the target either way), or a mix of them")
    distill_temperature: Float = Field(1.0, description="temperature of both distributions in the `self` target's soft "
        "cross-entropy (scaled by its square)", gt=0)
    mtp_unroll: Int = Field(0, description="U: the module `mtp_unroll_module` names is also applied U more times, each "
        "on its own previous output and (a sequential module) the next true token, each scored as one more depth", ge=0)
    mtp_unroll_module: one_of("which module `mtp_unroll` reuses", first="module 1 (the chain `decode.proposer=mtp1` "
        "and the engines run)", last="module D (the chain `decode.proposer=mtp` runs beyond D)")
    mtp_lambda_depths: parsed(DepthLambdas) = Field(DepthLambdas.parse(""), description="λ per scored application "
        "(depths 1..D, then the unrolled ones): empty = `mtp_lambda` for all; `forward:<n>[~<r>]` = application a gets "
        "`mtp_lambda` from step a·n on (ramped in over r steps); `reverse:<n>[~<r>]` = application a keeps it until "
        "step (A+1−a)·n (ramped out over the r steps before), A applications in all; or one `mtp_lambda` form per "
        "application separated by `;`")
    moe_seq_aux_loss: Float = Field(0.0, description="`model.mlp_kind=moe`: weight of DeepSeek-V3's sequence-wise "
        "balance loss (summed over MoE layers, averaged over rows); 0 = bias balancing alone", ge=0)
    head_kernel: one_of("how the head's logits meet the cross-entropy", runtime=True, auto="on TPU one Pallas kernel "
        "(`nn/head_ce.py`): logits made a tile at a time on chip, never written to HBM (the `self`/`tv` targets and "
        "the eval's acceptance keep XLA's); elsewhere XLA", xla="XLA: the logits written to HBM, then read")


SOURCES = dict(  # data.source's choices, and what each reads
    stdlib="the embedded corpus", text="`.txt`/`.md` files, `.jsonl` lines", array="`.npy` / `.bin` token ids",
    parquet="`.parquet` files", arrow="Arrow IPC / Feather v2: `.arrow`, `.feather`, `.ipc`", induction="generated "
    "stories whose invented names repeat (scored: the repeats' letters after the first)", algorithmic="generated sums "
    "`a+b=c` (scored: exact match of `c` by greedy decoding)")


class MixtureSource(Section):
    """One source of a weighted data mixture (data.mixture); the rest of DataConfig is shared."""

    name: Str = Field("", description="the source's TensorBoard tag part (`eval/<name>/loss/main`): letters, digits, "
        "`_` `.` `-`, unique")
    source: choice(*SOURCES) = Field("text", description="the source's kind (as `data.source`)")
    paths: Strs = Field((), description="its files or directories")
    weight: Float = Field(1.0, description="share of training windows (weights are normalized)", gt=0)
    text_field: Str = Field("text", description="the text column (Parquet/Arrow) or JSON-lines field")


class DataConfig(Section):
    source: one_of("where documents come from", **SOURCES)
    paths: Strs = Field((), description="files or directories of the `text`, `array`, `parquet` and `arrow` sources "
        "(directories are walked for the source's suffixes); `stdlib`, `induction` and `algorithmic` read none and "
        "ignore them: set `source` too")
    text_field: Str = Field("text", description="the text column of Parquet/Arrow files and the field of JSON lines; "
        "null or empty values are no document")
    mixture: listed(MixtureSource) = Field((), description="weighted sources, each prepared and cached on its own; "
        "replaces `source`/`paths`/`text_field`")
    synthetic_instances: Int = Field(20000, description="`induction`/`algorithmic`: instances generated before the "
        "split (repeated instances stay on one side of it)", gt=0)
    synthetic_seed: Int = Field(0, description="`induction`/`algorithmic`: seed of the generated instances", ge=0)
    synthetic_difficulty: Int = Field(2, description="`induction`: names per story (1-8); `algorithmic`: digits per "
        "operand (1-18)", ge=1)
    task_instances: Int = Field(64, description="`induction`/`algorithmic`: held-out instances the task metric scores "
        "at each eval (`eval/task/...`) and in `decode.py --eval`", ge=0)
    tokenizer: Str = Field("byte", description="`byte` (256 ids, byte 0 = end of document), `bpe` (byte-level BPE "
        "trained offline on the train split; not with a mixture), or a path to a `tokenizer.json` or sentencepiece "
        "`.model`")
    bpe_vocab_size: Int = Field(1024, description="vocabulary of the trained BPE", ge=260)
    seq_len: Int = Field(256, description="tokens per training window (T; ≥ `model.mtp_depth` + 2)")
    cache_dir: Str = Field("~/.cache/mtpjax", description="where prepared (tokenized) corpora are cached; on several "
        "hosts, storage they all see", json_schema_extra=RUNTIME)
    val_fraction: Float = Field(0.05, description="fraction held out for validation: of the documents, split by a "
        "hash of their path, line or row (generated sources: of the instance); of the tokens, the stream's last, for "
        "`array` ids or where every document hashes to one side (`python -m mtpjax data prepare` names the split)",
        gt=0, lt=1)
    shuffle: Bool = Field(True, description="shuffle training windows (seeded by `train.seed`)")
    num_workers: Int = Field(0, description="prefetch threads of the input pipeline", ge=0, json_schema_extra=RUNTIME)
    prepare_workers: Int = Field(0, description="processes that read and tokenize during preparation (0: the training "
        "process); same arrays either way", ge=0, json_schema_extra=RUNTIME)


class OptimConfig(Section):
    lr: Float = Field(3e-3, description="peak learning rate", gt=0)
    min_lr_ratio: Float = Field(0.1, description="final learning rate as a fraction of the peak (`cosine`, "
        "`linear`; `constant` holds the peak)", ge=0, le=1)
    warmup_steps: Int = Field(50, description="linear warmup steps", ge=0)
    schedule: choice("cosine", "linear", "constant") = Field("cosine", description="decay after warmup")
    weight_decay: Float = Field(0.1, description="AdamW decoupled weight decay (not applied to 1-D parameters)", ge=0)
    b1: Float = Field(0.9, description="Adam β1", ge=0, lt=1)
    b2: Float = Field(0.95, description="Adam β2", ge=0, lt=1)
    eps: Float = Field(1e-8, description="Adam ε (0 would move a parameter whose gradients were all 0 so "
        "far, e.g. the embedding row of a token not yet seen with an untied head, by 0/0: NaN)", gt=0)
    grad_clip: Float = Field(1.0, description="global-norm clipping (0 disables)", ge=0)


class TrainConfig(Section):
    steps: Int = Field(1000, description="total optimizer steps", gt=0)
    batch_size: Int = Field(16, description="global batch (sequences per step)", gt=0)
    micro_batches: Int = Field(1, description="gradient accumulation: the batch is split into this many parts (must "
        "divide `batch_size`; equivalent, but for the slots a `model.moe_buffer_factor` > 0 drops, sized per part); "
        "the eval step computes in the same parts", gt=0)
    seed: Int = Field(0, description="parameter init and data order")
    run_dir: Str = Field("runs/default", description="checkpoints, TensorBoard logs, config and tokenizer of the run")
    log_every: Int = Field(10, description="steps between logged training scalars, and the last step", gt=0)
    eval_every: Int = Field(200, description="steps between validation evals (and samples), and the last step",
        gt=0)
    eval_batches: Int = Field(8, description="validation batches per eval (fewer if the split is short: each window "
        "once); 0: no evals, so neither samples nor a task metric", ge=0)
    num_samples: Int = Field(2, description="generated samples written to TensorBoard per eval (at most `batch_size`; "
        "on several processes, process 0's rows of a batch)", ge=0)
    eval_tasks: Strs = Field((), description="lm-eval tasks scored every `eval_tasks_every` steps, logged to "
        "TensorBoard as `tasks/<task>/<metric>` (the shipped ones: `mtpjax`; needs the `eval` extra); empty: none")
    eval_tasks_every: Int = Field(1000, description="steps between task evals (`eval_tasks`), and the last step", gt=0)
    eval_tasks_limit: Float = Field(0.0, description="documents per task in a task eval (0: all; below 1: that "
        "fraction of each task's, as `decode.py --limit`)", ge=0)
    nan_policy: one_of("on a non-finite loss or gradient", stop="stop the run", skip="skip the update")
    max_skipped_steps: Int = Field(10, description="`skip` policy: skipped updates allowed (the run's, restarts "
        "included); the next one stops the run", ge=0)
    peak_flops: Float = Field(0.0, description="per-device peak FLOP/s for MFU; 0 = the chip's published dense bf16 "
        "peak on a GPU or TPU (the table `compile` reports use), and only on CPU the best float32 matmul rate of XLA, "
        "numpy or torch, measured at start (the log says which)", ge=0)
    progress: Bool = Field(True, description="tqdm progress bar in a terminal; piped to a file, or false, a line per "
        "`log_every` steps instead (losses, lr, grad_norm, tokens/s, MFU)")
    profile: Str = Field("", description="`start:stop` (e.g. `10:13`): a `jax.profiler` trace of the steps after "
        "`start` up to `stop` completed steps (`start` < `steps`), in the run's TensorBoard directory (profile tab); "
        "empty: none")
    compilation_cache: Bool = Field(True, description="persistent XLA compilation cache in `$MTPJAX_CACHE_DIR/xla` "
        "(default `~/.cache/mtpjax/xla`): a restarted run compiles nothing it compiled before")
    init_from: Str = Field("", description="a run directory (or `convert import --out`) whose trunk, embedding and "
        "head start this new run (step 0); read only while `train.run_dir` has no checkpoint; the `model.*` keys of "
        "the trunk must match it")
    freeze: one_of("what does not train", none="everything trains", trunk="only the MTP modules train and have "
        "optimizer state (needs `train.init_from` and `model.mtp_depth` ≥ 1)")
    bias_update_speed: Float = Field(0.001, description="`model.mlp_kind=moe`: each step moves every expert's routing "
        "bias by ± this toward the mean load of the global batch (0: no balancing)", ge=0)
    keep_mtp: Bool = Field(False, description="with `train.init_from`: keep its MTP modules (same kind, at least as "
        "many) instead of fresh ones (`model.mtp_init`)")
    own_text: one_of("post-training (`train.init_from`) on the trunk's own text: the training sequences are the "
        "init_from trunk's continuations of corpus prompts, generated once by the decoder in batches and cached in the "
        "run directory (`own_text/`)", off="train on the corpus", greedy="greedy continuations", sample="continuations "
        "sampled at temperature 1 (seeded by `train.seed`)")
    own_text_sequences: Int = Field(256, description="`own_text`: generated sequences of `data.seq_len` tokens (at "
        "least `train.batch_size`); training cycles through them", gt=0)
    own_text_prompt_len: Int = Field(32, description="`own_text`: corpus tokens each sequence starts from (the first "
        "tokens of a training window; less than `data.seq_len`)", gt=0)


class MeshConfig(Section):
    data: Int = Field(1, description="data-parallel mesh axis", gt=0)
    fsdp: Int = Field(1, description="fully-sharded data-parallel axis (parameters sharded, batch split)", gt=0)
    tensor: Int = Field(1, description="tensor-parallel axis (heads, MLP and vocabulary split; divides "
        "`model.n_kv_heads` or is a multiple of it)", gt=0)
    # expert is last among the fields (positional MeshConfig(data, fsdp, tensor) keeps its meaning); the mesh's
    # axis order is parallel.sharding.AXES
    expert: Int = Field(1, description="expert-parallel axis: routed experts' weights split over it, the batch too "
        "(must divide `model.n_routed_experts`)", gt=0)
    stage: Int = Field(1, description="pipeline stages: the scanned trunk's blocks split over them (GPipe, or "
        "circular with `stage_repeats`; `train.micro_batches` micro-batches; must divide `model.n_layers` unless "
        "`stage_layers` is set, needs `model.scan_layers`)", gt=0)
    stage_layers: Ints = Field((), description="trunk blocks per stage, first to last (e.g. [5, 5, 4, 4]: 18 over 4 "
        "stages); one positive count per stage, summing to `model.n_layers`; empty = an even split. Every stage runs "
        "as many ticks as the largest count (the others pass their padding through)")
    stage_repeats: Int = Field(1, description="R, a circular pipeline: the trunk in S·R chunks, stage s running chunks "
        "s, s + S, ... (each its turn), so a micro-batch passes the stages R times and the bubble falls to "
        "(S−1)/(R·M+S−1); each stage gathers its chunks' blocks every step (must divide `model.n_layers` / "
        "`mesh.stage`; needs `train.micro_batches` ≥ `mesh.stage` and an even split)", gt=0)


class CheckpointConfig(Section):
    every: Int = Field(500, description="steps between checkpoints (a fresh run's first step, which tries the "
        "storage early, and the last step are always saved)", gt=0)
    keep: Int = Field(3, description="checkpoints kept", gt=0)
    async_save: Bool = Field(True, description="save in the background while training continues")
    verify: Bool = Field(True, description="on resume, check every restored array, the data position and the config "
        "against the xxh3-128 digests saved with them (a mismatch falls back to the previous checkpoint); false skips "
        "the check, for speed (decoding, `train.init_from` and export always check)")


Draft = parsed(drafts.Tree | drafts.Auto, drafts.parse, lambda d: d.name())  # a DraftError is a SpellingError


class DecodeConfig(Section):
    max_new_tokens: Int = Field(128, description="default generation length of `decode.py`", gt=0)
    draft: Draft = Field(drafts.Auto(), description="what a round drafts (`decode.py --num-draft/--tree`): `auto` "
        "(timed per request among plain, chains and small trees), `0` (plain), `3` (a chain of 3), children per node "
        "at each depth (`2x2x1`) or each node's parent (`-1,-1,0,0`); `+ngramL` adds n-gram lookup's L drafts as one "
        "more branch (`2x2+ngram3`)", json_schema_extra={"forms": drafts.FORMS})
    proposer: one_of("what drafts (`decode.py --proposer`)", mtp="the run's MTP modules (module k drafts token k)",
        mtp1="MTP module 1 drafts every token, fed its own output", ngram="prompt lookup", model="the "
        "`decode.py --draft-run-dir` model")
    temperature: Float = Field(0.0, description="sampling temperature; 0 = greedy", ge=0)
    top_k: Int = Field(0, description="top-k filter (0 = off)", ge=0)
    top_p: Float = Field(1.0, description="nucleus filter (1 = off)", gt=0, le=1)
    max_len: Int = Field(2048, description="KV-cache capacity: prompt + generated tokens", gt=1)

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, raw: Any) -> Any:
        """A replaced key is refused with one line naming its successor (not as an unknown key)."""
        for name in raw if isinstance(raw, dict) else ():
            if (full := f"decode.{name}") in RETIRED:
                raise ConfigError(f"config key '{full}' was replaced by '{RETIRED[full]}' ({drafts.FORMS}); "
                                  f"write {RETIRED[full]}=... instead", full)
        return raw


# Keys that were replaced: a config naming one is refused with a line naming its successor.
RETIRED = {"decode.num_draft": "decode.draft", "decode.tree": "decode.draft"}


class Config(Section):
    model: ModelConfig = ModelConfig()
    loss: LossConfig = LossConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    decode: DecodeConfig = DecodeConfig()

    @model_validator(mode="after")
    def _rules(self) -> "Config":
        validate(self)
        return self

    def to_dict(self) -> dict:
        """Plain nested dict (tuples as lists, parsed values as their strings), the form saved next to checkpoints."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_PREFIX = {f.annotation: f"{name}." for name, f in Config.model_fields.items()}  # a section's keys, as errors name them


def walk(cls: type[Section] = Config, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, FieldInfo, type) for every key of section `cls` (Config: every section's), in schema order."""
    out = []
    for name, f in cls.model_fields.items():
        out += walk(f.annotation, f"{name}.") if cls is Config else [(f"{prefix}{name}", f, f.annotation)]
    return out


KEYS = tuple(k for k, _, _ in walk())  # every dotted key, in schema order
# Keys that change neither the weights nor the prepared tokens and their stream (a backend, what the backward
# recomputes, worker counts, a cache location): a run resumes, and a checkpoint decodes, with other values.
RUNTIME_KEYS = frozenset(k for k, f, _ in walk() if (f.json_schema_extra or {}).get("runtime"))


def identity(cfg: Config, section: str) -> dict:
    """cfg's `section` as a plain dict without its runtime-only keys (what must match to be the same run)."""
    return {k: v for k, v in cfg.to_dict()[section].items() if f"{section}.{k}" not in RUNTIME_KEYS}


def choices(cls: type[Section], name: str) -> tuple[str, ...]:
    """The values field `name` of section `cls` accepts (its Literal's arguments); () if it is not a choice."""
    tp = cls.model_fields[name].annotation
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
