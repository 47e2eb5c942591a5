"""Shared fixtures: small float32 models only (2 shared CPU cores); implicit rank promotion is an error.

Speed: one persistent compilation cache per session (tests compile the same tiny programs many times,
in this process and in the train.py / decode.py processes they start), and one trained run
(`tiny_run`) shared by the tests that only need a run directory.
"""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

from mtpjax.config import ModelConfig

# A [B,T,D] array meeting a [D] one must say how it broadcasts: silent rank promotion hides shape bugs.
jax.config.update("jax_numpy_rank_promotion", "raise")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # and in the train.py / decode.py / worker subprocesses

# Set before anything compiles (JAX reads it once); the environment carries it to subprocesses.
_XLA_CACHE = tempfile.mkdtemp(prefix="mtpjax-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
for _k, _v in {"jax_compilation_cache_dir": _XLA_CACHE, "jax_persistent_cache_min_compile_time_secs": 0,
               "jax_persistent_cache_min_entry_size_bytes": -1}.items():
    jax.config.update(_k, _v)
    os.environ[_k.upper()] = str(_v)

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, mtp_depth=2)
# The shared run: 7 steps, checkpoints every 2 keeping 3, so [4, 6, 7] (7: a run always saves its last step).
TINY_RUN = ["train.steps=7", "train.eval_batches=0", "train.eval_every=1000", "checkpoint.every=2",
            "checkpoint.keep=3", "checkpoint.async_save=false"]


@pytest.fixture
def model_cfg():
    """Factory: a tiny float32 ModelConfig; keyword arguments override its fields."""
    def make(**kw) -> ModelConfig:
        return ModelConfig(**{**SMALL, **kw})
    return make


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    """decode.py saves auto-draft calibrations under $MTPJAX_CACHE_DIR: a temporary one, not the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MTPJAX_CACHE_DIR", str(tmp_path_factory.mktemp("mtpjax_cache")))
        yield


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(cfg, run dir) of a trained tiny run with checkpoints 4, 6, 7; read-only: copy it before changing it."""
    from train_helpers import tiny_cfg

    from mtpjax.train_loop import train

    tmp = tmp_path_factory.mktemp("tiny_run")
    cfg = tiny_cfg(tmp, *TINY_RUN)
    train(cfg)
    return cfg, tmp / "run"
