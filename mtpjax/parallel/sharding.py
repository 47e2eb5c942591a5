"""Mesh, logical-axis rules and the NamedShardings of model/optimizer state and batches (docs/design.md §3)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax.config import MeshConfig
from mtpjax.errors import MtpjaxError
from mtpjax.nn.kernels import note
from mtpjax.nn.placement import Placement, platform_of

AXES = ("data", "fsdp", "expert", "tensor")
# Pipeline stages: the outermost mesh axis (stages talk least: one activation per micro-batch), present only when
# mesh.stage > 1, so a run without stages has the four axes it always had.
STAGE = "stage"
# The expert axis splits the batch too: outside the MoE layers its devices are data-parallel (DeepSeek-V3's EP).
BATCH_AXES = ("data", "fsdp", "expert")

# One table maps every logical axis name onto a mesh axis (None: replicated).
LOGICAL_RULES: dict[str | None, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",  # routed experts' weights [E, ...]
    "layers": STAGE,  # a scanned trunk's stacked blocks: each stage holds its own (absent axis: replicated)
    "latent": None,  # MLA's query/key-value latents: small, replicated; their heads-side projections split heads
    None: None,
}

# Activations' logical axes onto mesh axes (Placement.constrain applies them at the layers' boundaries): every
# activation keeps its batch rows split as the batch arrives, heads, MLP columns and the vocabulary split over
# `tensor` as their weights are; the model dimension stays whole (its weights' fsdp shards are gathered, as FSDP does).
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "length": (),
    "embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}


class MeshError(MtpjaxError, ValueError):
    """The mesh shape does not fit the devices; the message names the numbers and the fix."""


def named_axes(axes: Sequence[str], shape: dict) -> list[str]:
    """The axes a message names: `expert` only when it is used (> 1), so a dense run never hears of it."""
    return [a for a in axes if a != "expert" or shape[a] > 1]


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh ('data','fsdp','expert','tensor') from cfg.mesh over `devices` (default: all); raises MeshError."""
    devices = list(jax.devices() if devices is None else devices)
    axes = mesh_axes(mesh_cfg)
    shape = tuple(getattr(mesh_cfg, a) for a in axes)
    n = int(np.prod(shape))
    if n != len(devices):
        names = named_axes(axes, dict(zip(axes, shape)))
        raise MeshError(
            f"mesh {'*'.join(names)} = {'*'.join(str(getattr(mesh_cfg, a)) for a in names)} = {n} but "
            f"{len(devices)} device(s) are available; set {'/'.join('mesh.' + a for a in names)} so their product "
            f"is {len(devices)}")
    types = (jax.sharding.AxisType.Auto,) * len(axes)
    try:  # each logical axis on whole physical axes of the slice's torus, where its sizes allow
        return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
    except NotImplementedError:  # e.g. 4 x 8 x 4 x 4 on a v5p-1024's 8 x 8 x 8: an axis of 4 splits a physical one
        note(f"the mesh {'x'.join(map(str, shape))} does not lay out on whole physical axes of these "
             f"{len(devices)} devices; some of its axes split one (their collectives share its links)", "mesh")
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, axes, axis_types=types)


def mesh_axes(mesh_cfg: MeshConfig) -> tuple[str, ...]:
    """The mesh's axis names: AXES, after `stage` when mesh.stage > 1."""
    return ((STAGE,) if mesh_cfg.stage > 1 else ()) + AXES


def stages(mesh: Mesh) -> int:
    """Pipeline stages of a mesh (1 without a stage axis)."""
    return dict(mesh.shape).get(STAGE, 1)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for an array with these logical axes; a dim its mesh axis doesn't divide is replicated."""
    axes = tuple(axes)
    if len(axes) == len(shape) - 1:
        axes = ("layers",) + axes  # scanned stack: the leading axis is not named in the metadata
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    spec, taken = [], set()
    for name, dim in zip(axes, shape):
        if name not in LOGICAL_RULES:
            raise ValueError(f"logical axis '{name}' has no sharding rule; add it to LOGICAL_RULES")
        mesh_axis = LOGICAL_RULES[name]
        ok = mesh_axis in mesh.shape and mesh_axis not in taken and dim % mesh.shape[mesh_axis] == 0
        spec.append(mesh_axis if ok else None)
        if ok:
            taken.add(mesh_axis)
    return P(*spec)


def _var_sharding(var, mesh: Mesh):
    if not isinstance(var, nnx.Variable):  # step counter, RNG key, optimizer counts: replicated
        return NamedSharding(mesh, P())
    axes = var.get_metadata().get("logical_axes")
    shape = np.shape(var.get_value())  # get_value(): var[...] cannot index an abstract ShapeDtypeStruct
    spec = P() if axes is None else logical_to_spec(axes, shape, mesh)
    return var.replace(NamedSharding(mesh, spec))


def state_shardings(state, mesh: Mesh):
    """NamedShardings mirroring a pytree of nnx Variables and arrays (or ShapeDtypeStructs).

    Variables shard by their logical axes (Adam moments carry their parameter's); other leaves are replicated.
    """
    return jax.tree.map(lambda v: _var_sharding(v, mesh), state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch arrays [B, ...]: the batch axis over ('data','fsdp','expert'), the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def micro_batches_of(x_BT, parts: int):
    """[parts, B/parts, T]: micro-batch a holds rows a, a+parts, ... so every device keeps its own rows (no
    resharding)."""
    B, T = x_BT.shape
    return x_BT.reshape(B // parts, parts, T).swapaxes(0, 1)


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding (scalars, RNG keys)."""
    return NamedSharding(mesh, P())


def data_parallelism(mesh: Mesh) -> int:
    """Number of batch shards: mesh.data * mesh.fsdp * mesh.expert."""
    return mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]


def placement(mesh: Mesh, stage_layers: tuple[int, ...] = (), stage_repeats: int = 1) -> Placement:
    """What a model built for `mesh` is told: its devices' platform, the batch axes, heads over `tensor`, routed
    experts over `expert` (expert-parallel when that axis has more than one device), the stages' blocks."""
    return Placement(platform=platform_of(mesh.devices.flat[0]), mesh=mesh, batch_axes=BATCH_AXES,
                     head_axis="tensor", expert_axis="expert", activation_rules=tuple(ACTIVATION_RULES.items()),
                     stage_axis=STAGE if stages(mesh) > 1 else None,
                     stage_layers=tuple(stage_layers) if stages(mesh) > 1 else (),
                     stage_repeats=stage_repeats if stages(mesh) > 1 else 1)


def run_placement(mesh_cfg: MeshConfig, mesh: Mesh) -> Placement:
    """A run's model on `mesh`: with its pipeline schedule (mesh.stage_layers, mesh.stage_repeats) where the mesh has
    the run's stage count; on another count, split evenly."""
    same = stages(mesh) == mesh_cfg.stage
    return placement(mesh, mesh_cfg.stage_layers if same else (), mesh_cfg.stage_repeats if same else 1)
