"""Exceptions raised by the connector's store backend.

Every exception carries the data that explains it as attributes, and its
message names them, so a log line alone says what went wrong and where.
All exceptions pickle (they cross ``spawn`` process boundaries in tests).
"""

from __future__ import annotations

from typing import Any


class ConnectorError(Exception):
    """Base class of every error raised by ``connector``.

    .. versionadded:: 0.1.0
    """


class ConfigError(ConnectorError, ValueError):
    """A configuration value is missing, has the wrong type or is out of range.

    ``key`` names the offending key exactly as the user spelled it (e.g.
    ``"global_segment_size"``), ``value`` is what was given (``None`` when
    missing) and ``reason`` says what was expected.

    .. versionadded:: 0.1.0
    """

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"config key {key!r}: {reason} (got {value!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.value, self.reason))


class KeySchemeError(ConnectorError, ValueError):
    """A component of a store key is invalid (negative rank, empty hash, ...).

    ``component`` names the field (``"tp_rank"``, ``"block_hash"``, ...).

    .. versionadded:: 0.1.0
    """

    def __init__(self, component: str, value: object, reason: str) -> None:
        self.component = component
        self.value = value
        self.reason = reason
        super().__init__(
            f"key component {component!r}: {reason} (got {value!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.component, self.value, self.reason))


class MasterError(ConnectorError):
    """Base class of errors about the embedded ``mooncake_master`` process.

    .. versionadded:: 0.1.0
    """


class MasterBinaryNotFoundError(MasterError, FileNotFoundError):
    """No ``mooncake_master`` executable was found in any of ``searched``.

    .. versionadded:: 0.1.0
    """

    def __init__(self, searched: tuple[str, ...]) -> None:
        self.searched = searched
        where = ", ".join(searched) or "nowhere"
        super().__init__(
            "mooncake_master executable not found "
            f"(searched: {where}); install "
            "mooncake-transfer-engine-non-cuda or put it on PATH"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.searched,))


class MasterStartError(MasterError):
    """``mooncake_master`` did not become ready.

    ``reason`` says why (exited, timed out), ``returncode`` is its exit
    status if it exited, ``attempts`` how many starts were tried and
    ``log_tail`` its last output lines.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        reason: str,
        returncode: int | None,
        attempts: int,
        log_tail: tuple[str, ...],
    ) -> None:
        self.reason = reason
        self.returncode = returncode
        self.attempts = attempts
        self.log_tail = log_tail
        tail = " | ".join(log_tail[-5:]) or "no output"
        super().__init__(
            f"mooncake_master failed to start after {attempts} attempt(s): "
            f"{reason} (returncode={returncode}; last output: {tail})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.reason, self.returncode, self.attempts, self.log_tail),
        )


class MasterNotRunningError(MasterError):
    """An operation (``pause``, ``kill``, an address) needs a started master.

    .. versionadded:: 0.1.0
    """

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(
            f"{operation}: the embedded mooncake_master is not running"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.operation,))


class StoreError(ConnectorError):
    """Base class of errors raised by ``connector.store.StoreClient``.

    Per-key failures of data calls are *not* exceptions: they come back as
    ``Outcome`` values. Exceptions are for misuse and for set-up failures.

    .. versionadded:: 0.1.0
    """


class StoreUnavailable(StoreError):  # noqa: N818 - public API name
    """The store client could not be set up against the master at ``address``.

    ``code`` is Mooncake's return code (``None`` when the failure came
    before calling Mooncake, e.g. a refused TCP connection) and ``reason``
    describes the cause.

    .. versionadded:: 0.1.0
    """

    def __init__(self, address: str, code: int | None, reason: str) -> None:
        self.address = address
        self.code = code
        self.reason = reason
        super().__init__(
            f"Mooncake master at {address} is unavailable: {reason} "
            f"(code={code})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.address, self.code, self.reason))


class StoreClosedError(StoreError):
    """``operation`` was called on a ``StoreClient`` after ``close()``.

    .. versionadded:: 0.1.0
    """

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(f"{operation}: the store client is closed")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.operation,))


class RegistrationError(StoreError):
    """Registering ``nbytes`` at ``ptr`` for zero-copy transfers failed.

    .. versionadded:: 0.1.0
    """

    def __init__(self, ptr: int, nbytes: int, code: int, reason: str) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.code = code
        self.reason = reason
        super().__init__(
            f"register_buffer(ptr={ptr:#x}, nbytes={nbytes}) failed: "
            f"{reason} (code={code})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ptr, self.nbytes, self.code, self.reason))


class RegionError(StoreError, ValueError):
    """The memory regions passed to ``put``/``get`` do not fit the keys.

    ``index`` is the position of the offending key (``None`` for a
    whole-batch problem such as a length mismatch).

    .. versionadded:: 0.1.0
    """

    def __init__(self, index: int | None, reason: str) -> None:
        self.index = index
        self.reason = reason
        where = "batch" if index is None else f"key #{index}"
        super().__init__(f"invalid region for {where}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.index, self.reason))


class UnsupportedKVGroups(ConnectorError, ValueError):  # noqa: N818 - API name
    """The model's KV cache groups include a kind the connector cannot serve.

    Raised at start-up (the connector's construction), never mid-serving:
    ``groups`` names every group as ``"<index>:<kind>"`` (e.g.
    ``("0:full_attention", "1:mamba")``), ``supported`` lists the kinds
    the connector saves and loads, and ``reason`` says which group failed.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, groups: tuple[str, ...], supported: str, reason: str
    ) -> None:
        self.groups = groups
        self.supported = supported
        self.reason = reason
        super().__init__(
            f"kv-lifecycle cannot serve this model's KV cache groups "
            f"({', '.join(groups)}): {reason}; supported group kinds: "
            f"{supported}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.groups, self.supported, self.reason))
