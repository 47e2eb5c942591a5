"""model.attention: every backend that runs here (the Pallas kernels interpreted) equals the XLA reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.nn import kernels
from mtpjax.nn.kernels import INTERPRET_ENV, attention_backend
from mtpjax.nn.layers import self_attention
from mtpjax.nn.placement import host_placement

B, K, R, H = 2, 2, 2, 16  # grouped-query: 4 query heads over 2 key/value heads


@pytest.fixture(autouse=True)
def _fresh_notes():
    """Each test sees every choice noted afresh (they are noted once per process)."""
    attention_backend.cache_clear()
    kernels._NOTED.clear()


def _inputs(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, K, R, H)) / np.sqrt(H), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    seg = np.zeros((B, T), np.int32)
    seg[0, : T // 3], seg[0, T // 3: T - 5] = 1, 2  # two documents, then 5 padding positions (segment 0)
    seg[1, :4], seg[1, 4:] = 7, 8
    cot = jnp.asarray(rng.normal(size=(B, T, K, R, H)), jnp.float32)
    return q, k, v, jnp.asarray(seg), cot


def _reference(q, k, v, seg):
    pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return self_attention(q, k, v, pos, seg, "xla", host_placement())


def _out_and_grads(fn, q, k, v, seg, cot):
    out = fn(q, k, v, seg)
    grads = jax.grad(lambda q, k, v: (fn(q, k, v, seg) * cot).sum(), (0, 1, 2))(q, k, v)
    return out, grads


# block sizes that leave T = 37 / 150 a partial last block (the kernels pad T to a multiple)
KERNELS = {
    # the cuDNN adapter's exact call of jax.nn.dot_product_attention, run by its XLA implementation (no GPU here)
    "cudnn-call": (37, lambda q, k, v, s: kernels.cudnn_attention(q, k, v, s, implementation="xla")),
    "pallas": (37, lambda q, k, v, s: kernels.pallas_gpu_attention(q, k, v, s, interpret=True, block=16)),
    "pallas-tiles": (37, lambda q, k, v, s: kernels.pallas_gpu_attention(q, k, v, s, interpret=True, block=32,
                                                                         bwd_block=16)),  # backward's own tiles
    "splash": (150, lambda q, k, v, s: kernels.splash_attention(q, k, v, s, interpret=True, block=128)),
}


@pytest.mark.parametrize("with_segments", [True, False], ids=["segments", "causal-only"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_reference_output_and_gradients(name, with_segments):
    T, fn = KERNELS[name]
    q, k, v, seg, cot = _inputs(T)
    seg = seg if with_segments else None
    out, grads = _out_and_grads(fn, q, k, v, seg, cot)
    ref_out, ref_grads = _out_and_grads(_reference, q, k, v, seg, cot)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [37, 38], ids=["one-block", "two-causal-blocks"])  # blocks need an even T
@pytest.mark.parametrize("with_segments", [True, False], ids=["segments", "causal-only"])
def test_xla_attention_hand_written_backward_equals_autodiff_of_plain_softmax(with_segments, T):
    """layers.attend's backward is written out (head-major, no transposed scores): autodiff of the textbook
    masked softmax is its reference."""
    def plain(q, k, v, seg):
        T = q.shape[1]
        mask = jnp.tril(jnp.ones((T, T), bool))[None]
        if seg is not None:
            mask = mask & (seg[:, None, :] == seg[:, :, None])
        s = jnp.einsum("btkrh,bskh->bkrts", q, k)
        p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bkrts,bskh->btkrh", p, v)

    q, k, v, seg, cot = _inputs(T)
    seg = seg if with_segments else None
    out, grads = _out_and_grads(_reference, q, k, v, seg, cot)
    ref_out, ref_grads = _out_and_grads(plain, q, k, v, seg, cot)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5)


def test_companion_a_kernel_without_segment_ids_differs_from_the_reference():
    """The comparison above can fail: dropping the segment ids changes output and gradients by O(1)."""
    T, fn = KERNELS["pallas"]
    q, k, v, seg, cot = _inputs(T)
    out, _ = _out_and_grads(lambda q, k, v, s: fn(q, k, v, None), q, k, v, seg, cot)
    assert float(jnp.abs(out - _reference(q, k, v, seg)).max()) > 0.1


def test_auto_is_the_xla_path_on_cpu(monkeypatch, capfd):
    for name in ("cudnn_attention", "pallas_gpu_attention", "splash_attention"):
        monkeypatch.setattr(kernels, name, lambda *a, **k: pytest.fail("a fused kernel ran on CPU under auto"))
    q, k, v, seg, _ = _inputs(12)
    pos = jnp.broadcast_to(jnp.arange(12), (B, 12))
    np.testing.assert_array_equal(self_attention(q, k, v, pos, seg, "auto", host_placement()), _reference(q, k, v, seg))
    assert attention_backend("auto", "cpu", "float32", H, False) == ("xla", False)
    assert attention_backend("auto", "cpu", "bfloat16", H, True) == ("xla", False)
    assert "model.attention=auto runs xla on cpu" in capfd.readouterr().err


def test_choice_per_platform_and_visible_fallbacks(capfd):
    # GPU: Pallas (native segment ids; compiles without the cuDNN library), bf16/fp16 models; cuDNN when asked for
    assert attention_backend("auto", "gpu", "bfloat16", 128, False) == ("pallas", False)
    assert attention_backend("auto", "gpu", "float32", 128, False) == ("xla", False)
    assert attention_backend("cudnn", "gpu", "bfloat16", 128, False) == ("cudnn", False)
    assert attention_backend("auto", "tpu", "float32", 128, False) == ("splash", False)
    assert attention_backend("pallas", "gpu", "float32", 64, False) == ("pallas", False)
    assert attention_backend("pallas", "cpu", "float32", 64, True) == ("pallas", True)
    assert attention_backend("splash", "cpu", "float32", 64, True) == ("splash", True)
    err = capfd.readouterr().err
    assert "model.attention=splash runs in Pallas interpret mode on cpu" in err
    for name, platform in (("splash", "gpu"), ("pallas", "cpu"), ("cudnn", "cpu")):
        assert attention_backend(name, platform, "bfloat16", 64, False)[0] == ("pallas" if platform == "gpu" else "xla")
    assert attention_backend("cudnn", "gpu", "float32", 64, False) == ("xla", False)  # cuDNN never interprets
    err = capfd.readouterr().err.splitlines()
    assert "attention: model.attention=splash needs a TPU (this is gpu, bfloat16); using pallas" in err
    assert "attention: model.attention=pallas needs a GPU (this is cpu, bfloat16); using xla" in err
    assert ("attention: model.attention=cudnn needs a GPU with bf16/fp16 compute and head_dim <= 128 (this is gpu, "
            "float32); using xla") in err


def test_each_choice_is_logged_once(capfd):
    for _ in range(3):
        kernels.note("once-only test message")
    assert capfd.readouterr().err.count("once-only test message") == 1


def _model_grads(name, monkeypatch, T=37):
    """Gradients of one train step's loss on packed rows (GQA, T not a multiple of any block) with `name`."""
    from train_helpers import TINY, synthetic_batches

    from mtpjax.config import load_config
    from mtpjax.parallel.sharding import make_mesh
    from mtpjax.train.step import loss_and_grads, make_programs, split_trainable

    monkeypatch.setenv(INTERPRET_ENV, "1")
    cfg = load_config(None, TINY + [f"model.attention={name}", f"data.seq_len={T}", "train.batch_size=2",
                                    "data.paths=unused"])
    progs = make_programs(cfg, make_mesh(cfg.mesh))
    tok, seg = synthetic_batches(1, 2, T)[0]
    state = progs.init()
    grads = jax.jit(functools.partial(loss_and_grads, graphdef=progs.graphdef, loss_cfg=cfg.loss, micro_batches=1))
    return grads(*split_trainable(state.params), tok, seg, state.step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pallas", "splash"])
def test_model_gradients_with_an_interpreted_kernel_equal_xla(name, monkeypatch):
    """The whole model (trunk, MTP modules, loss) through each Pallas kernel: same loss and parameter gradients."""
    grads, met = _model_grads(name, monkeypatch)
    ref_grads, ref_met = _model_grads("xla", monkeypatch)
    np.testing.assert_allclose(float(met["loss/total"]), float(ref_met["loss/total"]), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-6, rtol=1e-5)


def test_attention_is_left_out_of_the_run_identity(tmp_path):
    """A run dir whose saved config differs only in model.attention is the same run; any other model key is not."""
    from mtpjax.config import identity, load_config
    from mtpjax.train.rundir import RunDirError, check_identity

    run = tmp_path / "run"
    run.mkdir()
    old = load_config(None, ["model.attention=splash", f"train.run_dir={run}"])
    (run / "config.yaml").write_text(old.to_yaml())
    new = load_config(None, ["model.attention=cudnn", f"train.run_dir={run}"])
    assert "attention" not in identity(new, "model") and identity(new, "model") == identity(old, "model")
    check_identity(new)  # the same run
    with pytest.raises(RunDirError, match="model.n_layers: 4 -> 3"):
        check_identity(load_config(None, ["model.attention=cudnn", "model.n_layers=3", f"train.run_dir={run}"]))


@pytest.mark.slow
def test_a_run_resumes_and_decodes_on_another_backend(tmp_path, capfd):
    """model.attention is runtime-only: a run started with one value resumes with another (a differing model
    key is still refused), and a checkpoint saved with a kernel this machine lacks decodes here."""
    from train_helpers import tiny_cfg

    from mtpjax.train.checkpoint import load_model
    from mtpjax.config import replace
    from mtpjax.decode import generate
    from mtpjax.train.rundir import RunDirError, check_identity
    from mtpjax.train.loop import train

    cfg = tiny_cfg(tmp_path, "model.attention=splash", "train.steps=2", "train.eval_batches=0", "data.seq_len=16",
                   "checkpoint.every=2")
    train(cfg)
    assert "model.attention=splash needs a TPU (this is cpu, float32); using xla" in capfd.readouterr().err
    resumed = train(replace(cfg, ["model.attention=xla", "train.steps=3"]))
    assert [s for s, _ in resumed["history"]] == [3]
    with pytest.raises(RunDirError, match="model.n_layers"):
        check_identity(replace(cfg, ["model.attention=xla", "model.n_layers=3"]))
    saved, model, _ = load_model(tmp_path / "run", step=2)
    assert saved.model.attention == "splash"
    out = generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=6, draft=1).tokens
    assert len(out[0]) == 6


