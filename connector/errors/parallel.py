"""Errors about vLLM's parallel layout (tensor and pipeline ranks)."""

from __future__ import annotations

import attrs

from connector.errors.base import ConnectorError


@attrs.define(auto_exc=True, slots=False)
class UnsupportedParallelism(ConnectorError, ValueError):
    """vLLM's parallel layout is one the connector cannot key correctly.

    Raised at start-up (the connector's construction): ``setting`` names
    vLLM's parallel-config field (``"pipeline_parallel_size"``),
    ``value`` its value, ``reason`` why it is refused.

    .. versionadded:: 0.1.0
    """

    setting: str
    value: object
    reason: str

    def __str__(self) -> str:
        return (
            f"kv-lifecycle cannot run with {self.setting}={self.value!r}: "
            f"{self.reason}"
        )


@attrs.define(auto_exc=True, slots=False)
class ParallelRankError(ConnectorError, RuntimeError):
    """A worker's parallel rank could not be read from vLLM.

    Raised at start-up instead of guessing rank 0, which would make
    every rank read and write rank 0's keys: ``what`` names the rank
    (``"tensor-parallel rank"``), ``size`` the configured world size of
    that dimension and ``reason`` what vLLM answered.

    .. versionadded:: 0.1.0
    """

    what: str
    size: int
    reason: str

    def __str__(self) -> str:
        return (
            f"kv-lifecycle cannot read this worker's {self.what} "
            f"(size {self.size}): {self.reason}"
        )
