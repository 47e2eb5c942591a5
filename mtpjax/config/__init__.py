"""One config schema: frozen pydantic models loaded from YAML plus dotted overrides, validated early.

    errors     ConfigError, the one-line message form, pydantic's errors read into it
    types      the value types: YAML scalars as written, and the values parsed from one string (the λ schedule, the
               MTP target mix, the per-depth λ, the profile window; decode.draft, read by mtpjax.drafts)
    schema     the sections: each key's type, bounds, doc and choices as its `Field`
    validate   the rules that tie fields together
    load       YAML and dotted overrides
    reference  the configuration page, generated from the fields
"""

from mtpjax.config.errors import ConfigError
from mtpjax.config.load import from_dict, load_config, replace
from mtpjax.config.schema import (
    RUNTIME_KEYS, CheckpointConfig, Config, DataConfig, DecodeConfig, LossConfig, MeshConfig, MixtureSource,
    ModelConfig, OptimConfig, TrainConfig, choices, field_doc, identity)
from mtpjax.config.types import DepthLambdas, LambdaSchedule, TargetMix, parse_profile

__all__ = [
    "RUNTIME_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DecodeConfig", "DepthLambdas",
    "LambdaSchedule", "LossConfig", "MeshConfig", "MixtureSource", "ModelConfig", "OptimConfig", "TargetMix",
    "TrainConfig", "choices", "field_doc", "from_dict", "identity", "load_config", "parse_profile", "replace",
]
