"""mtpjax: multi-token-prediction pretraining in JAX/Flax NNX, with the MTP modules as a speculative decoder.

The packages are layers, listed in LAYERS from the bottom up; a module imports only from its own layer or
the ones below it (tests/test_imports.py holds this for module-level, function-level and TYPE_CHECKING
imports). A package's `__main__` is an entry point and counts as the command shell.

    errors    MtpjaxError, the base of every error a command reports as one line (with its exit status)
    config    the typed schema every layer reads its own section of
    nn        layers (the shape alphabet), model, kernels, loss, FLOPs, speculation arithmetic: pure, no I/O
    parallel  mesh and sharding rules, the multi-process runtime, compilation cache and profiler
    data      sources, tokenizers, mixtures, the global batch stream
    decode    the jitted loop and its state, proposers, samplers, caches, host API, streaming, calibration
    eval      held-out evaluation (validation metrics, bits per byte, forced acceptance, speed), the plan
    train     TrainState and step, loop, eval hook, report, checkpoints, run directories, post-training
    convert   Hugging Face / engine layouts in and out
    cli       every command's main: train, decode, plan, compile, convert, data, distributed
"""

__version__ = "0.1.0"

LAYERS = ("errors", "config", "nn", "parallel", "data", "decode", "eval", "train", "convert", "cli")
