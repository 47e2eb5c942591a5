"""Post-training on another run's trunk: train.init_from, train.freeze=trunk, train.keep_mtp, self targets."""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from train_helpers import cli_args, one_line_error, synthetic_batches, tiny_cfg, write_corpus

from mtpjax.train import posttrain
from mtpjax.train.checkpoint import Checkpointer, load_model
from mtpjax.config import ConfigError, load_config, replace
from mtpjax.nn.model import build_model
from mtpjax.parallel.sharding import make_mesh
from mtpjax.cli.train import main
from mtpjax.train.loop import train
from mtpjax.train.step import make_programs

POST = ["train.freeze=trunk", "train.steps=4", "train.eval_every=4", "checkpoint.every=2", "train.num_samples=0"]


def _source(tiny_run, tmp: Path) -> Path:
    """A private copy of the shared trained run (7 steps, checkpoints 4, 6, 7), to post-train from."""
    src = tmp / "source"
    shutil.copytree(tiny_run[1], src)
    return src


def _flat(tree) -> dict:
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(tree, nnx.Param))}


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.stat().st_size) for p in d.rglob("*")}


@pytest.mark.slow
def test_frozen_trunk_stays_bitwise_and_only_mtp_has_optimizer_state(tiny_run, tmp_path):
    src = _source(tiny_run, tmp_path)
    cfg = tiny_cfg(tmp_path, f"train.init_from={src}", *POST, run="post")
    out = train(cfg)
    assert [s for s, _ in out["history"]] == [1, 2, 3, 4] and out["step"] == 4  # a new run: steps count from 0
    assert 0 < out["eval/accept_prob/mtp_1"] < 1 and out["eval/expected_accept_length_sampled"] > 1
    before, after = _flat(load_model(src)[1]), _flat(load_model(tmp_path / "post")[1])
    trunk = [k for k in before if k[0] != "mtp"]
    assert trunk and all(np.array_equal(before[k], after[k]) for k in trunk)  # bitwise, embedding and head included
    assert any(not np.array_equal(before[k], after[k]) for k in before if k[0] == "mtp")
    # The optimizer's moments cover exactly the MTP parameters.
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state = Checkpointer(tmp_path / "post", cfg.checkpoint).restore(4, progs.target)[0]
    mu = dict(nnx.to_flat_state(state.opt.inner_state[1][0].mu))
    assert set(mu) == {k for k in after if k[0] == "mtp"}
    # Companion: the same run without the freeze moves the trunk.
    joint = train(replace(cfg, ["train.freeze=none", f"train.run_dir={tmp_path / 'j'}"]))
    assert joint["step"] == 4
    moved = _flat(load_model(tmp_path / "j")[1])
    assert any(not np.array_equal(before[k], moved[k]) for k in trunk)


@pytest.mark.slow
@pytest.mark.parametrize("unrolled", ["first", "last"])
def test_frozen_trunk_stays_bitwise_with_tv_unrolled_and_a_curriculum(tiny_run, tmp_path, unrolled):
    """Issue 24's objectives post-train on a frozen trunk too: tv target, a module unrolled, λ per depth."""
    src = _source(tiny_run, tmp_path)
    cfg = tiny_cfg(tmp_path, f"train.init_from={src}", *POST, "loss.mtp_target=tv", "loss.mtp_unroll=1",
                   f"loss.mtp_unroll_module={unrolled}", "loss.mtp_lambda_depths=forward:1", run="post")
    out = train(cfg)
    assert out["step"] == 4 and 0 < out["eval/accept_prob/unroll_1"] < 1 and out["lambda/unroll_1"] > 0
    before, after = _flat(load_model(src)[1]), _flat(load_model(tmp_path / "post")[1])
    assert all(np.array_equal(before[k], after[k]) for k in before if k[0] != "mtp")  # bitwise
    assert all(not np.array_equal(before[k], after[k]) for k in before if k[0] == "mtp" and k[-1] == "kernel")


