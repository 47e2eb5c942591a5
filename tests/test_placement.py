"""A module is told where it runs when it is built (nn/placement.py), never by a layer above setting attributes."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from conftest import SMALL
from mtpjax.config import ModelConfig
from mtpjax.nn import gmm, kernels, layers, mla
from mtpjax.nn.model import build_model, moe_layers, placed
from mtpjax.nn.placement import Placement, host_placement, platform_of
from mtpjax.parallel.sharding import AXES, BATCH_AXES

MOE = dict(SMALL, mlp_kind="moe", n_routed_experts=4, num_experts_per_tok=2, moe_d_ff=16, n_group=1, topk_group=1)
MLA = dict(SMALL, attention_kind="mla", kv_lora_rank=8, q_lora_rank=0, qk_nope_head_dim=4, qk_rope_head_dim=4,
           v_head_dim=8)


def _attentions(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, (layers.Attention, mla.MLAttention))]


def test_the_kernel_follows_the_placement_not_the_host():
    """A model built for TPU devices on this CPU host picks splash (bf16), one built for this host XLA; the MoE's
    grouping follows the same platform."""
    cfg = ModelConfig(**MOE, dtype="bfloat16")
    tpu = nnx.eval_shape(lambda: build_model(cfg, placement=Placement(platform="tpu")))
    host = nnx.eval_shape(lambda: build_model(cfg))
    pick = lambda m: kernels.attention_backend("auto", m.placement.platform, "bfloat16", 8, False)[0]
    assert {pick(a) for a in _attentions(tpu)} == {"splash"}
    assert {pick(a) for a in _attentions(host)} == {"xla"}
    assert {m.grouping for m in moe_layers(tpu).values()} == {gmm.Kernel("megablox")}  # issue 47: Mosaic's gmm
    assert {m.grouping for m in moe_layers(host).values()} == {"blocks"}
    assert host.placement == host_placement() and platform_of(jax.devices()[0]) == "cpu"


def test_expert_parallelism_is_told_at_construction():
    """A placement whose mesh splits experts builds MoE layers that run expert-parallel; a placement whose expert axis
    has one device, or none, builds them without (the companion)."""
    cfg = ModelConfig(**MOE)

    def eps(expert: int, axis="expert"):
        mesh = AbstractMesh((1, 1, expert, 1), AXES)
        p = Placement(mesh=mesh, batch_axes=BATCH_AXES, head_axis="tensor", expert_axis=axis)
        return [m.ep for m in moe_layers(nnx.eval_shape(lambda: build_model(cfg, placement=p))).values()]

    assert all(ep is not None and ep.mesh.shape["expert"] == 2 for ep in eps(2))
    assert all(ep is None for ep in eps(1) + eps(2, axis=None))


def test_a_batch_that_does_not_split_runs_the_experts_unsharded_and_says_so(capsys, monkeypatch):
    """Rows that do not divide over the batch shards take the unsharded path with one `moe:` line (once); rows that
    divide take the expert-parallel path and say nothing."""
    from mtpjax.nn import kernels
    from mtpjax.nn.moe import ExpertParallel

    monkeypatch.setattr(kernels, "_NOTED", set())
    ep = ExpertParallel(mesh=AbstractMesh((1, 2, 2, 1), AXES), batch_axes=BATCH_AXES)
    assert ep.applies(8) and capsys.readouterr().err == ""
    assert not ep.applies(2) and not ep.applies(2)
    err = capsys.readouterr().err.splitlines()
    assert err == ["moe: a batch of 2 rows does not split over the 4 batch shards (data*fsdp*expert); the routed "
                   "experts run unsharded, their weights gathered to every device (a batch that is a multiple of 4 "
                   "keeps them on their shards)"]


def test_placed_keeps_the_state_and_changes_the_graph():
    """placed() rebuilds the static graph for another placement around the very same arrays."""
    model = build_model(ModelConfig(**SMALL), seed=0)
    other = placed(model, Placement(platform="tpu"))
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(other))))
    assert other.placement.platform == "tpu" and model.placement.platform == "cpu"
    assert {a.placement.platform for a in _attentions(other)} == {"tpu"}


def test_decode_view_lays_mla_out_on_a_copy():
    """decode_view gives the copy's MLA layers kv_b per head and leaves the model itself as it was; the view's
    up-projections are the model's own, laid out."""
    model = build_model(ModelConfig(**MLA), seed=0)
    view = mla.decode_view(model)
    for a, v in zip(_attentions(model), _attentions(view)):
        assert a.layout is None and v.layout is not None
        for x, y in zip(a.up_projections(), v.up_projections()):
            np.testing.assert_array_equal(x, y)
    assert nnx.graphdef(model) == nnx.graphdef(build_model(ModelConfig(**MLA), seed=1))
    x = jnp.ones((1, 3, SMALL["d_model"]))
    pos = jnp.arange(3)[None]
    cache = mla.mla_cache(ModelConfig(**MLA), 1, 8)
    a, v = _attentions(model)[0], _attentions(view)[0]
    np.testing.assert_array_equal(a(x, pos, None, cache)[0], v(x, pos, None, cache)[0])


def test_a_kernel_splits_rows_as_the_activations_batch_dimension_is_split():
    """rows_axes (a fused kernel's shard_map) and the activation constraints split B rows alike, for every B: on fsdp
    4 x expert 2, two rows split over no batch axis rather than over `expert` alone (which would reshard the
    kernel's input around every call)."""
    from mtpjax.parallel.sharding import ACTIVATION_RULES

    pl = Placement(mesh=AbstractMesh((1, 4, 2, 1), AXES), batch_axes=BATCH_AXES,
                   activation_rules=tuple(ACTIVATION_RULES.items()))
    for B in range(1, 17):
        spec = pl.spec(("batch",), (B,))[0]
        assert pl.rows_axes(B) == ((spec,) if isinstance(spec, str) else tuple(spec or ())), B
    assert pl.rows_axes(2) == ("data",) and pl.rows_axes(8) == ("data", "fsdp", "expert")
