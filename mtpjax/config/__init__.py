"""One config schema: frozen dataclasses loaded from YAML plus dotted overrides, validated early.

    errors     ConfigError, the one-line message form
    specs      values written as one string and parsed once (the λ schedule, the MTP target mix, the profile window,
               decode.draft's wrapper of mtpjax.drafts)
    schema     the sections: Literal choices, bounds and each key's doc as field metadata
    validate   the one generic validator plus the rules that tie fields together
    load       YAML, dotted overrides, coercion to the field types
    reference  the configuration page, generated from the metadata
"""

from mtpjax.config.errors import ConfigError
from mtpjax.config.load import from_dict, load_config, replace
from mtpjax.config.schema import (
    RUNTIME_KEYS,
    CheckpointConfig,
    Config,
    DataConfig,
    DecodeConfig,
    LossConfig,
    MeshConfig,
    MixtureSource,
    ModelConfig,
    OptimConfig,
    Proposer,
    TrainConfig,
    choices,
    field_doc,
    identity,
)
from mtpjax.config.specs import MTP_TARGETS, DepthLambdas, LambdaSchedule, TargetMix, parse_profile
from mtpjax.config.validate import validate

__all__ = [
    "RUNTIME_KEYS", "MTP_TARGETS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DecodeConfig",
    "DepthLambdas", "LambdaSchedule", "LossConfig", "MeshConfig", "MixtureSource", "ModelConfig", "OptimConfig",
    "Proposer", "TargetMix", "TrainConfig", "choices", "field_doc", "from_dict", "identity", "load_config",
    "parse_profile", "replace", "validate",
]