@pytest.mark.slow
def test_parallel_modules_of_another_depth_post_train_on_a_sequential_trunk(tiny_run, tmp_path):
    """model.mtp_kind and model.mtp_depth may differ from the source's: fresh parallel modules, the trunk kept."""
    cfg = tiny_cfg(tmp_path, f"train.init_from={tiny_run[1]}", *POST, "train.steps=2", "train.eval_every=2",
                   "model.mtp_kind=parallel", "model.mtp_depth=3", "loss.mtp_target=self", run="par")
    out = train(cfg)
    assert out["step"] == 2 and "eval/accept_prob/mtp_3" in out
    before, after = _flat(load_model(tiny_run[1])[1]), _flat(load_model(tmp_path / "par")[1])
    assert all(np.array_equal(before[k], after[k]) for k in before if k[0] != "mtp")
    assert {k[1] for k in after if k[0] == "mtp"} == {0, 1, 2}


@pytest.mark.slow
def test_killed_and_resumed_post_training_equals_a_straight_run(tiny_run, tmp_path):
    """4 steps, stop, (the source gone), 4 more == 8 straight: init_from is read only before the first checkpoint."""
    src = _source(tiny_run, tmp_path)
    over = [f"train.init_from={src}", *POST, "train.steps=8", "loss.mtp_target=self"]
    straight = train(tiny_cfg(tmp_path, *over, run="a"))
    cfg_b = tiny_cfg(tmp_path, *over, run="b")
    first = train(cfg_b, max_steps=4)
    src.rename(tmp_path / "gone")  # a resumed post-training run no longer needs its source
    second = train(cfg_b)
    np.testing.assert_array_equal(np.array(first["history"] + second["history"]), np.array(straight["history"]))
    a, b = _flat(load_model(tmp_path / "a")[1]), _flat(load_model(tmp_path / "b")[1])
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert 0 < second["accept_prob/mtp_1"] < 1  # the self target computes it at every step


def _programs(cfg):
    return make_programs(cfg, make_mesh(cfg.mesh))


@pytest.mark.parametrize("extra, mtp_from", [
    ([], "fresh"), (["train.keep_mtp=true"], "source"), (["model.mtp_init=last_block"], "last_block"),
    (["model.scan_layers=true", "model.mtp_kind=parallel", "model.mtp_depth=1"], "fresh")])
def test_initial_state_takes_the_trunk_and_the_configured_mtp_modules(tiny_run, tmp_path, extra, mtp_from):
    src = tiny_run[1]
    cfg = tiny_cfg(tmp_path, f"train.init_from={src}", "train.freeze=trunk", *extra)
    scfg = posttrain.source_config(cfg)
    progs = _programs(cfg)
    state = posttrain.initial_state(cfg, scfg, progs)
    got = nnx.to_pure_dict(state.params)
    theirs = nnx.to_pure_dict(nnx.state(load_model(src)[1]))
    fresh = nnx.to_pure_dict(progs.init().params)
    blocks = got["blocks"]
    if cfg.model.scan_layers:  # the stacked layout of the same layers
        blocks = {i: jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(cfg.model.n_layers)}
    eq = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))
    assert eq(blocks, theirs["blocks"]) and eq(got["embed"], theirs["embed"])
    assert eq(got["final_norm"], theirs["final_norm"])
    want = {"fresh": fresh["mtp"], "source": theirs["mtp"]}.get(mtp_from)
    if mtp_from == "last_block":
        last = theirs["blocks"][cfg.model.n_layers - 1]
        assert all(eq(m["block"], last) for m in got["mtp"].values())
        assert eq(got["mtp"][0]["eh_proj"], fresh["mtp"][0]["eh_proj"])
    else:
        assert eq(got["mtp"], want)
    assert int(state.step) == 0 and {k for k, _ in nnx.to_flat_state(state.opt.inner_state[1][0].mu)} == {
        k for k, _ in nnx.to_flat_state(nnx.state(progs.init().params)) if k[0] == "mtp"}


