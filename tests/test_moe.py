"""The mixture of experts (issue 25): routing against a float64 numpy forward, aux-loss-free balancing in the train
step, expert-parallel sharding, speculative decoding on an MoE trunk, and the settings refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float64_reference import reference_moe
from test_distributed import LAUNCH, REPO, SHRINK, sub_env
from test_speculative import PROMPTS, _check_greedy_equal, _train
from train_helpers import step_losses, synthetic_batches, tiny_cfg, write_corpus

from mtpjax import data
from mtpjax.config import ConfigError, load_config, replace
from mtpjax.eval.plan import build_plan, format_plan
from mtpjax.nn.flops import flops_per_token
from mtpjax.nn.model import build_model, moe_layers, param_counts
from mtpjax.nn.moe import MoE, next_bias
from mtpjax.nn.placement import host_placement
from mtpjax.parallel.sharding import make_mesh
from mtpjax.train.checkpoint import Checkpointer, load_model
from mtpjax.train.step import make_programs

MOE = ["model.mlp_kind=moe", "model.n_routed_experts=8", "model.num_experts_per_tok=2", "model.n_group=4",
       "model.topk_group=2", "model.moe_d_ff=16", "model.n_shared_experts=1", "model.first_k_dense_replace=1",
       "model.routed_scaling_factor=2.0"]


# ----------------------------------------------------------------------------- the block's MLP against numpy

@pytest.fixture(scope="module")
def block():
    """An MoE MLP with large weights and a bias that changes choices, its float64 parameters and 64 or 160 tokens."""
    m = load_config(None, MOE + ["model.d_model=16", "model.init_std=0.5", "model.num_experts_per_tok=3"]).model
    moe = MoE(m, nnx.Rngs(params=1), host_placement())
    moe.bias[...] = jnp.asarray(np.random.default_rng(2).normal(0, 0.3, 8), jnp.float32)
    p = jax.tree.map(lambda v: np.asarray(v, np.float64), nnx.to_pure_dict(nnx.state(moe)))
    rng = np.random.default_rng(3)
    return m, moe, p, {n: rng.normal(size=(n, 16)) for n in (5, 160)}


@pytest.mark.parametrize("tokens, grouping", [(160, "blocks"), (5, "blocks"), (160, "ragged")])
def test_moe_matches_float64_numpy(block, tokens, grouping):
    """Sigmoid scores, the bias for selection only, the group limit, top-k normalization, scaling, shared experts;
    160 tokens take the CPU's expert blocks, 5 tokens its one-row blocks, `ragged` jax.lax.ragged_dot."""
    m, moe, p, xs = block
    moe.grouping = grouping
    x = xs[tokens]
    y, aux = moe(jnp.asarray(x, jnp.float32)[None])
    ref, chosen = reference_moe(x, p, m)
    np.testing.assert_allclose(np.asarray(y[0], np.float64), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux["load"]), np.bincount(chosen.ravel(), minlength=8))


@pytest.mark.parametrize("broken", ["normalize", "bias_in_weights", "group_limit"])
def test_moe_reference_companions_fail(block, broken):
    """Each rule matters on this input: the reference without it is far from ours."""
    m, moe, p, xs = block
    moe.grouping = "blocks"
    y = np.asarray(moe(jnp.asarray(xs[160], jnp.float32)[None])[0][0], np.float64)
    flags = {"normalize": True, "bias_in_weights": False, "group_limit": True}
    flags[broken] = not flags[broken]
    assert np.max(np.abs(y - reference_moe(xs[160], p, m, **flags)[0])) > 1e-2


def test_expert_load_leaves_padding_out(block):
    """Segment id 0 is padding: its tokens are routed (the output is per token) but not counted in the load."""
    m, moe, p, xs = block
    moe.grouping = "blocks"
    seg = np.ones((2, 80), np.int32)
    seg[1, 30:] = 0
    _, aux = moe(jnp.asarray(xs[160].reshape(2, 80, 16), jnp.float32), jnp.asarray(seg))
    _, chosen = reference_moe(xs[160], p, m)
    real = np.bincount(chosen[seg.ravel() != 0].ravel(), minlength=8)
    np.testing.assert_array_equal(np.asarray(aux["load"]), real)
    assert (real != np.bincount(chosen.ravel(), minlength=8)).any()  # counting the padding would differ


