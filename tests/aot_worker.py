"""`python -m mtpjax compile` with one property broken on purpose: the companions of tests/test_aot.py.

    python tests/aot_worker.py PATCH [compile arguments...]

PATCH: none; host_kernel (attention chosen from the host's backend, as before the mesh chose it); no_shard_map (the
fused kernels called on the global arrays, left to the compiler to partition); one_chip_decode (the decode loops
compiled on one device of the target, as before decoding on the mesh); several joined by `+`.
"""

import sys

from mtpjax.parallel.targets import prepare_environment

prepare_environment("cpu")


def main(argv: list[str]) -> int:
    patches, args = argv[0].split("+"), argv[1:]
    for patch in patches:
        apply(patch)
    from mtpjax.cli.compile import main as compile_main

    return compile_main(args)


def apply(patch: str) -> None:
    if patch == "host_kernel":
        import dataclasses

        import jax

        from mtpjax.parallel import sharding

        real = sharding.placement
        sharding.placement = lambda mesh, *a: dataclasses.replace(real(mesh, *a), platform=jax.default_backend())
    elif patch == "no_shard_map":
        from mtpjax.nn import kernels

        kernels.per_device = lambda kernel, placement, q, k, v, seg: kernel(q, k, v, seg)
    elif patch == "one_chip_decode":
        import numpy as np
        from jax.sharding import Mesh

        from mtpjax.train import aot

        real_decode = aot.decode_programs
        one = lambda mesh: Mesh(np.array(mesh.devices.flat[:1]).reshape((1,) * mesh.devices.ndim), mesh.axis_names)
        aot.decode_programs = lambda cfg, mesh, *a: real_decode(cfg, one(mesh), *a)
    elif patch == "xla_ragged_dot":  # the MoE's grouped matmuls as XLA's ragged_dot, as before issue 47's kernels
        from mtpjax.nn import moe

        moe.grouping_for = lambda platform: "ragged" if platform in ("gpu", "tpu") else "blocks"
    elif patch != "none":
        raise SystemExit(f"unknown patch {patch!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