@pytest.mark.slow
def test_a_frozen_step_computes_less_than_a_joint_step(tmp_path):
    """The frozen trunk is closed over, not differentiated: its backward is gone from the compiled step."""
    frozen = tiny_cfg(tmp_path, "train.init_from=unused", "train.freeze=trunk")
    joint = tiny_cfg(tmp_path, "train.init_from=unused")

    def flops(cfg):
        progs = _programs(cfg)
        tok, seg = synthetic_batches(1, 8, 32)[0]
        return progs.train_step.lower(progs.init(), tok, seg).compile().cost_analysis()["flops"]

    model = nnx.eval_shape(lambda: build_model(joint))
    gdef, st = nnx.split(model)
    trunk = jax.jit(lambda st, t: nnx.merge(gdef, st).trunk(t)[0]).lower(st, np.zeros((8, 32), np.int32))
    trunk_fwd = trunk.compile().cost_analysis()["flops"]
    f, j = flops(frozen), flops(joint)
    # The trunk's backward costs at least its forward (~2x); the frozen step saves at least that much.
    assert f <= j - trunk_fwd, (f, j, trunk_fwd)


def test_micro_batches_equal_the_full_batch_with_self_targets_on_a_frozen_trunk(tmp_path):
    """Self targets and accept_prob are normalized by the whole batch's counts too: micro-batches sum to it."""
    import functools

    import jax.numpy as jnp

    from mtpjax.train.optim import trainable
    from mtpjax.train.step import loss_and_grads, split_trainable

    cfg = tiny_cfg(tmp_path, "train.init_from=unused", "train.freeze=trunk", "loss.mtp_target=mix:0.7")
    progs = _programs(cfg)
    train_part, frozen = split_trainable(progs.init().params, trainable(cfg.train))
    assert {k[0] for k, _ in nnx.to_flat_state(train_part)} == {"mtp"}
    tok, seg = synthetic_batches(1, 8, 32)[0]

    def run(m):
        f = functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss, micro_batches=m)
        return jax.jit(f)(train_part, frozen, tok, seg, jnp.int32(0))

    (g1, m1), (g4, m4) = run(1), run(4)
    assert "accept_prob/mtp_2" in m1 and "expected_accept_length_sampled" in m1
    for k in m1:
        np.testing.assert_allclose(float(m4[k]), float(m1[k]), rtol=2e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=1e-6 * float(np.abs(a).max()))


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def _error(capsys, argv) -> str:
    return one_line_error(capsys, main, argv)


def _wordlevel_tokenizer(directory: Path) -> None:
    """A 3-word tokenizer saved where a run keeps its tokenizer (other ids than the byte tokenizer's)."""
    from tokenizers import AddedToken, Tokenizer, models

    from mtpjax.data.tokenizer import HFTokenizer

    shutil.rmtree(directory)
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    HFTokenizer(tok).save(directory)


@pytest.mark.parametrize("override, expected", [
    (["train.init_from={tmp}/missing"], "is not a directory"),
    (["train.init_from={tmp}/empty"], "holds no complete checkpoint"),
    (["train.init_from={src}", "model.d_model=64"], "another architecture (model.d_model 32 there, 64 here;"),
    (["train.init_from={src}", "model.vocab_size=512"], "model.vocab_size 256 there, 512 here"),
    (["train.init_from={src}", "train.keep_mtp=true", "model.mtp_depth=3"], "train.keep_mtp=true needs"),
    (["train.init_from={src}", "model.mtp_depth=0"], "model.mtp_depth=0"),
    (["train.init_from={src}", "loss.distill_temperature=0"], "loss.distill_temperature"),
    (["train.init_from={src}", "loss.mtp_target=mix:2"], "loss.mtp_target"),
    (["train.init_from={src}", "train.run_dir={src}"], "own train.run_dir"),
    (["train.init_from="], "needs train.init_from"),
    (["train.init_from={src}", "tokenizer"], "gives other token ids"),
])
def test_bad_input_is_one_line_exit_2_and_modifies_nothing(tiny_run, tmp_path, capsys, override, expected):
    src = _source(tiny_run, tmp_path)
    (tmp_path / "empty").mkdir()
    if "tokenizer" in override:
        _wordlevel_tokenizer(src / "tokenizer")
        override = override[:-1]
    over = [o.format(tmp=tmp_path, src=src) for o in override]
    before = _snapshot(src)
    argv = cli_args(tiny_cfg(tmp_path), "train.freeze=trunk", *over)
    assert expected in _error(capsys, argv)
    assert _snapshot(src) == before  # the source is never written
    assert not (tmp_path / "run").exists()  # not even an empty run dir


