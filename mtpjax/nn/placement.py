"""Where a model's programs run, told to every module when it is built: the devices' platform and the mesh axes.

A module learns its context here and nowhere else (docs/design.md §3): the attention kernel is chosen by the
platform of the devices the program is compiled for (a TPU mesh compiled ahead of time on a CPU host gets splash),
the mixture of experts runs expert-parallel when the mesh has an expert axis, and fused kernels wrap themselves in
`shard_map` over the batch and head axes, and every layer keeps its activations where the mesh wants them
(`Placement.constrain`: batch rows over the batch axes, heads and MLP columns over the tensor axis, by the activation
rules of mtpjax.parallel.sharding). No layer above sets attributes on a built module; a model wanted under
another placement is rebuilt (`nn.model.placed`), which keeps its state and changes only its static graph.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Device platforms as the kernels know them: CUDA and ROCm devices are both "gpu".
_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


def platform_of(device) -> str:
    """A device's platform: "cpu", "gpu" or "tpu"."""
    return _PLATFORMS.get(device.platform, device.platform)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The platform and mesh a model is compiled for; `mesh=None` is one device of `platform`."""

    platform: str = "cpu"
    mesh: Mesh | None = None
    batch_axes: tuple[str, ...] = ()  # mesh axes the batch rows are split over
    head_axis: str | None = None  # mesh axis attention heads (and MLP columns) are split over
    expert_axis: str | None = None  # mesh axis the routed experts are split over
    # (logical activation axis, the mesh axes it splits over) pairs: parallel.sharding.ACTIVATION_RULES on a mesh;
    # empty, no activation is constrained
    activation_rules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    stage_axis: str | None = None  # mesh axis a scanned trunk's blocks are split over (pipeline stages)
    stage_layers: tuple[int, ...] = ()  # the trunk's blocks each stage runs (mesh.stage_layers); empty: even
    stage_repeats: int = 1  # the chunks of blocks each stage runs in turn (mesh.stage_repeats): a circular pipeline

    def size(self, axis: str | tuple[str, ...] | None) -> int:
        """Devices along a mesh axis (or a tuple of axes); 1 off a mesh or for None."""
        if self.mesh is None or not axis:
            return 1
        return math.prod(self.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))

    def leading(self, axes: tuple[str, ...], dim: int, used: set | frozenset = frozenset()) -> list[str]:
        """The leading mesh axes of `axes`, none of them `used`, whose product divides `dim`: what splits it."""
        taken, n = [], 1
        for a in axes if self.mesh is not None else ():
            if a in used or dim % (n * self.mesh.shape[a]):
                break
            taken.append(a)
            n *= self.mesh.shape[a]
        return taken

    def rows_axes(self, B: int) -> tuple[str, ...]:
        """The batch axes a kernel's shard_map splits B rows over: those an activation's batch dimension takes."""
        return tuple(self.leading(self.batch_axes, B))

    def spec(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
        """PartitionSpec of an activation with these logical axes (None: whole); each dim takes the leading mesh axes
        of its rule whose product divides it, an axis used once."""
        rules, used, spec = dict(self.activation_rules), set(), []
        if len(axes) != len(shape):
            raise ValueError(f"activation axes {axes} do not match shape {tuple(shape)}")
        for name, dim in zip(axes, shape):
            if name is not None and name not in rules:
                raise ValueError(f"activation axis '{name}' has no rule; add it to parallel.sharding.ACTIVATION_RULES")
            taken = self.leading(rules.get(name, ()), dim, used)
            used.update(taken)
            spec.append(tuple(taken) if len(taken) > 1 else (taken[0] if taken else None))
        return PartitionSpec(*spec)

    def constrain(self, x, *axes: str | None):
        """x held as its logical activation axes say (jax.lax.with_sharding_constraint), so the compiler gathers
        weights rather than splitting a contraction across the batch; unchanged off a multi-device mesh."""
        if not self.activation_rules or self.mesh is None or self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(axes, x.shape)))


def host_placement() -> Placement:
    """One device of this process's default backend: what a model built without a mesh runs on."""
    return Placement(platform=platform_of(jax.devices()[0]))
