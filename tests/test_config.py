"""Config schema: loading, dotted overrides with types, and every ConfigError naming its key."""

from pathlib import Path

import jax
import pytest
from flax import nnx

from mtpjax.config import Config, ConfigError, field_doc, from_dict, load_config, parse_lambda, replace
from mtpjax.nn.model import build_model, param_counts

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def error_of(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg, "errors are one line"
    return msg


def test_defaults_valid_and_roundtrip():
    cfg = load_config()
    assert cfg == Config()
    assert from_dict(cfg.to_dict()) == cfg
    assert len(field_doc()) == sum(len(v) for v in cfg.to_dict().values())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_builds_abstractly(path):
    cfg = load_config(path)
    model = nnx.eval_shape(lambda: build_model(cfg))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    counts = param_counts(model)
    assert counts["total"] == sum(x.size for x in leaves) > 0
    assert len(counts["mtp"]) == cfg.model.mtp_depth


def test_overrides_apply_with_types(tmp_path):
    cfg = load_config(None, [
        "optim.lr=3e-4", "model.d_model=64", "model.tie_embeddings=false", "data.paths=a.txt",
        "data.source=text", "loss.mtp_lambda=piecewise:0.3@1000,0.1", "train.peak_flops=1e12", "optim.b1=0",
        "train.run_dir=runs/x y", "model.mtp_kind=parallel", "data.seq_len=128", "loss.chunk_size=64",
    ])
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.model.d_model == 64 and type(cfg.model.d_model) is int
    assert cfg.model.tie_embeddings is False
    assert cfg.data.paths == ("a.txt",)
    assert cfg.loss.mtp_lambda == "piecewise:0.3@1000,0.1"
    assert cfg.train.peak_flops == 1e12 and type(cfg.train.peak_flops) is float
    assert cfg.optim.b1 == 0.0 and type(cfg.optim.b1) is float
    assert cfg.train.run_dir == "runs/x y"
    assert cfg.model.mtp_kind == "parallel"
    assert load_config(None, ["data.source=text", "data.paths=[a, b]"]).data.paths == ("a", "b")
    assert load_config(None, ["model.d_model=128.0"]).model.d_model == 128


def test_overrides_on_top_of_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  d_model: 64\n  n_heads: 4\ntrain:\n")  # empty section reads as None
    cfg = load_config(p, ["model.n_layers=3", "train.steps=7"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps) == (64, 3, 7)


def test_replace_applies_and_validates():
    cfg = load_config(None, ["model.mtp_depth=3"])
    new = replace(cfg, ["model.mtp_depth=1", "train.steps=5"])
    assert (new.model.mtp_depth, new.train.steps, cfg.model.mtp_depth) == (1, 5, 3)
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        replace(cfg, ["model.mtp_depth=-1"])


def test_from_dict_rejects_unknown():
    with pytest.raises(ConfigError, match="unknown config key 'model.dmodel'; did you mean 'model.d_model'"):
        from_dict({"model": {"dmodel": 3}})


@pytest.mark.parametrize("override, expected", [
    ("modle.d_model=3", "unknown config key 'modle'; did you mean 'model'?"),
    ("model.n_layer=3", "unknown config key 'model.n_layer'; did you mean 'model.n_layers'?"),
    ("optim.learning_rate=3", "unknown config key 'optim.learning_rate'"),
    ("train.zzzz=1", "unknown config key 'train.zzzz'; known keys: steps, batch_size"),
])
def test_unknown_key(override, expected):
    assert expected in error_of([override])


@pytest.mark.parametrize("override, key, allowed", [
    ("model.d_model=abc", "model.d_model", "expected an integer"),
    ("model.d_model=1.5", "model.d_model", "expected an integer"),
    ("model.n_layers=true", "model.n_layers", "expected an integer"),
    ("model.tie_embeddings=1", "model.tie_embeddings", "expected true or false"),
    ("optim.lr=fast", "optim.lr", "expected a number"),
    ("optim.lr=true", "optim.lr", "expected a number"),
    ("train.run_dir=[a, b]", "train.run_dir", "expected a string"),
    ("model.mtp_kind=null", "model.mtp_kind", "expected a string"),
    ("data.paths=3", "data.paths", "expected a list"),
    ("data.paths=[a, [b]]", "data.paths[1]", "expected a string"),
    ("model=3", "model", "expected a mapping"),
])
def test_wrong_type(override, key, allowed):
    msg = error_of([override])
    assert f"config key '{key}'" in msg and allowed in msg


@pytest.mark.parametrize("overrides, key", [
    (["model.d_model=30", "model.n_heads=4"], "model.n_heads"),
    (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_kv_heads"),
    (["model.mtp_depth=-1"], "model.mtp_depth"),
    (["model.mtp_depth=3", "data.seq_len=4"], "data.seq_len"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.n_layers=0"], "model.n_layers"),
    (["model.head_dim=7"], "model.head_dim"),
    (["model.d_ff=-1"], "model.d_ff"),
    (["model.mtp_kind=medusa"], "model.mtp_kind"),
    (["model.remat=some"], "model.remat"),
    (["model.dtype=int8"], "model.dtype"),
    (["model.param_dtype=float16"], "model.param_dtype"),
    (["model.rope_theta=0"], "model.rope_theta"),
    (["model.init_std=0"], "model.init_std"),
    (["loss.chunk_size=-1"], "loss.chunk_size"),
    (["loss.chunk_size=100"], "loss.chunk_size"),
    (["data.source=web"], "data.source"),
    (["data.source=text"], "data.paths"),
    (["data.val_fraction=1"], "data.val_fraction"),
    (["data.bpe_vocab_size=100"], "data.bpe_vocab_size"),
    (["data.num_workers=-1"], "data.num_workers"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["optim.schedule=step"], "optim.schedule"),
    (["optim.weight_decay=-1"], "optim.weight_decay"),
    (["optim.b1=1"], "optim.b1"),
    (["optim.b2=1"], "optim.b2"),
    (["optim.grad_clip=-1"], "optim.grad_clip"),
    (["train.steps=0"], "train.steps"),
    (["train.batch_size=0"], "train.batch_size"),
    (["train.micro_batches=3"], "train.micro_batches"),
    (["train.log_every=0"], "train.log_every"),
    (["train.eval_every=0"], "train.eval_every"),
    (["train.eval_batches=-1"], "train.eval_batches"),
    (["train.num_samples=-1"], "train.num_samples"),
    (["train.nan_policy=ignore"], "train.nan_policy"),
    (["train.max_skipped_steps=-1"], "train.max_skipped_steps"),
    (["train.peak_flops=-1"], "train.peak_flops"),
    (["train.run_dir="], "train.run_dir"),
    (["mesh.fsdp=0"], "mesh.fsdp"),
    (["model.n_kv_heads=2", "mesh.tensor=3"], "mesh.tensor"),
    (["checkpoint.every=0"], "checkpoint.every"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["decode.max_new_tokens=0"], "decode.max_new_tokens"),
    (["decode.num_draft=-2"], "decode.num_draft"),
    (["decode.proposer=eagle"], "decode.proposer"),
    (["decode.temperature=-1"], "decode.temperature"),
    (["decode.top_k=-1"], "decode.top_k"),
    (["decode.top_p=0"], "decode.top_p"),
    (["decode.max_len=1"], "decode.max_len"),
])
def test_invalid_value_names_key(overrides, key):
    assert f"config key '{key}'" in error_of(overrides)


def test_boundaries_that_are_valid():
    cfg = load_config(None, ["model.mtp_depth=3", "data.seq_len=5"])  # exactly mtp_depth + 2
    assert (cfg.model.mtp_depth, cfg.data.seq_len) == (3, 5)
    assert "config key 'data.seq_len' = 4" in error_of(["model.mtp_depth=3", "data.seq_len=4"])  # one below
    # head_dim given: it wins over d_model / n_heads (10)
    cfg = load_config(None, ["model.d_model=30", "model.n_heads=3", "model.n_kv_heads=3", "model.head_dim=8"])
    assert cfg.model.resolved_head_dim == 8
    assert load_config(None, ["model.mtp_depth=0"]).model.mtp_depth == 0


@pytest.mark.parametrize("spec", [
    "foo:0.3", "constant:abc", "constant:", "constant:1e", "piecewise:0.3@100", "piecewise:0.3@100,0.1@50,0.05",
    "piecewise:0.3@100,0.1@100,0.05", "linear:0.3->0.1", "linear:0.3-0.1@10", "cosine:0.3->0.1@0", "linear:a->b@3",
])
def test_lambda_schedule_that_does_not_parse(spec):
    assert "config key 'loss.mtp_lambda'" in error_of([f"loss.mtp_lambda={spec}"])


def test_lambda_specs_parse():
    assert parse_lambda("0.3") == ("constant", {"value": 0.3})
    assert parse_lambda("piecewise:0.3@1000,0.1") == ("piecewise", {"values": [0.3, 0.1], "boundaries": [1000]})
    assert parse_lambda("cosine: 0.3 -> 0.1 @ 10") == ("cosine", {"init": 0.3, "end": 0.1, "steps": 10})


@pytest.mark.parametrize("override, expected", [
    ("model.d_model", "override 'model.d_model' is not of the form section.key=value"),
    ("model..d_model=3", "override 'model..d_model=3' has an empty key part"),
    ("=3", "override '=3' has an empty key part"),
    ("model.d_model.x=3", "override 'model.d_model.x=3': 'd_model' is a value, not a section"),
])
def test_bad_override_syntax(override, expected):
    assert expected in error_of(["model.d_model=64", override])


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert f"config file '{missing}' does not exist" in error_of([], missing)


def test_invalid_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  d_model: 64\n  n_layers: [1, 2\n")
    msg = error_of([], p)
    assert f"config file '{p}' is not valid YAML" in msg and "line" in msg


def test_yaml_not_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    assert "must hold a mapping of sections" in error_of([], p)


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  mtp_dpeth: 2\n")
    assert "unknown config key 'model.mtp_dpeth'; did you mean 'model.mtp_depth'?" in error_of([], p)
