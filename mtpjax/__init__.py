"""mtpjax: multi-token-prediction pretraining in JAX/Flax NNX, with the MTP modules as a speculative decoder.

The packages are layers, listed in LAYERS from the bottom up; a module imports only from its own layer or
the ones below it (tests/test_imports.py holds this for module-level, function-level and TYPE_CHECKING
imports). A package's `__main__` is an entry point and counts as the command shell.

    errors    MtpjaxError, the base of every error a command reports as one line (with its exit status)
    checksum  the one content hash (xxh3-128) of checkpoints, exported safetensors and the data cache
    drafts    the one draft type (a tree whose nodes say their source) and its spelling (`auto`, `3`, `2x2+ngram3`)
    objective the objective's weights, each with its spelling and its value at a step: λ(step), λ per depth, targets
    config    the typed schema every layer reads its own section of
    nn        layers (the shape alphabet), model, kernels, loss, FLOPs, speculation arithmetic: pure, no I/O
    parallel  mesh and sharding rules, the multi-process runtime, compilation cache and profiler
    data      sources, tokenizers, mixtures, the global batch stream
    decode    the jitted loop and its state, proposers, samplers, caches, host API, streaming, calibration
    eval      held-out evaluation (validation metrics, bits per byte, forced acceptance, speed), the plan,
              the lm-eval backend and its shipped tasks
    train     TrainState and step, loop, eval hook, report, checkpoints, run directories, post-training
    convert   Hugging Face / engine layouts in and out
    cli       every command's main: train, decode, plan, compile, convert, data, distributed, lm_eval

The package itself imports nothing: `mtpjax.decode`, `mtpjax.load`, `mtpjax.generate` (and the other names of
API) load their modules on first use (PEP 562), so `import mtpjax` costs no JAX and a command's bad input is
answered before JAX loads. The Python API, with a runnable first example: docs/api.md.
"""

__version__ = "0.1.0"

LAYERS = ("errors", "checksum", "drafts", "objective", "config", "nn", "parallel", "data", "decode", "eval", "train",
          "convert", "cli")

# name -> (module, attribute or None for the module itself): what `mtpjax.NAME` loads on first use
API = {
    "load": ("mtpjax.train.pretrained", "load"),
    "Generator": ("mtpjax.decode.text", "Generator"),
    "TextResult": ("mtpjax.decode.text", "TextResult"),
    "generate": ("mtpjax.decode.api", "generate"),
    "load_model": ("mtpjax.train.checkpoint", "load_model"),
    "load_config": ("mtpjax.config", "load_config"),
    "MtpjaxError": ("mtpjax.errors", "MtpjaxError"),
    **{layer: (f"mtpjax.{layer}", None) for layer in LAYERS},
}


def __getattr__(name: str):
    """`mtpjax.NAME` of API, imported when first asked for (PEP 562) and kept in the package's namespace."""
    if name not in API:
        raise AttributeError(f"module 'mtpjax' has no attribute {name!r}")
    import importlib

    module, attr = API[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *API})  # a name loaded already is in both
