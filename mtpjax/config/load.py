"""Reading a config: YAML plus dotted overrides, validated by the schema's models into one typed Config."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mtpjax.config.errors import ConfigError, one_line
from mtpjax.config.schema import Config


class _Loader(yaml.SafeLoader):
    """YAML without base-60 integers: `train.profile=10:15` stays the string "10:15", not 615."""


_Loader.yaml_implicit_resolvers = {
    c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:int"]
    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _overridden(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """`raw` with each `section.key=value` (the value read as YAML) set in it."""
    if isinstance(overrides, (str, bytes)):  # iterating it would read each character as an override
        raise ConfigError(f"overrides is one string ({overrides!r:.60}); pass a list of section.key=value strings, "
                          f"e.g. [{overrides!r:.60}]")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. train.steps=100)")
        key, text = item.split("=", 1)
        *parts, last = key.strip().split(".")
        if not all([*parts, last]):
            raise ConfigError(f"override '{item}' has an empty key part; use section.key=value")
        try:
            value = _yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = raw
        for p in parts:
            if node.get(p) is None:  # an empty YAML section (`model:`) reads as None
                node[p] = {}
            if not isinstance(node := node[p], dict):
                raise ConfigError(f"override '{item}': '{p}' is a value, not a section")
        node[last] = value
    return raw


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config (None: all defaults), apply dotted overrides, validate; raises ConfigError."""
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if p.is_dir() or not p.exists():  # anything else is read: a pipe too (--config <(...))
            what = "is a directory" if p.is_dir() else "does not exist"
            raise ConfigError(f"config file '{p}' {what}; pass a YAML file such as configs/tiny.yaml")
        try:
            raw = _yaml(p.read_text()) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file '{p}' is not UTF-8 text (byte {e.start}); pass a YAML file such as "
                              "configs/tiny.yaml") from None
        except OSError as e:
            raise ConfigError(f"config file '{p}' cannot be read ({e.strerror or e}); pass a readable YAML file") \
                from None
        except yaml.constructor.ConstructorError as e:  # a tag such as !!python/object: no code runs from a config
            line = f" (line {e.problem_mark.line + 1})" if e.problem_mark else ""
            raise ConfigError(f"config file '{p}' uses a YAML tag that safe loading refuses{line}: {e.problem}; "
                              "write plain values") from None
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"config file '{p}' is not valid YAML{where}; fix its syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, train:, ...)")
    return from_dict(_overridden(raw, overrides))


def from_dict(raw: Any) -> Config:
    """Build and validate a Config from a nested dict (e.g. one saved with a checkpoint)."""
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise one_line(e, Config, raw=raw) from None


def replace(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """A copy of cfg with dotted overrides applied and validated."""
    return from_dict(_overridden(cfg.to_dict(), overrides))
