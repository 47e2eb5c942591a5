"""One config schema: frozen pydantic models loaded from YAML plus dotted overrides, validated early.

    errors     ConfigError, the one-line message form, pydantic's errors read into it
    types      the value types: YAML scalars as written, values parsed from one string by their home (the λ schedule,
               the per-depth λ and the MTP target mix by mtpjax.objective, decode.draft by mtpjax.drafts), the
               profile window
    schema     the sections: each key's type, bounds, doc and choices as its `Field`
    validate   the rules that tie fields together
    load       YAML and dotted overrides
    reference  the configuration page, generated from the fields
"""

from mtpjax.config.errors import ConfigError
from mtpjax.config.load import from_dict, load_config, replace
from mtpjax.config.schema import (
    KEYS, RUNTIME_KEYS, CheckpointConfig, Config, DataConfig, DecodeConfig, LossConfig, MeshConfig, MixtureSource,
    ModelConfig, OptimConfig, TrainConfig, choices, identity)
from mtpjax.config.types import parse_profile

__all__ = [
    "KEYS", "RUNTIME_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DecodeConfig", "LossConfig",
    "MeshConfig", "MixtureSource", "ModelConfig", "OptimConfig", "TrainConfig", "choices", "from_dict",
    "identity", "load_config", "parse_profile", "replace",
]