def test_sequence_balance_statistic(block):
    """DeepSeek-V3's f_i·P_i summed over experts and rows: f from the chosen experts, P from normalized scores."""
    m, moe, p, xs = block
    x = xs[160].reshape(2, 80, 16)
    _, aux = moe(jnp.asarray(x, jnp.float32))
    s = 1 / (1 + np.exp(-(x @ p["router"])))
    want = 0.0
    for r in range(2):
        _, chosen = reference_moe(x[r], p, m)
        f = np.bincount(chosen.ravel(), minlength=8) * 8 / (3 * 80)
        want += (f * (s[r] / s[r].sum(-1, keepdims=True)).mean(0)).sum()
    np.testing.assert_allclose(float(aux["balance"]), want, rtol=1e-5)


def test_sequence_balance_leaves_padding_out(block):
    """A row padded past token 30 counts as its 30 real tokens (f over 30, P their mean); companion: the same
    row with its padding counted as tokens differs."""
    m, moe, p, xs = block
    x = xs[160].reshape(2, 80, 16)
    seg = np.ones((2, 80), np.int32)
    seg[1, 30:] = 0
    _, aux = moe(jnp.asarray(x, jnp.float32), jnp.asarray(seg))
    s = 1 / (1 + np.exp(-(x @ p["router"])))

    def row(r, n):
        _, chosen = reference_moe(x[r, :n], p, m)
        f = np.bincount(chosen.ravel(), minlength=8) * 8 / (3 * n)
        return (f * (s[r, :n] / s[r, :n].sum(-1, keepdims=True)).mean(0)).sum()

    np.testing.assert_allclose(float(aux["balance"]), row(0, 80) + row(1, 30), rtol=1e-5)
    assert abs(float(aux["balance"]) - (row(0, 80) + row(1, 80))) > 1e-3


# ----------------------------------------------------------------------------- balancing in the train step

def _biases(state, graphdef) -> dict:
    return {k: np.asarray(v.bias[...]) for k, v in moe_layers(nnx.merge(graphdef, state.params)).items()}


def _loads(progs, state, tok, seg) -> dict:
    out = nnx.merge(progs.graphdef, state.params)(jnp.asarray(tok), jnp.asarray(seg))
    return {k: np.asarray(a["load"]) for k, a in out.routing.items()}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    cfg = tiny_cfg(tmp_path_factory.mktemp("moe"), *MOE, "train.bias_update_speed=0.01")
    return cfg, make_programs(cfg, make_mesh(cfg.mesh))


@pytest.mark.slow
def test_bias_moves_toward_underloaded_experts(moe_run):
    cfg, progs = moe_run
    state = progs.init()
    tok, seg = synthetic_batches(1, 8, 32)[0]
    loads = _loads(progs, state, tok, seg)
    assert set(loads) == {"blocks.1", "mtp.0", "mtp.1"}  # block 0 dense (first_k_dense_replace=1)
    state, met = progs.train_step(state, tok, seg)
    for name, bias in _biases(state, progs.graphdef).items():
        load = loads[name]
        np.testing.assert_array_equal(bias, np.float32(0.01) * np.sign(load.mean() - load), err_msg=name)
        assert (bias[load < load.mean()] > 0).all() and (bias[load > load.mean()] < 0).all()
        assert float(met[f"moe/{name}/load_max_over_mean"]) == pytest.approx(load.max() / load.mean())
        assert float(met[f"moe/{name}/bias_range"]) == pytest.approx(np.ptp(bias))
    assert int(met["skipped"]) == 0 and "expert_load/blocks.1" not in met


@pytest.mark.slow
def test_micro_batches_balance_on_the_whole_batch(moe_run):
    """train.micro_batches=2 moves the biases as one batch does: the loads are summed before the sign."""
    cfg, progs = moe_run
    tok, seg = synthetic_batches(1, 8, 32)[0]
    one = _biases(progs.train_step(progs.init(), tok, seg)[0], progs.graphdef)
    cfg2 = replace(cfg, ["train.micro_batches=2"])
    progs2 = make_programs(cfg2, make_mesh(cfg2.mesh))
    two = _biases(progs2.train_step(progs2.init(), tok, seg)[0], progs2.graphdef)
    for k in one:
        np.testing.assert_array_equal(one[k], two[k], err_msg=k)


def test_skipped_step_does_not_move_the_bias(moe_run):
    cfg, progs = moe_run
    state = progs.init()
    scale = state.params["final_norm"]["scale"]
    scale[...] = jnp.full_like(scale[...], jnp.inf)
    state, met = progs.train_step(state, *synthetic_batches(1, 8, 32)[0])
    assert int(met["skipped"]) == 1
    assert all((b == 0).all() for b in _biases(state, progs.graphdef).values())


