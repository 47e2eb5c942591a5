"""Reading a config: YAML plus dotted overrides, each value coerced to its field's type, then validated."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mtpjax.config.errors import ConfigError, fail
from mtpjax.config.schema import RETIRED, Config
from mtpjax.config.specs import DecodeDraft, Spec
from mtpjax.config.validate import validate


class _Loader(yaml.SafeLoader):
    """YAML without base-60 integers: `train.profile=10:15` stays the string "10:15", not 615."""


_Loader.yaml_implicit_resolvers = {
    c: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:int"]
    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    if isinstance(tp, type) and issubclass(tp, Spec):  # written as one string, parsed here once
        return value if isinstance(value, tp) else tp.parse(_coerce(key, value, str), key)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    origin = typing.get_origin(tp)
    if origin is Literal:  # membership is the validator's; here only the type
        return _coerce(key, value, str)
    if origin is tuple:
        (item_tp, *_) = typing.get_args(tp)
        if isinstance(value, str) and not dataclasses.is_dataclass(item_tp):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise fail(key, value, "expected a list")
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise fail(key, value, "expected an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML reads 3e-4 (no dot) as a string
            except ValueError:
                pass
        if number is None or not math.isfinite(number):  # .inf would pass every "> 0" check
            raise fail(key, value, "expected a number (not inf or nan)")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise fail(key, value, "expected a string")
    raise TypeError(f"unsupported config type {tp} for {key}")


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise fail(prefix.rstrip(".") or "<root>", raw, "expected a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if full in RETIRED:
            raise ConfigError(f"config key '{full}' was replaced by '{RETIRED[full]}' ({DecodeDraft.FORMS}); "
                              f"write {RETIRED[full]}=... instead")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
        kwargs[key] = _coerce(full, value, hints[key])
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form section.key=value (e.g. train.steps=100)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{item}' has an empty key part; use section.key=value")
    try:
        value = _yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return parts, value


def _set(tree: dict, parts: list[str], value: Any, full: str) -> None:
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:  # an empty YAML section (`model:`) reads as None
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{full}': '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a YAML config (None: all defaults), apply dotted overrides, validate; raises ConfigError."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist; pass a path such as configs/tiny.yaml")
        try:
            raw = _yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"config file '{p}' is not valid YAML{where}; fix its syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections (model:, train:, ...)")
    for item in overrides:
        parts, value = _parse_override(item)
        _set(raw, parts, value, item)
    return from_dict(raw)


def from_dict(raw: dict) -> Config:
    """Build and validate a Config from a nested dict (e.g. one saved with a checkpoint)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def replace(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """A copy of cfg with dotted overrides applied and validated."""
    raw = cfg.to_dict()
    for item in overrides:
        parts, value = _parse_override(item)
        _set(raw, parts, value, item)
    return from_dict(raw)
