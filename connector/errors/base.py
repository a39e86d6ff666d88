"""The base class of every error raised by ``connector``."""

from __future__ import annotations


class ConnectorError(Exception):
    """Base class of every error raised by ``connector``.

    .. versionadded:: 0.1.0
    """
