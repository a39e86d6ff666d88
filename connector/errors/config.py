"""Errors in the connector's configuration."""

from __future__ import annotations

import attrs

from connector.errors.base import ConnectorError


@attrs.define(auto_exc=True, slots=False)
class ConfigError(ConnectorError, ValueError):
    """A configuration value is missing, has the wrong type or is out of range.

    ``key`` names the offending key exactly as the user spelled it (e.g.
    ``"global_segment_size"``), ``value`` is what was given (``None`` when
    missing) and ``reason`` says what was expected.

    .. versionadded:: 0.1.0
    """

    key: str
    value: object
    reason: str

    def __str__(self) -> str:
        return f"config key {self.key!r}: {self.reason} (got {self.value!r})"
