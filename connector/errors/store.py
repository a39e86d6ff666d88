"""Errors of the store client and its keys.

Per-key failures of data calls are not exceptions: they come back as
``connector.store.Outcome`` values.  Exceptions are for misuse and for
set-up failures.
"""

from __future__ import annotations

import attrs

from connector.errors.base import ConnectorError


@attrs.define(auto_exc=True, slots=False)
class KeySchemeError(ConnectorError, ValueError):
    """A component of a store key is invalid (negative rank, empty hash, ...).

    ``component`` names the field (``"tp_rank"``, ``"block_hash"``, ...).

    .. versionadded:: 0.1.0
    """

    component: str
    value: object
    reason: str

    def __str__(self) -> str:
        return (
            f"key component {self.component!r}: {self.reason} "
            f"(got {self.value!r})"
        )


class StoreError(ConnectorError):
    """Base class of errors raised by ``connector.store.StoreClient``.

    Per-key failures of data calls are *not* exceptions: they come back as
    ``Outcome`` values. Exceptions are for misuse and for set-up failures.

    .. versionadded:: 0.1.0
    """


@attrs.define(auto_exc=True, slots=False)
class StoreUnavailable(StoreError):
    """The store client could not be set up against the master at ``address``.

    ``code`` is Mooncake's return code (``None`` when the failure came
    before calling Mooncake, e.g. a refused TCP connection) and ``reason``
    describes the cause.

    .. versionadded:: 0.1.0
    """

    address: str
    code: int | None
    reason: str

    def __str__(self) -> str:
        return (
            f"Mooncake master at {self.address} is unavailable: "
            f"{self.reason} (code={self.code})"
        )


@attrs.define(auto_exc=True, slots=False)
class StoreClosedError(StoreError):
    """``operation`` was called on a ``StoreClient`` after ``close()``.

    .. versionadded:: 0.1.0
    """

    operation: str

    def __str__(self) -> str:
        return f"{self.operation}: the store client is closed"


@attrs.define(auto_exc=True, slots=False)
class RegistrationError(StoreError):
    """Registering ``nbytes`` at ``ptr`` for zero-copy transfers failed.

    .. versionadded:: 0.1.0
    """

    ptr: int
    nbytes: int
    code: int
    reason: str

    def __str__(self) -> str:
        return (
            f"register_buffer(ptr={self.ptr:#x}, nbytes={self.nbytes}) "
            f"failed: {self.reason} (code={self.code})"
        )


@attrs.define(auto_exc=True, slots=False)
class RegionError(StoreError, ValueError):
    """The memory regions passed to ``put``/``get`` do not fit the keys.

    ``index`` is the position of the offending key (``None`` for a
    whole-batch problem such as a length mismatch).

    .. versionadded:: 0.1.0
    """

    index: int | None
    reason: str

    def __str__(self) -> str:
        where = "batch" if self.index is None else f"key #{self.index}"
        return f"invalid region for {where}: {self.reason}"
