"""The grouped matmul's kernels (issue 47) against jax.lax.ragged_dot, in Pallas interpret mode: the forward and both
gradients, on groups that include empty experts and sizes off the tile; companions: a kernel that skips the last
group does not match."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hlo_helpers import one_call
from mtpjax.nn import gmm

# 8 groups over 150 of 160 rows: empty groups first, in the middle and last-but-one, sizes off every tile (Triton's
# row tile is 64, Mosaic's 256 here), the 10 rows past the total give zeros; K = 24 and N = 40: no tile divides them.
SIZES = [0, 37, 20, 0, 1, 65, 0, 27]
M, K, N = 160, 24, 40
KERNELS = [gmm.Kernel("triton", interpret=True), gmm.Kernel("megablox", interpret=True)]


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(SIZES), K, N)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)  # a loss whose gradient differs row by row
    return lhs, rhs, jnp.asarray(SIZES, jnp.int32), probe


def _value_and_grads(product, lhs, rhs, probe):
    f = lambda a, b: (product(a, b) * probe).sum()
    return product(lhs, rhs), *jax.grad(f, argnums=(0, 1))(lhs, rhs)


def _reference(operands):
    lhs, rhs, sizes, probe = operands
    return _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs, probe)


@pytest.mark.slow  # 10-20 s each in interpret mode on 2 cores: the issue adds nothing net to the default tier
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kernel_equals_ragged_dot_forward_and_both_gradients(operands, kernel):
    lhs, rhs, sizes, probe = operands
    got = _value_and_grads(lambda a, b: gmm.grouped_matmul(a, b, sizes, kernel), lhs, rhs, probe)
    for name, g, want in zip(("out", "d_lhs", "d_rhs"), got, _reference(operands)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=2e-5, rtol=2e-5, err_msg=name)
    assert not np.asarray(got[2])[[0, 3, 6]].any()  # empty experts: a zero weight gradient


def test_companion_triton_kernel_that_skips_the_last_group_fails(operands, monkeypatch):
    """Work items of the last group pointed at the sentinel (no rows): its rows are never written."""
    lhs, rhs, sizes, _ = operands
    real = gmm.work_items

    def skip_last(sizes_E, M, tm):
        g, t, start, end = real(sizes_E, M, tm)
        last = sizes_E.shape[0] - 1
        return jnp.where(g == last, last + 1, g), t, start, end

    monkeypatch.setattr(gmm, "work_items", skip_last)
    out = gmm.grouped_matmul(lhs, rhs, sizes, KERNELS[0])
    assert not np.allclose(np.asarray(out), np.asarray(_reference(operands)[0]), atol=1e-3)


def test_companion_megablox_kernel_that_skips_the_last_group_fails(operands):
    """megablox told of one group fewer (its expert-sharded form: rhs holds the first G-1) leaves the last out."""
    lhs, rhs, sizes, _ = operands
    mb = gmm.importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    out = mb.gmm(lhs, rhs[:-1], sizes, jnp.float32, (32, K, N), interpret=True)
    want = np.asarray(_reference(operands)[0])
    assert not np.allclose(np.asarray(out)[:150], want[:150], atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_tiles_from_the_shapes(kernel):
    """Triton's tiles are powers of two of at least 16 dividing K and N where one does; Mosaic's rows a multiple of
    128 (or every row), K and N whole up to 1024."""
    if kernel.name == "triton":
        assert gmm.tiles(kernel, 4096, 7168, 2048) == (64, 64, 128)
        assert gmm.tiles(kernel, 40, 24, 40) == (64, 16, 16)
    else:
        assert gmm.tiles(kernel, 4096, 7168, 2048) == (512, 1024, 1024)
        assert gmm.tiles(kernel, 40, 24, 40) == (128, 24, 40)


# ----------------------------------------------------------------------------- the MoE layer on the kernel path

@pytest.fixture(scope="module")
def moe_layer():
    """A tiny MoE layer (8 experts, top-3 of 2 groups of 4, a shared expert, a bias that changes choices) and 64
    tokens."""
    from mtpjax.config import load_config
    from mtpjax.nn.moe import MoE
    from mtpjax.nn.placement import host_placement

    overrides = ["model.mlp_kind=moe", "model.n_routed_experts=8", "model.num_experts_per_tok=3", "model.n_group=4",
                 "model.topk_group=2", "model.moe_d_ff=16", "model.n_shared_experts=1", "model.d_model=16",
                 "model.init_std=0.5", "model.routed_scaling_factor=2.0"]
    moe = MoE(load_config(None, overrides).model, nnx.Rngs(params=1), host_placement())
    moe.bias[...] = jnp.asarray(np.random.default_rng(2).normal(0, 0.3, 8), jnp.float32)
    rng = np.random.default_rng(3)
    return moe, jnp.asarray(rng.normal(size=(2, 32, 16)), jnp.float32), jnp.asarray(rng.normal(size=(2, 32, 16)),
                                                                                       jnp.float32)


def _loss_and_grads(moe, grouping, x, probe):
    moe.grouping = grouping

    def loss(m):
        y, aux = m(x)
        return (y * probe).sum() + aux["balance"]

    value, grads = nnx.value_and_grad(loss)(moe)
    return value, nnx.to_pure_dict(grads)


@pytest.mark.slow  # 10-35 s each in interpret mode on 2 cores
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_moe_layer_on_the_kernel_equals_today_s_layer(moe_layer, kernel):
    """Loss and every parameter's gradient through the kernel path (forced: this host's layer takes expert blocks)
    equal the expert blocks'; the router's gradient runs through the routed outputs' weights."""
    moe, x, probe = moe_layer
    want_loss, want = _loss_and_grads(moe, "blocks", x, probe)
    got_loss, got = _loss_and_grads(moe, kernel, x, probe)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = want
        for key in path:
            w = w[key.key]
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5, err_msg=str(path))
    assert np.abs(np.asarray(got["w_down"])).max() > 1e-3  # the routed experts' gradients are not trivially zero


