"""Config schema: loading, dotted overrides with types, and every ConfigError naming its key."""

import json
import os
import threading
import typing
from pathlib import Path
from typing import Literal

import jax
import pytest
import numpy as np
from flax import nnx
from pydantic import Field, ValidationError

from mtpjax import drafts
from mtpjax.config import (
    RUNTIME_KEYS,
    Config,
    ConfigError,
    DecodeConfig,
    LossConfig,
    MeshConfig,
    MixtureSource,
    ModelConfig,
    choices,
    KEYS,
    from_dict,
    identity,
    load_config,
    replace,
)
from mtpjax.config.errors import bounds
from mtpjax.config.reference import COMMAND, markdown
from mtpjax.config.schema import Section, walk
from mtpjax.config.types import Int, choice
from mtpjax.nn.model import build_model, param_counts
from mtpjax.objective import LambdaSchedule, TargetMix

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
TINY = CONFIGS[0].parent / "tiny.yaml"


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
    assert len(KEYS) == sum(len(v) for v in cfg.to_dict().values())


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
    assert cfg.loss.mtp_lambda == LambdaSchedule("piecewise", (0.3, 0.1), (1000,))
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


@pytest.mark.parametrize("build, expected", [
    (lambda: ModelConfig(d_model=0), "config key 'model.d_model' = 0 is invalid: must be > 0"),
    (lambda: ModelConfig(dmodel=3), "unknown config key 'model.dmodel'; did you mean 'model.d_model'?"),
    (lambda: MeshConfig(1, 0), "config key 'mesh.fsdp' = 0 is invalid: must be > 0"),
    (lambda: Config(model={"d_model": 30}), "config key 'model.n_heads' = 4 is invalid: must divide model.d_model=30"),
    (lambda: from_dict({"data": {"mixture": None}}), "config key 'data.mixture' = None is invalid: expected a list"),
    (lambda: from_dict({1: 2}), "unknown config key '1'; known keys: model, loss"),
    (lambda: from_dict([1]), "config key '<root>' = [1] is invalid: expected a mapping of keys to values"),
])
def test_a_section_built_in_python_is_validated_with_the_same_one_line_errors(build, expected):
    """pydantic's ValidationError never reaches a caller: building a section is loading it, errors included."""
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_of_several_errors_the_first_wrong_key_as_written_is_reported_then_choices_and_bounds():
    """The order the dataclass loader reported in: wrong types and unknown keys as the input writes them, then values
    outside their choices or bounds in schema order (pydantic collects them all; one is reported)."""
    assert error_of(["train.eval_every=abc", "optim.lr=x"]).startswith("config key 'train.eval_every'")
    assert error_of(["optim.lr=x", "train.eval_every=abc"]).startswith("config key 'optim.lr'")
    assert error_of(["model.d_model=0", "train.stepz=1"]).startswith("unknown config key 'train.stepz'")
    assert error_of(["train.steps=0", "model.d_model=0"]).startswith("config key 'model.d_model' = 0")


def test_sections_are_frozen_and_take_values_in_field_order():
    mesh = MeshConfig(1, 2, 4)  # positional, as the dataclasses took them
    assert (mesh.data, mesh.fsdp, mesh.tensor, mesh.expert) == (1, 2, 4, 1)
    with pytest.raises(ValidationError, match="frozen"):
        mesh.data = 2
    assert hash(mesh) == hash(MeshConfig(fsdp=2, tensor=4)) and mesh == MeshConfig(fsdp=2, tensor=4)


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
    # past int64, what numpy and JAX hold it in: train.seed's was an OverflowError traceback, eval_batches' islice's
    ("train.seed=99999999999999999999999", "train.seed", "expected an integer (between -2**63 and 2**63)"),
    ("train.eval_batches=-9223372036854775809", "train.eval_batches", "expected an integer (between -2**63"),
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
    (["model.norm_eps=-1"], "model.norm_eps"),  # was accepted: NaN at step 1, "lower optim.lr"
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
    (["decode.draft=-2"], "decode.draft"),
    (["decode.proposer=eagle"], "decode.proposer"),
    (["decode.temperature=-1"], "decode.temperature"),
    (["decode.top_k=-1"], "decode.top_k"),
    (["decode.top_p=0"], "decode.top_p"),
    (["decode.max_len=1"], "decode.max_len"),
])
def test_invalid_value_names_key(overrides, key):
    assert f"config key '{key}'" in error_of(overrides)