def test_unknown_attention_is_refused_in_one_line():
    from mtpjax.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.attention=flash"])
    assert str(e.value) == ("config key 'model.attention' = 'flash' is invalid: expected one of auto, xla, cudnn, "
                            "pallas, splash")


def test_a_splash_kernel_first_built_under_a_trace_serves_later_programs():
    """The splash kernel is built once per shape and kept: built first while a program is traced (remat's, here),
    it holds no value of that trace, so the next program using it compiles (it leaked a tracer when its mask
    arrays were the trace's)."""
    kernels._splash_kernel.cache_clear()
    q, k, v = (jnp.ones(s, jnp.float32) for s in ((1, 37, 2, 1, 16), (1, 37, 2, 16), (1, 37, 2, 16)))
    seg = jnp.ones((1, 37), jnp.int32)
    f = lambda q, k, v: kernels.splash_attention(q, k, v, seg, interpret=True).sum()
    jax.make_jaxpr(jax.grad(jax.checkpoint(f)))(q, k, v)
    assert jax.jit(jax.grad(f))(q, k, v).shape == q.shape


@pytest.mark.parametrize("target, q, k", [
    ("__cudnn$fmhaSoftmax", "bf16[2,512,4,64]{3,2,1,0}", "bf16[2,256,4,64]{3,2,1,0}"),  # jax's BTNH: S is axis 1
    ("__gpu$xla.gpu.triton", "bf16[2,512,4,64]{3,2,1,0}", "bf16[2,256,4,64]{3,2,1,0}"),
    ("tpu_custom_call", "bf16[2,4,512,64]{3,2,1,0}", "bf16[2,4,256,64]{3,2,1,0}"),  # splash: [.., N, T, H]
])
def test_the_counter_reads_each_attention_kernel_s_keys_from_its_layout(target, q, k):
    """4·(query elements)·S for every kernel, S read where its layout puts the keys (256 of them; a forward call).
    Companion: read from axis -2 of cuDNN's operands, S would be its 4 heads."""
    from hlo_helpers import one_call

    from mtpjax.parallel import hlo

    call = one_call({"query": q, "key": k, "value": k}, q, target, 'metadata={op_name="jit(f)/attention"}')
    assert hlo.Program(call).stats().attention_flops == 4 * (2 * 512 * 4 * 64) * 256