# ----------------------------------------------------------------------------- the compile report's count

def _call(target: str, attrs: str) -> str:
    """A module whose one instruction is a grouped matmul's custom call: [256, 64] rows times [4, 64, 128] groups."""
    params = {"g": "s32[7]{0}", "a": "bf16[256,64]{1,0}", "b": "bf16[4,64,128]{2,1,0}"}
    return one_call(params, "bf16[256,128]{1,0}", target, attrs)


TRITON = ("__gpu$xla.gpu.triton", 'backend_config={grid_x = 11 : i32, name = "mtpjax_gmm", num_stages = 3 : i32}')
MEGABLOX = ("tpu_custom_call", 'metadata={op_name="jit(f)/transpose(jvp(jit(gmm)))/pallas_call"}, backend_config={}')


@pytest.mark.parametrize("call, kind", [(TRITON, "gmm (Pallas Triton)"), (MEGABLOX, "gmm (Mosaic megablox)")])
def test_the_counter_reads_a_grouped_kernel_from_its_shapes(call, kind):
    """2·rows·K·N, as grouped FLOPs, under the kernel's name; companion: the same call named otherwise is read as an
    attention kernel (the target alone does not tell), its grouped FLOPs zero."""
    from mtpjax.parallel import hlo

    stats = hlo.Program(_call(*call)).stats()
    assert stats.calls[kind] == 1 and stats.flops == stats.grouped_flops == 2 * 256 * 64 * 128
    other = hlo.Program(_call(call[0], call[1].replace("gmm", "mha"))).stats()
    assert other.grouped_flops == 0 and kind not in other.calls


def test_the_report_line_puts_routed_flops_beside_the_need():
    """The compile report's MoE line: the grouped kernels' FLOPs, what the tokens need, their ratio; a grouping the
    HLO cannot tell apart says so."""
    from mtpjax.nn.flops import routed_flops_per_token
    from mtpjax.train.aot import routed_line

    m = type("M", (), dict(mlp_kind="moe", num_experts_per_tok=8, d_model=7168, moe_d_ff=2048, n_layers=61,
                           first_k_dense_replace=3))
    assert routed_flops_per_token(m) == {"trunk": 58 * 8 * 3 * 2 * 7168 * 2048, "module": 8 * 3 * 2 * 7168 * 2048}
    line = routed_line({"flops": 3.0e12, "need": 2.0e12}, "gmm (Pallas Triton), all-to-all dispatch")
    assert line == "  routed expert matmuls 3T FLOPs (grouped kernels), the tokens need 2T (1.50x)"
    line = routed_line({"flops": 0.0, "need": 2.0e12}, "ragged_dot as dense dots (every ...), all-to-all dispatch")
    assert line.endswith("the tokens need 2T (not told apart from the other dots: ragged_dot as dense dots)")


def test_the_kernel_runs_where_the_program_is_per_device():
    """The platform's kernel on one device (and inside the expert-parallel shard_map); XLA's ragged_dot where XLA
    partitions the MoE over several devices (a Pallas call cannot be partitioned); the CPU's blocks anywhere."""
    from mtpjax.nn.moe import grouping_for, partitioned

    assert grouping_for("gpu") == gmm.Kernel("triton") and grouping_for("tpu") == gmm.Kernel("megablox")
    assert partitioned(grouping_for("tpu"), 1) == gmm.Kernel("megablox")
    assert partitioned(grouping_for("gpu"), 8) == "ragged"
    assert partitioned(grouping_for("cpu"), 8) == "blocks"
