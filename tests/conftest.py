"""Shared fixtures: small float32 models only (2 shared CPU cores)."""

import pytest

from mtpjax.config import ModelConfig

SMALL = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, mtp_depth=2)


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
