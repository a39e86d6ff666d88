"""Mooncake's return codes, the outcomes they map to, and the operations.

``ErrorCode`` names the Mooncake codes this client distinguishes;
``outcome_of_error`` maps any code to an ``Outcome``; the helpers below
turn a whole batch's codes into outcomes on the hot path (C-level list
operations, no per-key Python work where it can be avoided).
"""

from __future__ import annotations

import enum
from typing import (
    Final,
)


class ErrorCode(enum.IntEnum):
    """Mooncake's ``ErrorCode`` values that this client distinguishes."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    TENANT_QUOTA_EXCEEDED = -1700


class Outcome(enum.Enum):
    """What happened to one key of a batch call."""

    STORED = "stored"
    """Put: the value was written by this call."""
    ALREADY_PRESENT = "already_present"
    """Put: the key existed; the first value was kept, nothing written."""
    HIT = "hit"
    """Exists: present. Get: the full value was read. Remove: removed."""
    MISS = "miss"
    """Exists/get/remove: no such key (``OBJECT_NOT_FOUND``)."""
    STORE_FULL = "store_full"
    """Put: no space (``NO_AVAILABLE_HANDLE``); back off and retry later."""
    TRANSFER_FAILED = "transfer_failed"
    """The data could not be moved (``TRANSFER_FAIL``, lease expired...)."""
    MASTER_UNREACHABLE = "master_unreachable"
    """``RPC_FAIL``, or the circuit breaker is open (nothing was sent)."""
    TIMEOUT = "timeout"
    """``RPC_TIMEOUT``: the master did not answer within the RPC bound."""
    INVALID = "invalid"
    """Bad parameters (``INVALID_PARAMS``...), or a short read on get."""
    OTHER = "other"
    """Any other code; ``BatchResult.codes`` keeps it."""

    @property
    def ok(self) -> bool:
        """Whether the key succeeded (STORED, ALREADY_PRESENT or HIT)."""
        return self in _SUCCESS


_SUCCESS: Final = frozenset(
    {Outcome.STORED, Outcome.ALREADY_PRESENT, Outcome.HIT}
)
_OUTAGE: Final = frozenset({Outcome.MASTER_UNREACHABLE, Outcome.TIMEOUT})

_ERROR_OUTCOMES: Final[dict[int, Outcome]] = {
    ErrorCode.OBJECT_NOT_FOUND: Outcome.MISS,
    ErrorCode.NO_AVAILABLE_HANDLE: Outcome.STORE_FULL,
    ErrorCode.TENANT_QUOTA_EXCEEDED: Outcome.STORE_FULL,
    ErrorCode.RPC_TIMEOUT: Outcome.TIMEOUT,
    ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS: Outcome.MASTER_UNREACHABLE,
    ErrorCode.UNAVAILABLE_IN_CURRENT_MODE: Outcome.MASTER_UNREACHABLE,
    ErrorCode.REPLICA_IS_NOT_READY: Outcome.TRANSFER_FAILED,
    ErrorCode.LEASE_EXPIRED: Outcome.TRANSFER_FAILED,
    ErrorCode.REPLICA_IS_GONE: Outcome.TRANSFER_FAILED,
    ErrorCode.INVALID_KEY: Outcome.INVALID,
    ErrorCode.INVALID_PARAMS: Outcome.INVALID,
    ErrorCode.ILLEGAL_CLIENT: Outcome.INVALID,
    ErrorCode.BUFFER_OVERFLOW: Outcome.INVALID,
    ErrorCode.INVALID_WRITE: Outcome.INVALID,
    ErrorCode.INVALID_READ: Outcome.INVALID,
    ErrorCode.INVALID_REPLICA: Outcome.INVALID,
}


def outcome_of_error(code: int) -> Outcome:
    """Map a negative Mooncake code to an ``Outcome``.

    ``-704`` is MISS, ``-200`` STORE_FULL, ``-800..-899`` TRANSFER_FAILED,
    ``-901`` TIMEOUT, other ``-900..-999`` MASTER_UNREACHABLE,
    ``-600``/``-400``/... INVALID, anything else OTHER.
    """
    outcome = _ERROR_OUTCOMES.get(code)
    if outcome is not None:
        return outcome
    if -899 <= code <= -800:  # noqa: PLR2004
        return Outcome.TRANSFER_FAILED
    if -999 <= code <= -900:  # noqa: PLR2004
        return Outcome.MASTER_UNREACHABLE
    return Outcome.OTHER


class Op(enum.Enum):
    """The data operations, for results and stats."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    REPLICA_GET = "replica_get"
    """A get's second try: a raw read of another replica."""
    REMOVE = "remove"


_OUTAGE_CODES: Final = frozenset(
    {
        ErrorCode.RPC_FAIL,
        ErrorCode.RPC_TIMEOUT,
        ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
        ErrorCode.UNAVAILABLE_IN_CURRENT_MODE,
    }
)


def _has_outage(codes: list[int]) -> bool:
    # on the hot path every code is >= 0; one C-level min()
    # of plain ints settles it (IntEnum comparisons are slower).
    if not codes or min(codes) >= 0:
        return False
    return any(c in _OUTAGE_CODES for c in codes)


_OK_ORDER: Final = (Outcome.HIT, Outcome.STORED, Outcome.ALREADY_PRESENT)


def _num_ok(outcomes: list[Outcome]) -> int:
    # list.count runs in C; a Python loop per key would be
    # visible in the benchmark at 256 KiB x 16.
    return sum(outcomes.count(ok) for ok in _OK_ORDER)


def _remove_outcomes(codes: list[int]) -> list[Outcome]:
    """Remove codes: 0 is HIT (removed), else the error's outcome."""
    return [Outcome.HIT if c == 0 else outcome_of_error(c) for c in codes]


def _exists_outcomes(codes: list[int]) -> list[Outcome]:
    if codes and min(codes) == 1:  # all present, checked in C
        return [Outcome.HIT] * len(codes)
    hit, miss = Outcome.HIT, Outcome.MISS
    return [
        hit if c == 1 else miss if c == 0 else outcome_of_error(c)
        for c in codes
    ]


def _sum_ok(sizes: list[int], outcomes: list[Outcome], total: int) -> int:
    """Bytes of the keys that succeeded (``total`` when all did)."""
    if outcomes.count(Outcome.STORED) + outcomes.count(Outcome.HIT) == len(
        outcomes
    ):
        return total
    return sum(
        s for s, o in zip(sizes, outcomes, strict=True) if o in _SUCCESS
    )
