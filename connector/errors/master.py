"""Errors about the embedded ``mooncake_master`` process."""

from __future__ import annotations

import attrs

from connector.errors.base import ConnectorError


class MasterError(ConnectorError):
    """Base class of errors about the embedded ``mooncake_master`` process.

    .. versionadded:: 0.1.0
    """


@attrs.define(auto_exc=True, slots=False)
class MasterBinaryNotFoundError(MasterError, FileNotFoundError):
    """No ``mooncake_master`` executable was found in any of ``searched``.

    .. versionadded:: 0.1.0
    """

    searched: tuple[str, ...]

    def __str__(self) -> str:
        where = ", ".join(self.searched) or "nowhere"
        return (
            "mooncake_master executable not found "
            f"(searched: {where}); install "
            "mooncake-transfer-engine-non-cuda or put it on PATH"
        )


@attrs.define(auto_exc=True, slots=False)
class MasterStartError(MasterError):
    """``mooncake_master`` did not become ready.

    ``reason`` says why (exited, timed out), ``returncode`` is its exit
    status if it exited, ``attempts`` how many starts were tried and
    ``log_tail`` its last output lines.

    .. versionadded:: 0.1.0
    """

    reason: str
    returncode: int | None
    attempts: int
    log_tail: tuple[str, ...]

    def __str__(self) -> str:
        tail = " | ".join(self.log_tail[-5:]) or "no output"
        return (
            f"mooncake_master failed to start after {self.attempts} "
            f"attempt(s): {self.reason} (returncode={self.returncode}; "
            f"last output: {tail})"
        )


@attrs.define(auto_exc=True, slots=False)
class MasterNotRunningError(MasterError):
    """An operation (``pause``, ``kill``, an address) needs a started master.

    .. versionadded:: 0.1.0
    """

    operation: str

    def __str__(self) -> str:
        return f"{self.operation}: the embedded mooncake_master is not running"


@attrs.define(auto_exc=True, slots=False)
class ServiceStartError(MasterError):
    """A supervised process (etcd, mooncake_client, HA set) did not start.

    ``service`` names it, ``reason`` says why (no binary, exited, timed
    out), ``returncode`` is its exit status if it exited and ``log_tail``
    its last output lines.

    .. versionadded:: 0.1.0
    """

    service: str
    reason: str
    returncode: int | None
    log_tail: tuple[str, ...]

    def __str__(self) -> str:
        tail = " | ".join(self.log_tail[-5:]) or "no output"
        return (
            f"{self.service} failed to start: {self.reason} "
            f"(returncode={self.returncode}; last output: {tail})"
        )