@pytest.mark.slow
def test_resuming_a_post_training_run_unfrozen_is_refused_by_name(tiny_run, tmp_path, capsys):
    """The optimizer state of a frozen run covers the MTP modules only: another train.freeze is another run."""
    cfg = tiny_cfg(tmp_path, f"train.init_from={tiny_run[1]}", *POST, "train.steps=2", run="post")
    train(cfg)
    before = _snapshot(tmp_path / "post")
    err = _error(capsys, cli_args(cfg, "train.freeze=none", "train.init_from=", "train.steps=3"))
    assert "train.freeze: 'trunk' -> 'none'" in err and "--fresh" in err
    assert _snapshot(tmp_path / "post") == before
    # Companion: the same resume with the same freeze goes on.
    assert train(replace(cfg, ["train.steps=3"]))["step"] == 3

def test_config_checks_of_the_new_keys():
    ok = ["train.init_from=somewhere"]
    assert str(load_config(None, [*ok, "train.freeze=trunk", "loss.mtp_target=mix:0.5"]).loss.mtp_target) == "mix:0.5"
    for bad, needle in [("train.freeze=mtp", "train.freeze"), ("loss.mtp_target=teacher", "loss.mtp_target"),
                        ("loss.distill_temperature=-1", "must be > 0"), ("loss.mtp_target=mix:-0.1", "mix:<w>")]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("+", r"\+")):
            load_config(None, [*ok, bad])
    with pytest.raises(ConfigError, match="train.keep_mtp"):
        load_config(None, ["train.keep_mtp=true"])


@pytest.mark.slow
def test_self_targets_beat_data_targets_on_a_frozen_trunk(tmp_path):
    """Equal post-training steps from the same fresh modules on one frozen trunk: the self target's drafts agree
    with the trunk more on held-out text, greedy and stochastic (bench/drafters.py measures it at a larger scale)."""
    corpus = write_corpus(tmp_path)
    common = ["model.d_model=64", "model.d_ff=128", "model.mtp_depth=1", "data.seq_len=64", "train.batch_size=16",
              "train.eval_batches=4", "train.num_samples=0", "checkpoint.every=1000", "optim.lr=3e-3",
              "optim.warmup_steps=10"]
    train(tiny_cfg(tmp_path, *common, "train.steps=200", "train.eval_every=200", corpus=corpus, run="trunk"))
    got = {}
    for target in ("data", "self"):
        out = train(tiny_cfg(tmp_path, *common, f"train.init_from={tmp_path / 'trunk'}", "train.freeze=trunk",
                             f"loss.mtp_target={target}", "train.steps=60", "train.eval_every=60", corpus=corpus,
                             run=target))
        got[target] = (out["eval/agreement/mtp_1"], out["eval/accept_prob/mtp_1"])
    print(got)
    assert got["self"][0] > got["data"][0] and got["self"][1] > got["data"][1], got


