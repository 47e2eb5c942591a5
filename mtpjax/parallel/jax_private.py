"""The JAX internal mtpjax calls with no public equivalent, in one place: `tests/test_private_apis.py` fails, naming
the upgrade, when a JAX release moves it (jax._src is not a public API). Written against jax WRITTEN_AGAINST.

    register_pjrt_plugins  jax._src.xla_bridge._discover_and_register_pjrt_plugins: load the installed PJRT plugins
                           (the CUDA one) now, as the first backend would, without starting a backend
"""

from __future__ import annotations

import importlib

WRITTEN_AGAINST = "0.10.2"  # pyproject.toml pins jax to it
USED = {"register_pjrt_plugins": ("jax._src.xla_bridge", "_discover_and_register_pjrt_plugins")}


def register_pjrt_plugins() -> None:
    """Load the installed PJRT plugins as the first backend would; starts none."""
    module, name = USED["register_pjrt_plugins"]
    getattr(importlib.import_module(module), name)()


def moved() -> list[str]:
    """One line per internal used here that this JAX no longer has where mtpjax calls it (empty: all present)."""
    import jax

    out = []
    for use, (module, name) in USED.items():
        try:
            found = callable(getattr(importlib.import_module(module), name, None))
        except ImportError:
            found = False
        if not found:
            out.append(f"jax {jax.__version__} (mtpjax was written against {WRITTEN_AGAINST}) has no {module}.{name}, "
                       f"which mtpjax.parallel.jax_private.{use} calls: find its new home in that release")
    return out
