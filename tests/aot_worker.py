"""`python -m mtpjax compile` with one property broken on purpose: the companions of tests/test_aot.py.

    python tests/aot_worker.py PATCH [compile arguments...]

PATCH: none; host_kernel (attention chosen from the host's backend, as before the mesh chose it); no_shard_map (the
fused kernels called on the global arrays, left to the compiler to partition).
"""

import sys

from mtpjax.parallel.targets import prepare_environment

prepare_environment("cpu")


def main(argv: list[str]) -> int:
    patch, args = argv[0], argv[1:]
    if patch == "host_kernel":
        import dataclasses

        import jax

        from mtpjax.parallel import sharding

        real = sharding.placement
        sharding.placement = lambda mesh: dataclasses.replace(real(mesh), platform=jax.default_backend())
    elif patch == "no_shard_map":
        from mtpjax.nn import kernels

        kernels.per_device = lambda kernel, mesh, batch_axes, head_axis, q, k, v, seg: kernel(q, k, v, seg)
    elif patch != "none":
        raise SystemExit(f"unknown patch {patch!r}")
    from mtpjax.cli.compile import main as compile_main

    return compile_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