@pytest.mark.slow
def test_frozen_trunk_keeps_its_biases_while_the_modules_move(moe_run):
    cfg = replace(moe_run[0], ["train.init_from=unused", "train.freeze=trunk"])
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    state, _ = progs.train_step(progs.init(), *synthetic_batches(1, 8, 32)[0])
    biases = _biases(state, progs.graphdef)
    assert (biases["blocks.1"] == 0).all()
    assert all(np.abs(biases[k]).sum() > 0 for k in ("mtp.0", "mtp.1"))


def test_bias_is_outside_the_optimizer(moe_run):
    """The optimizer's moments cover no bias: it is an ExpertBias variable, not a parameter."""
    state = moe_run[1].init()
    paths = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(state.opt.inner_state[1][0].mu)]
    assert paths and not any(p.endswith("mlp/bias") for p in paths)


@pytest.mark.slow
def test_resumed_biases_equal_a_straight_run(moe_run, tmp_path):
    """Save after 2 steps, restore, 2 more: the biases equal 4 straight steps'."""
    cfg, progs = moe_run
    batches = synthetic_batches(4, 8, 32, seed=5)
    straight, state = step_losses(cfg, batches)
    state2 = progs.init()
    for tok, seg in batches[:2]:
        state2, _ = progs.train_step(state2, tok, seg)
    ck = Checkpointer(tmp_path / "ck", cfg.checkpoint)
    ck.save(2, state2, {}, {"config": cfg.to_dict()}, force=True)
    ck.close()
    restored, _, _ = Checkpointer(tmp_path / "ck", cfg.checkpoint).restore(2, progs.target)
    for tok, seg in batches[2:]:
        restored, _ = progs.train_step(restored, tok, seg)
    a, b = _biases(state, progs.graphdef), _biases(restored, progs.graphdef)
    assert any(np.abs(v).sum() > 0 for v in a.values())
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ----------------------------------------------------------------------------- expert parallelism