@pytest.mark.slow
def test_an_imported_model_post_trains_and_decodes(tmp_path):
    """transformers Qwen2 → `convert import` → init_from + freeze=trunk → decode.py: the imported trunk stays
    bitwise, and speculative greedy output with the post-trained modules equals plain greedy output."""
    import subprocess
    import sys

    from test_convert import ROOT, _hf_model, _tokenizer_json, cli

    from mtpjax.train.checkpoint import read_run_config

    hf_dir, imp = tmp_path / "qwen2", tmp_path / "imported"
    _hf_model("qwen2").save_pretrained(str(hf_dir))
    _tokenizer_json(hf_dir)
    assert cli("import", "--hf", hf_dir, "--out", imp, "model.mtp_depth=2") == 0
    corpus = write_corpus(tmp_path)
    cfg = replace(read_run_config(imp), [
        "data.source=text", f"data.paths={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32",
        "data.val_fraction=0.1", "train.batch_size=8", "train.eval_batches=1", "train.num_samples=1",
        "train.progress=false", "train.peak_flops=1e9", f"train.run_dir={tmp_path / 'post'}", f"train.init_from={imp}",
        "train.freeze=trunk", "loss.mtp_target=self", "train.steps=6", "train.eval_every=6", "checkpoint.every=3"])
    out = train(cfg)
    assert out["step"] == 6 and 0 <= out["eval/accept_prob/mtp_1"] <= 1
    before, after = _flat(load_model(imp)[1]), _flat(load_model(tmp_path / "post")[1])
    assert all(np.array_equal(before[k], after[k]) for k in before if k[0] != "mtp")
    outs = []
    for draft in ("2", "0"):
        p = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--run-dir", str(tmp_path / "post"), "--prompt",
                            "def f(x):", "--max-new-tokens", "12", "--num-draft", draft], check=False,
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1] and len(outs[0].strip()) > 0


@pytest.mark.slow
def test_drafters_bench_smoke(tmp_path, capsys, monkeypatch):
    """bench/drafters.py end to end at toy size: every drafter gets a row; MTP drafts decode as plain decoding does."""
    import json

    from bench import drafters

    monkeypatch.setattr(drafters, "BASE", [*drafters.BASE, "data.source=text",
                                           f"data.paths={write_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'c'}"])
    out = tmp_path / "res.json"
    assert drafters.main(["--work", str(tmp_path / "w"), "--trunk-steps", "3", "--post-steps", "2", "--draft-steps",
                          "2", "--rounds", "1", "--forced-seqs", "2", "--prompt-len", "16", "--max-new", "6",
                          "--batches", "1,2", "--json", str(out), "model.d_model=32", "model.n_layers=1",
                          "data.seq_len=32", "train.batch_size=4", "train.eval_batches=1"]) == 0
    res = json.loads(out.read_text())
    assert set(res["forced"]) == {"joint", "frozen_data", "frozen_self", "ngram", "draft_model"}
    assert all(r["identical_to_plain"] for b in res["decode"].values() for r in b.values())
    assert 0 < res["step_cost"]["flop_ratio_frozen_over_joint"] < 1
    assert capsys.readouterr().out.count("\n| ") >= 6


@pytest.mark.slow
def test_drafters_objectives_smoke(tmp_path, capsys, monkeypatch):
    """bench/drafters.py --objectives at toy size: a row per objective, chains of module 1 of length 1..4, every
    free decoding identical to plain decoding, the own-text run trained on generated text."""
    import json

    from bench import drafters

    monkeypatch.setattr(drafters, "BASE", [*drafters.BASE, "data.source=text",
                                           f"data.paths={write_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'c'}"])
    out = tmp_path / "res.json"
    assert drafters.main(["--objectives", "--work", str(tmp_path / "w"), "--trunk-steps", "3", "--post-steps", "2",
                          "--rounds", "1", "--forced-seqs", "2", "--prompt-len", "16", "--max-new", "6",
                          "--decode-prompts", "1", "--json", str(out), "model.d_model=32", "model.n_layers=1",
                          "data.seq_len=32", "train.batch_size=4", "train.eval_batches=1",
                          "train.own_text_sequences=4"]) == 0
    res = json.loads(out.read_text())
    assert set(res["chains"]) == {"joint", *(f"frozen_{k}" for k in drafters.OBJECTIVES)}
    for c in res["chains"].values():
        assert len(c["forced_mtp1"]) == drafters.CHAIN and len(c["forced_mtp"]) == 2
        assert all(c[f"mtp1x{g}"]["identical"] for g in range(1, drafters.CHAIN + 1)) and c["mtp2"]["identical"]
    assert (tmp_path / "w" / "post-own_text" / "own_text" / "tokens.npy").is_file()
    assert capsys.readouterr().out.count("\n| ") >= 7
