"""The config's one error type and its one-line message form."""

from __future__ import annotations

from typing import Any

from mtpjax.errors import MtpjaxError


class ConfigError(MtpjaxError, ValueError):
    """A config value is wrong; the message is one line naming the key, the value and what is allowed."""


def fail(key: str, value: Any, allowed: str) -> ConfigError:
    """The error for `key` holding `value`, saying what is allowed."""
    return ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")
