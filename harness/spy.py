"""Wrap one method of one object, for callers that look it up by name.

vLLM's scheduler calls its connector's hooks through `self.connector`,
and the engine reads stats through `get_kv_connector_stats`: an instance
attribute of the same name shadows the class's method for that object
only, so a spy sees every call without subclassing the connector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def shadow_method(
    obj: object,
    name: str,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Replace `obj.name` (for `obj` only) by `wrap(original bound method)`."""
    setattr(obj, name, wrap(getattr(obj, name)))
