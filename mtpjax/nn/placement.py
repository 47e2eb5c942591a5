"""Where a model's programs run, told to every module when it is built: the devices' platform and the mesh axes.

A module learns its context here and nowhere else (docs/design.md §3): the attention kernel is chosen by the
platform of the devices the program is compiled for (a TPU mesh compiled ahead of time on a CPU host gets splash),
the mixture of experts runs expert-parallel when the mesh has an expert axis, and fused kernels wrap themselves in
`shard_map` over the batch and head axes. No layer above sets attributes on a built module; a model wanted under
another placement is rebuilt (`nn.model.placed`), which keeps its state and changes only its static graph.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh

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
    stage_axis: str | None = None  # mesh axis a scanned trunk's blocks are split over (pipeline stages)

    def size(self, axis: str | tuple[str, ...] | None) -> int:
        """Devices along a mesh axis (or a tuple of axes); 1 off a mesh or for None."""
        if self.mesh is None or not axis:
            return 1
        return math.prod(self.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def host_placement() -> Placement:
    """One device of this process's default backend: what a model built without a mesh runs on."""
    return Placement(platform=platform_of(jax.devices()[0]))
