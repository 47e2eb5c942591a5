"""Decoding on the mesh a model was trained on (docs/design.md §3, §6): what runs where inside the one jitted loop.

The parameters keep their training shardings (parallel.sharding's logical rules: heads, MLP and vocabulary over
`tensor`, routed experts over `expert`), the batch rows split over the data axes, and every cache is sharded like
the projection that writes it. A GQA cache splits its kv heads over `tensor`, as wk and wv split theirs, so each
device's attention reads only its own heads' entries. MLA's latent cache has no head axis: every head reads all of
it, so it is replicated over `tensor` (it is small, which is MLA's point; splitting its latent or its positions
would put a collective into every attention) and split by batch rows like everything else. A dimension its mesh
axis does not divide (kv heads < tensor, batch < data) is replicated instead, said in one logged line.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax.config import MeshConfig, ModelConfig, replace
from mtpjax.nn.layers import KV
from mtpjax.nn.mla import MLACache
from mtpjax.nn.model import MTPTransformer, placed
from mtpjax.nn.placement import Placement
from mtpjax.parallel.sharding import MeshError, mesh_axes, placement, state_shardings

log = logging.getLogger("mtpjax.decode")
# A staged run's mesh.stage_layers / stage_repeats describe its training schedule; left in, they would refuse the
# mesh.stage=1 a decode on fewer devices needs (and that the one-device note suggests).
NO_SCHEDULE = ("mesh.stage_layers=[]", "mesh.stage_repeats=1")


def check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
    """MeshError for a mesh axis this model cannot use for decoding (the message names the fix)."""
    t, e = mesh.shape["tensor"], mesh.shape["expert"]
    if e > 1 and cfg.mlp_kind != "moe":
        raise MeshError(f"mesh.expert={e} splits routed experts, but this model has none (model.mlp_kind="
                        f"{cfg.mlp_kind}); set mesh.expert=1 (mesh.data splits the batch)")
    if t > 1 and cfg.n_heads % t:
        raise MeshError(f"mesh.tensor={t} does not divide the model's {cfg.n_heads} attention heads; use a "
                        f"divisor of {cfg.n_heads}")


def mesh_config(saved, overrides: list[str]):
    """The run's config with the command's mesh overrides; an override of mesh.stage to another count drops the run's
    pipeline schedule (mesh.stage_layers, mesh.stage_repeats: how it trained), which would refuse the new count."""
    stage = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "mesh.stage"]
    moved = bool(stage) and stage[-1] != str(saved.mesh.stage)
    return replace(saved, [*NO_SCHEDULE, *overrides] if moved else overrides)


def fallback_note(cfg: ModelConfig, mesh: MeshConfig, devices: int, why: str) -> str | None:
    """The line decode.py logs when a run's own mesh cannot decode here and it decodes on one device instead, naming
    the overrides that choose a mesh (None: the run's mesh is one device, where it decodes anyway)."""
    shape = {a: getattr(mesh, a) for a in mesh_axes(mesh)}
    need = math.prod(shape.values())
    if need == 1:
        return None
    want = dict.fromkeys(shape, 1)
    if devices > 1:  # all the devices: heads split over tensor where they divide, else rows over data
        want["tensor" if cfg.n_heads % devices == 0 else "data"] = devices
    fix = " ".join(f"mesh.{a}={n}" for a, n in want.items() if n != shape[a])
    axes = " ".join(f"{a}={n}" for a, n in shape.items())
    why = (f"needs {need} devices and {devices} {'is' if devices == 1 else 'are'} here" if need != devices
           else f"does not suit this model ({why})")
    return (f"decode.py: the run's mesh {axes} {why}; decoding on one device (pass {fix} to decode "
            f"{'on one device' if devices == 1 else f'over all {devices}'})")


def on_mesh(model: MTPTransformer, mesh: Mesh) -> MTPTransformer:
    """`model` rebuilt for `mesh` with every parameter moved into its training sharding (a model built in this process;
    a saved run restores straight into them: train.checkpoint.load_model(mesh=...))."""
    model = placed(model, placement(mesh))
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(jax.device_put, state, state_shardings(state, mesh)))
    return model


@functools.cache
def _note(message: str) -> None:
    log.warning(message)  # once per process: a program is traced more than once


def _on(placement: Placement) -> bool:
    return placement.mesh is not None and placement.mesh.size > 1


def _split(placement: Placement, axes, dim: int, why: str):
    """`axes` if they split `dim` evenly, None (replicated, `why` logged once) if not or if they are one device."""
    n = placement.size(axes)
    if n > 1 and dim % n:
        _note(why.format(n=n))
    return axes if n > 1 and dim % n == 0 else None


def batch_axes(placement: Placement, batch: int) -> tuple[str, ...] | None:
    """The mesh axes a batch of `batch` rows splits over, None (replicated) where they do not divide it."""
    return _split(placement, placement.batch_axes, batch,
                  f"decode: a batch of {batch} rows does not split over the {{n}} devices of the mesh's data axes "
                  f"{'*'.join(placement.batch_axes)}; its rows are replicated (give a multiple of {{n}} prompts to "
                  "split them)")


def head_axis(placement: Placement, heads: int) -> str | None:
    """The mesh axis a cache's `heads` kv heads split over, None (replicated) where it does not divide them."""
    return _split(placement, placement.head_axis, heads,
                  f"decode: the {heads} kv head(s) of a cache do not split over mesh.{placement.head_axis}={{n}}; that "
                  f"cache is replicated over {placement.head_axis}")


def specs(placement: Placement, tree, batch: int):
    """PartitionSpecs of a pytree of decode state: caches as their producers, [B, ...] arrays by rows, the rest
    replicated."""
    rows = batch_axes(placement, batch)

    def spec(x):
        if isinstance(x, KV):  # [..., B, K, S, H]
            lead = (None,) * (x.k_BKSH.ndim - 4)
            return KV(*(P(*lead, rows, head_axis(placement, x.k_BKSH.shape[-3]), None, None),) * 2)
        if isinstance(x, MLACache):  # [..., B, S, ·]: no head axis, replicated over tensor
            return MLACache(*(P(*(None,) * (a.ndim - 3), rows, None, None) for a in x))
        if getattr(x, "ndim", 0) >= 1 and x.shape[0] == batch and not jax.dtypes.issubdtype(x.dtype,
                                                                                              jax.dtypes.prng_key):
            return P(rows, *(None,) * (x.ndim - 1))
        return P()

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, (KV, MLACache)))


def lay_out(placement: Placement, tree, batch: int):
    """`tree` constrained to specs' layout inside a jitted program (unchanged off a mesh)."""
    if not _on(placement):
        return tree
    mesh = placement.mesh
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree,
                        specs(placement, tree, batch), is_leaf=lambda x: isinstance(x, P))


def put(placement: Placement, tree, batch: int):
    """Host inputs (a request) placed on the mesh by specs' layout (unchanged off a mesh)."""
    if not _on(placement):
        return tree
    mesh = placement.mesh
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs(placement, tree, batch),
                        is_leaf=lambda x: isinstance(x, P))


def describe(mesh: Mesh | None) -> str:
    """The mesh as a banner names it: `data=1 fsdp=1 expert=1 tensor=2 (2 cpu devices)`."""
    if mesh is None:
        return "one device"
    axes = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
    return f"{axes} ({mesh.size} {mesh.devices.flat[0].platform} device{'s' * (mesh.size > 1)})"