@pytest.mark.parametrize("tree", ["2x0", "abc", "9x9", "-1,1", "2x2+trie", "2x2+ngram0", ""])
def test_a_bad_decode_tree_is_refused_when_the_config_loads(tree):
    """The draft's one parser (mtpjax.drafts) runs at load, not at the first decode; its DraftError is a SpellingError,
    so the config's line is the parser's with the key in front. (decode.draft replaced decode.tree: the message names
    the new key, and empty is no longer a chain.)"""
    from mtpjax.drafts import DraftError, parse

    with pytest.raises(DraftError) as e:
        parse(tree)
    msg = error_of([f"decode.draft={tree}"])
    assert msg == f"config key 'decode.draft' = {tree!r} is invalid: {e.value}" and "\n" not in msg


def test_a_bad_decode_tree_exits_2_from_train_and_writes_nothing(tmp_path, capsys):
    from mtpjax.cli.train import main

    run = tmp_path / "r"
    assert main(["--config", str(TINY), "decode.draft=2x0", f"train.run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "decode.draft" in err and "2x0" in err and "Traceback" not in err
    assert not run.exists()


@pytest.mark.parametrize("tree", ["auto", "0", "3", "2x2x1", "-1,-1,0,0", "2x2+ngram3", "2+ngram62"])
def test_companion_a_good_decode_tree_loads(tree):
    """The draft is the parsed value itself (a mtpjax.drafts Tree, or Auto), written back as its spelling."""
    cfg = load_config(None, [f"decode.draft={tree}"])
    assert cfg.to_dict()["decode"]["draft"] == tree and cfg.decode.draft.name() == tree
    assert isinstance(cfg.decode.draft, drafts.Auto) == (tree == "auto")


@pytest.mark.parametrize("old", ["decode.num_draft=3", "decode.tree=2x2"])
def test_the_retired_draft_keys_are_refused_naming_decode_draft(old, tmp_path, capsys):
    """decode.num_draft and decode.tree became decode.draft: an override or a YAML file naming either is one line
    naming the new key, and train.py exits 2 on it."""
    key = old.partition("=")[0]
    assert error_of([old]) == (f"config key '{key}' was replaced by 'decode.draft' (auto | 0 (plain) | 3 (a chain "
                               "of 3) | 2x2x1 | -1,-1,0,0 | 2x2+ngram3); write decode.draft=... instead")
    path = tmp_path / "old.yaml"
    path.write_text(f"decode:\n  {key.split('.')[1]}: 2\n")
    with pytest.raises(ConfigError, match=f"'{key}' was replaced by 'decode.draft'"):
        load_config(path)
    from mtpjax.cli.train import main

    assert main(["--config", str(TINY), old, f"train.run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "decode.draft" in err and "Traceback" not in err


def test_companion_decode_draft_loads_where_the_retired_keys_are_refused():
    assert load_config(None, ["decode.draft=3"]).decode.draft.size == 3


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
    assert LambdaSchedule.parse("0.3") == LambdaSchedule("constant", (0.3,))
    assert LambdaSchedule.parse("piecewise:0.3@1000,0.1") == LambdaSchedule("piecewise", (0.3, 0.1), (1000,))
    assert LambdaSchedule.parse("cosine: 0.3 -> 0.1 @ 10") == LambdaSchedule("cosine", (0.3, 0.1), (10,))


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
    assert f"config file '{missing}' does not exist; pass a YAML file" in error_of([], missing)
    assert f"config file '{tmp_path}' is a directory; pass a YAML file" in error_of([], tmp_path)


def test_invalid_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  d_model: 64\n  n_layers: [1, 2\n")
    msg = error_of([], p)
    assert f"config file '{p}' is not valid YAML" in msg and "line" in msg


def test_a_config_file_that_is_not_text_or_cannot_be_read_is_one_line(tmp_path):
    """Binary bytes and a read that fails (an I/O error; a file this user may not read) are a ConfigError naming the
    file, not a UnicodeDecodeError or OSError traceback."""
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"model:\n  d_model: 64\xff\xfe\n")
    assert error_of([], p) == (f"config file '{p}' is not UTF-8 text (byte 20); pass a YAML file such as "
                               "configs/tiny.yaml")
    mem = Path("/proc/self/mem")  # a regular file whose read fails with EIO, even for root
    if mem.exists():
        assert error_of([], mem) == (f"config file '{mem}' cannot be read (Input/output error); pass a readable "
                                     "YAML file")


def test_a_config_read_from_a_pipe(tmp_path):
    """--config <(...) names a pipe, not a regular file: it is read, not refused as missing."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("train:\n  steps: 7\n"), daemon=True)
    writer.start()
    assert load_config(fifo).train.steps == 7
    writer.join()


def test_yaml_not_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    assert "must hold a mapping of sections" in error_of([], p)


def test_unknown_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  mtp_dpeth: 2\n")
    assert "unknown config key 'model.mtp_dpeth'; did you mean 'model.mtp_depth'?" in error_of([], p)


# ----------------------------------------------------------------------------- parsed values (λ, MTP target)


LAMBDAS = [  # (as written, the typed value, its saved string, hand-computed λ at chosen steps)
    ("constant:0.3", LambdaSchedule("constant", (0.3,)), "constant:0.3", {0: 0.3, 10**6: 0.3}),
    ("0.25", LambdaSchedule("constant", (0.25,)), "constant:0.25", {0: 0.25, 7: 0.25}),
    ("piecewise:1@10,0.5@20,0", LambdaSchedule("piecewise", (1.0, 0.5, 0.0), (10, 20)), "piecewise:1.0@10,0.5@20,0.0",
     {0: 1.0, 9: 1.0, 10: 0.5, 19: 0.5, 20: 0.0, 100: 0.0}),
    ("linear:0.3->0.1@1000", LambdaSchedule("linear", (0.3, 0.1), (1000,)), "linear:0.3->0.1@1000",
     {0: 0.3, 250: 0.25, 500: 0.2, 1000: 0.1, 5000: 0.1}),
    ("cosine:0->0.1@100", LambdaSchedule("cosine", (0.0, 0.1), (100,)), "cosine:0.0->0.1@100",
     {0: 0.0, 25: 0.1 * (1 - 0.5 ** 0.5) / 2, 50: 0.05, 100: 0.1, 200: 0.1}),
    ("linear:1e-05->2@3", LambdaSchedule("linear", (1e-5, 2.0), (3,)), "linear:1e-05->2.0@3", {3: 2.0}),
]


@pytest.mark.parametrize("spec, typed, saved, points", LAMBDAS, ids=[x[0] for x in LAMBDAS])
def test_lambda_is_parsed_once_into_its_typed_value_and_saved_as_a_string(spec, typed, saved, points):
    cfg = load_config(None, [f"loss.mtp_lambda={spec}"])
    assert cfg.loss.mtp_lambda == typed and str(typed) == saved
    assert cfg.to_dict()["loss"]["mtp_lambda"] == saved and from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    sched = cfg.loss.mtp_lambda  # λ(step)
    for step, want in points.items():
        np.testing.assert_allclose(float(sched(step)), want, rtol=1e-6, atol=1e-7, err_msg=f"{spec} @ {step}")


def test_a_saved_config_is_the_same_run_whatever_spelling_it_was_written_in():
    """check_identity compares configs read back from their dicts: two spellings of one value are one run."""
    old = from_dict({"loss": {"mtp_lambda": "0.3", "mtp_target": "mix:0"}, "data": {"seq_len": 256.0}})
    assert identity(old, "loss") == identity(Config(), "loss") and old == Config()
    assert identity(from_dict({"loss": {"mtp_lambda": "0.31"}}), "loss") != identity(Config(), "loss")


def test_lambda_of_a_non_finite_value_is_refused():
    """1e999 reads as inf, whose saved string ('inf') would not load again."""
    for spec in ("constant:1e999", "linear:0.3->-1e999@5", "piecewise:1e999@3,0"):
        assert "config key 'loss.mtp_lambda'" in error_of([f"loss.mtp_lambda={spec}"])


def test_a_negative_lambda_is_refused():
    """A negative weight trains the MTP heads to predict wrongly, the total loss falling without bound (tiny, λ=-1:
    -15.6 after 40 steps of one batch, the MTP losses rising from 5.5 to 16.5); 0 still turns them off."""
    for key, spec in (("loss.mtp_lambda", "-0.3"), ("loss.mtp_lambda", "piecewise:0.3@10,-0.1"),
                      ("loss.mtp_lambda", "linear:0.3->-0.1@5"), ("loss.mtp_lambda_depths", "0.3;-0.1")):
        msg = error_of([f"{key}={spec}", "model.mtp_depth=2"])
        assert msg.startswith(f"config key '{key}'") and "finite numbers >= 0" in msg, msg
    assert float(load_config(None, ["loss.mtp_lambda=0"]).loss.mtp_lambda(0)) == 0.0


@pytest.mark.parametrize("spec, w_self, saved", [
    ("data", 0.0, "data"), ("self", 1.0, "self"), ("mix:0.25", 0.25, "mix:0.25"), ("mix:.5", 0.5, "mix:0.5"),
    ("mix:0", 0.0, "data"), ("mix:1", 1.0, "self"), ("mix:1e-3", 0.001, "mix:0.001")])
def test_mtp_target_is_parsed_once_into_weights_over_the_targets(spec, w_self, saved):
    target = load_config(None, [f"loss.mtp_target={spec}"]).loss.mtp_target
    assert isinstance(target, TargetMix) and target.weight("self") == w_self
    assert target.weight("data") == 1 - w_self and sum(target.weights) == 1
    assert str(target) == saved and TargetMix.parse(saved) == target


@pytest.mark.parametrize("spec", ["teacher", "mix:-0.1", "mix:2", "mix", "mix:a", "Self"])
def test_mtp_target_that_does_not_parse(spec):
    msg = error_of([f"loss.mtp_target={spec}"])
    assert msg.startswith(f"config key 'loss.mtp_target' = '{spec}' is invalid") and "mix:<w>" in msg


def test_loss_config_built_in_python_parses_its_strings():
    lc = LossConfig("piecewise:0.3@10,0.1", mtp_target="mix:0.5")
    assert lc.mtp_lambda == LambdaSchedule("piecewise", (0.3, 0.1), (10,)) and lc.mtp_target.weight("self") == 0.5
    assert LossConfig(lc.mtp_lambda, mtp_target=lc.mtp_target) == lc  # typed values pass through
    with pytest.raises(ConfigError, match="config key 'loss.mtp_target' = 'teacher'"):
        LossConfig(mtp_target="teacher")


# ----------------------------------------------------------------------------- choices and bounds, from the types


LITERALS = [(k, typing.get_args(tp)) for k, _, tp in walk() if typing.get_origin(tp) is Literal]
BOUNDED = [(k, f, tp) for k, f, tp in walk() if bounds(f)]


def test_the_schema_has_choice_and_bounded_fields():
    assert len(LITERALS) >= 12 and len(BOUNDED) >= 35  # the parametrizations below are not vacuous


@pytest.mark.parametrize("key, options", LITERALS, ids=[k for k, _ in LITERALS])
def test_every_choice_field_refuses_a_value_outside_its_literal(key, options):
    expected = f"config key '{key}' = 'bogus' is invalid: expected one of {', '.join(options)}"
    assert error_of([f"{key}=bogus"]) == expected
    for option in options:  # and each of its choices is a value the section accepts on its own
        section, name = key.split(".")
        assert getattr(type(getattr(Config(), section))(**{name: option}), name) == option


def test_a_mixture_source_refuses_a_value_outside_its_literal():
    msg = error_of(["data.mixture=[{name: a, source: web, paths: [x]}]"])
    assert msg == ("config key 'data.mixture[0].source' = 'web' is invalid: "
                   "expected one of stdlib, text, array, parquet, arrow, induction, algorithmic")


def _outside(f, tp) -> list:
    """Values just outside each finite side of field `f`'s bounds (Field's gt/ge/lt/le), of the field's type."""
    step = 1 if tp is int else 0.5
    b = {k: getattr(m, k) for m in f.metadata for k in ("gt", "ge", "lt", "le") if getattr(m, k, None) is not None}
    out = []
    if "gt" in b or "ge" in b:
        out.append(tp(b["gt"]) if "gt" in b else tp(b["ge"] - step))
    if "lt" in b or "le" in b:
        out.append(tp(b["lt"]) if "lt" in b else tp(b["le"] + step))
    return out


@pytest.mark.parametrize("key, f, tp", BOUNDED, ids=[k for k, _, _ in BOUNDED])
def test_every_bounded_field_refuses_a_value_outside_its_bounds(key, f, tp):
    for value in _outside(f, tp):
        assert error_of([f"{key}={value}"]) == f"config key '{key}' = {value!r} is invalid: must be {bounds(f)}"


def test_the_checks_come_from_the_field_types_and_metadata():
    """Companion: the same bad value passes where the field is a plain str / has no bounds."""

    class Typed(Section):
        mode: choice("a", "b") = "a"
        size: Int = Field(1, description="a size", gt=0)

    class Plain(Section):
        mode: str = "a"
        size: int = 1

    with pytest.raises(ConfigError, match="^config key 'mode' = 'c' is invalid: expected one of a, b$"):
        Typed(mode="c")
    with pytest.raises(ConfigError, match="^config key 'size' = 0 is invalid: must be > 0$"):
        Typed(size=0)
    assert bounds(Typed.model_fields["size"]) == "> 0" and bounds(Plain.model_fields["size"]) == ""
    Plain(mode="c", size=0)


def test_runtime_keys_are_marked_on_their_fields():
    assert RUNTIME_KEYS == {"model.attention", "model.remat", "loss.head_kernel", "data.cache_dir", "data.num_workers",
                            "data.prepare_workers"}


# ----------------------------------------------------------------------------- one list of choices


def test_every_decode_cli_choice_with_a_config_twin_is_the_configs():
    from mtpjax.cli.decode import parser

    twins = set(DecodeConfig.model_fields)
    checked = [a.dest for a in parser()._actions if a.choices is not None and a.dest in twins]
    assert checked == ["proposer"]  # not vacuous: the one flag with choices today
    for dest in checked:
        assert tuple(next(a for a in parser()._actions if a.dest == dest).choices) == choices(DecodeConfig, dest)


def test_every_proposer_is_a_config_choice_and_back():
    from mtpjax.decode.proposers import DRAFTERS

    assert tuple(DRAFTERS) == choices(DecodeConfig, "proposer")
    for name in DRAFTERS:  # decode.py --proposer mtp1 works, so does decode.proposer=mtp1
        assert load_config(None, [f"decode.proposer={name}"]).decode.proposer == name


def test_the_configs_proposer_is_what_decode_py_drafts_with():
    from mtpjax.cli.decode import _proposer, parser

    args = parser().parse_args(["--run-dir", "r", "--prompt", "x"])
    assert _proposer(args, load_config(None, ["decode.proposer=mtp1"])) == "mtp1"
    with pytest.raises(ValueError, match="^decode.proposer=model needs --draft-run-dir RUN"):
        _proposer(args, load_config(None, ["decode.proposer=model"]))
    assert _proposer(parser().parse_args(["--run-dir", "r", "--draft-run-dir", "d"]),
                     load_config(None, ["decode.proposer=model"])) == "model"


# ----------------------------------------------------------------------------- documented once


def test_every_key_has_a_doc_and_its_choice_docs_match_its_literal():
    for k, f, tp in walk() + walk(MixtureSource):
        assert f.description.strip(), k
        if "choices" in (f.json_schema_extra or {}):
            assert tuple(f.json_schema_extra["choices"]) == typing.get_args(tp), k


def test_the_configuration_page_is_generated_from_the_fields():
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert page == markdown(), f"docs/configuration.md is stale; regenerate it: {COMMAND}"
    assert COMMAND in page.split("\n## ")[0]  # the header names how
    for k, f, _ in walk():  # companion: every key is a row of the page, with its doc
        assert f"| `{k}` |" in page and f.description.replace("|", "\\|") in page, k