@pytest.mark.slow
def test_expert_sharded_equals_one_device(tmp_path):
    """Expert-parallel (all-to-all) loss and gradients on 8 devices equal one device's; the wrong dispatch fails."""
    overrides = MOE + ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                       "model.n_kv_heads=2", "model.mtp_depth=1", "data.seq_len=32", "train.batch_size=8",
                       "loss.moe_seq_aux_loss=0.01"]
    (tmp_path / "in.json").write_text(json.dumps({"overrides": overrides}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "moe_worker.py"), str(tmp_path / "in.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for name in ("data2-expert4", "fsdp2-expert2-tensor2"):
        r = out[name]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), name
        assert r["grad_err"] < 1e-4, name
        assert r["spec"].startswith("P('expert'"), (name, r["spec"])
    # the companion: slots sent one shard too far meet the wrong experts
    wrong = out["wrong-dispatch"]
    assert wrong["grad_err"] > 0.1
    # dispatch and combine are all-to-alls and the expert weights stay on their shards; left to the partitioner, they
    # travel to the tokens (an all-reduce of every row-block's gathered weights)
    assert out["expert-parallel"]["all_to_all"] > 0 and out["expert-parallel"]["expert_weight_moves"] == 0
    assert out["gspmd"]["all_to_all"] == 0 and out["gspmd"]["expert_weight_moves"] > 0


@pytest.mark.slow
def test_two_processes_balance_on_the_global_batch(tmp_path):
    """mesh.expert=4 over 2 processes x 2 CPU devices (the all-to-all crosses processes) moves the biases as 1 process
    x 4 devices does: by the loads of both processes' rows (batch 8, 4 each), not by one process's (the companion);
    and its first step's parameters equal the one-process run's."""
    overrides = [o for o in SHRINK if not o.startswith(("mesh.", "train.steps", "checkpoint.every"))] + MOE + [
        "mesh.expert=4", "train.steps=1", "checkpoint.every=1", "train.bias_update_speed=0.01",
        f"data.paths={write_corpus(tmp_path)}", f"data.cache_dir={tmp_path / 'cache'}"]
    models = {}
    for n in (2, 1):
        p = subprocess.run(["bash", str(LAUNCH / "local.sh"), str(n), "--config", str(REPO / "configs/tiny.yaml"),
                            *overrides, f"train.run_dir={tmp_path / f'run{n}'}"],
                           env=sub_env(MTPJAX_LOCAL_DEVICES=4 // n, MTPJAX_INIT_TIMEOUT=120),
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        cfg, models[n], _ = load_model(tmp_path / f"run{n}")
    # the expected biases: one step from zero by the first global batch's loads (one device, no expert axis)
    batch = next(data.make_iterator(data.prepare(cfg.data), split="train", seq_len=cfg.data.seq_len,
                                    batch_size=cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle))
    tok, seg = (jnp.asarray(batch[k], jnp.int32) for k in ("tokens", "segment_ids"))
    start = build_model(cfg, seed=cfg.train.seed)
    loads, own = start(tok, seg).routing, start(tok[:4], seg[:4]).routing  # own: process 0's rows alone
    differs = False
    for name, layer in moe_layers(models[2]).items():
        want = np.asarray(next_bias(0.0, loads[name]["load"], 0.01))
        np.testing.assert_array_equal(np.asarray(layer.bias[...]), want, name)
        np.testing.assert_array_equal(np.asarray(moe_layers(models[1])[name].bias[...]), want, name)
        differs |= bool((np.asarray(next_bias(0.0, own[name]["load"], 0.01)) != want).any())
    assert differs
    params = {n: nnx.to_flat_state(nnx.state(models[n], nnx.Param)) for n in (2, 1)}
    init = dict(nnx.to_flat_state(nnx.state(start, nnx.Param)))
    # Adam's first update is about ±lr per element (m/√v), so a wrong batch or a lost gradient moves elements by ~lr;
    # reduction order alone moves one whose gradient is near eps by a small part of it (6.3e-7 seen): bound lr/1000.
    moved, atol = 0, 1e-3 * cfg.optim.lr
    for (key, a), (key1, b) in zip(params[2], params[1], strict=True):
        assert key == key1
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=0, atol=atol, err_msg=str(key))
        moved += not np.array_equal(np.asarray(a[...]), np.asarray(init[key][...]))
    assert moved > len(init) // 2  # the step changed them: equal after it, not merely at the start


# ----------------------------------------------------------------------------- decoding

@pytest.mark.slow  # default tier under 10 minutes; CI runs it
def test_greedy_speculative_equals_plain_with_an_moe_trunk():
    cfg = load_config(None, [f"model.{k}={v}" for k, v in dict(
        vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mtp_depth=2).items()]
        + MOE + ["data.seq_len=32"])
    model = build_model(cfg, seed=0)
    _train(model, cfg, steps=4)
    _check_greedy_equal(model, "mtp", (2,), (PROMPTS,))


# ----------------------------------------------------------------------------- counts

def test_total_and_active_parameters_and_flops():
    """Active = total less the routed experts a token does not reach; trunk matmul FLOPs = 2 x the weights it reads."""
    cfg = load_config(None, MOE + ["model.n_layers=3", "model.mtp_depth=1", "model.d_model=32", "model.vocab_size=64"])
    m = cfg.model
    model = nnx.eval_shape(lambda: build_model(cfg))
    counts = param_counts(model)
    expert = 3 * m.d_model * m.moe_d_ff  # gate, up, down
    unreached = (m.n_routed_experts - m.num_experts_per_tok) * expert
    assert counts["total"] - counts["active"] == (m.n_layers - 1 + m.mtp_depth) * unreached
    weights = sum(x.size for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)) if x.ndim >= 2)
    assert flops_per_token(m, 32)["trunk_matmul"] == 2 * (weights - (m.n_layers - 1) * unreached)
    text = format_plan(build_plan(cfg), cfg)
    assert f"active per token             {counts['active']:>14,d}" in text


def test_gpu_moe_is_deepseek_shaped_at_1b_active():
    """configs/gpu_moe.yaml: MLA + MoE, ~1B active of 4.66B as its header says, a module the DeepSeek export writes."""
    from types import SimpleNamespace

    from mtpjax.convert.export import _check

    cfg = load_config(REPO / "configs" / "gpu_moe.yaml")
    m = cfg.model
    assert (m.attention_kind, m.mlp_kind, m.mtp_depth, m.dtype, cfg.data.seq_len) == ("mla", "moe", 1, "bfloat16", 4096)
    assert m.mtp_hidden == "normed"  # DeepSeek-V3's engines feed module 1 the final-normed state
    assert _check(cfg, "deepseek_v3", None, SimpleNamespace(kind="hf", vocab_size=m.vocab_size)) == 1
    plan = build_plan(cfg)
    assert (plan["params"]["total"], plan["params"]["active"]) == (4_657_662_720, 958_286_592)
    assert plan["cache_bytes_per_token"] == 18_560
    assert round((plan["param_bytes"] + plan["optimizer_bytes"]) / 2**30, 1) == 52.1
    header = (REPO / "configs" / "gpu_moe.yaml").read_text()
    assert "4,657,662,720 parameters, 958,286,592 active" in header and "52.1 GiB" in header


