"""Exceptions raised by the connector's store backend.

Every exception is an attrs class: the data that explain it are its
fields and its message names them, so a log line alone says what went
wrong and where. They pickle by their fields, for free (exceptions cross
``spawn`` process boundaries and vLLM's engine-core boundary).

``attrs.define(auto_exc=True, slots=False)`` declares each: fields, an
``__init__`` taking them in order, ``args`` holding them (so pickling
rebuilds the exception), identity equality and hashing like any
exception; ``__str__`` writes the message.
"""

from __future__ import annotations

import attrs


class ConnectorError(Exception):
    """Base class of every error raised by ``connector``.

    .. versionadded:: 0.1.0
    """


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
