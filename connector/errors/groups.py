"""Errors about the model's KV cache groups."""

from __future__ import annotations

import attrs

from connector.errors.base import ConnectorError


@attrs.define(auto_exc=True, slots=False)
class UnsupportedKVGroups(ConnectorError, ValueError):
    """The model's KV cache groups include a kind the connector cannot serve.

    Raised at start-up (the connector's construction), never mid-serving:
    ``groups`` names every group as ``"<index>:<kind>"`` (e.g.
    ``("0:full_attention", "1:mamba")``), ``supported`` lists the kinds
    the connector saves and loads, and ``reason`` says which group failed.

    .. versionadded:: 0.1.0
    """

    groups: tuple[str, ...]
    supported: str
    reason: str

    def __str__(self) -> str:
        return (
            f"kv-lifecycle cannot serve this model's KV cache groups "
            f"({', '.join(self.groups)}): {self.reason}; supported group "
            f"kinds: {self.supported}"
        )
