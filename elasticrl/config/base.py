"""The config error and its check helper, shared by every config module."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and the fix."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