# ----------------------------------------------------------------------------- settings refused

@pytest.mark.parametrize("overrides, key", [
    (["model.num_experts_per_tok=9"], "model.num_experts_per_tok"),
    (["model.n_group=3"], "model.n_group"),
    (["model.n_group=8", "model.topk_group=4"], "model.n_group"),
    (["model.topk_group=5"], "model.topk_group"),
    (["model.n_group=4", "model.topk_group=1", "model.num_experts_per_tok=3"], "model.num_experts_per_tok"),
    (["model.first_k_dense_replace=2"], "model.first_k_dense_replace"),
    (["model.scan_layers=true"], "model.first_k_dense_replace"),
    (["mesh.expert=3"], "mesh.expert"),
    (["model.mlp_kind=sparse"], "model.mlp_kind"),
])
def test_bad_moe_settings_are_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, MOE + ["model.n_layers=2"] + overrides)
    assert f"config key '{key}'" in str(e.value) and "\n" not in str(e.value)


def test_bad_moe_setting_exits_2_from_train(tmp_path, capsys):
    from mtpjax.cli.train import main

    cfg = Path(__file__).parent.parent / "configs" / "moe_tiny.yaml"
    assert main(["--config", str(cfg), "model.num_experts_per_tok=9", f"train.run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.num_experts_per_tok" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # three MoE models traced, two compiled with gradients (~9 s)
def test_remat_save_kernels_changes_nothing_and_reruns_no_routed_matmul(model_cfg):
    """model.remat=save_kernels: logits, loss and gradients of no remat, and a backward that recomputes the block
    but not its routed experts: each MoE layer's 3 routed matmuls (gate, up, down) are not in the recompute that
    remat full runs. Its companion is the count: remat full's program has them."""
    from test_model import _grad_program, all_logits, batch, loss_and_grads

    moe_cfg = dict(mlp_kind="moe", n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_d_ff=16,
                   first_k_dense_replace=1, mtp_depth=1)
    models = {r: build_model(model_cfg(**moe_cfg, remat=r), seed=6) for r in ("none", "full", "save_kernels")}
    toks, seg = batch(32)
    np.testing.assert_array_equal(all_logits(models["save_kernels"], toks, seg), all_logits(models["none"], toks, seg))
    (l1, g1), (l2, g2) = (loss_and_grads(models[r], toks, seg) for r in ("none", "save_kernels"))
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g2, g1)
    dots = {r: _grad_program(m, toks, seg).count("dot_general") for r, m in models.items()}
    assert dots["none"] < dots["save_kernels"] == dots["full"] - 3 * len(moe_layers(models["none"])), dots


def _pallas_calls(jaxpr, name: str) -> int:
    """Pallas calls of kernel `name` a jaxpr runs, nested jaxprs included (each time it is written)."""
    def nested(v):
        if hasattr(v, "jaxpr") and hasattr(v, "consts"):
            return [v.jaxpr]
        if hasattr(v, "eqns"):
            return [v]
        return [j for x in v for j in nested(x)] if isinstance(v, (list, tuple)) else []
    return sum((e.primitive.name == "pallas_call" and name in str(e.params.get("name", "")))
               + sum(_pallas_calls(j, name) for v in e.params.values() for j in nested(v)) for e in jaxpr.eqns)


@pytest.mark.parametrize("attention, forward", [("pallas", "mha_forward"), ("splash", "splash_mha_fwd")])
def test_remat_save_kernels_reruns_no_attention_kernel(model_cfg, monkeypatch, attention, forward):
    """With a Pallas attention kernel (interpreted here; Triton's a custom_vjp call to remat, splash's forward traced
    inline), remat save_kernels keeps its forward's output and row statistics: the gradient's program runs the
    forward kernel once per block, where remat full runs it twice."""
    from mtpjax.nn import kernels

    monkeypatch.setenv(kernels.INTERPRET_ENV, "1")
    toks, seg = jnp.zeros((1, 32), jnp.int32), jnp.ones((1, 32), jnp.int32)

    def forward_kernels(remat: str) -> int:
        model = build_model(model_cfg(attention=attention, remat=remat, mtp_depth=1), seed=6)
        gdef, state = nnx.split(model)
        loss = lambda st: nnx.merge(gdef, st)(toks, seg).hidden.sum()
        return _pallas_calls(jax.make_jaxpr(jax.grad(loss))(state).jaxpr, forward)

    blocks = model_cfg().n_layers + 1  # the trunk's and the MTP module's
    assert forward_kernels("save_kernels") == blocks and forward_kernels("full") == 2 * blocks
