"""Typed client of the Mooncake distributed store (the connector's data plane).

``StoreClient`` wraps ``mooncake.store.MooncakeDistributedStore``:

- zero-copy batch calls only: ``batch_is_exist``, ``batch_put_from`` /
  ``batch_get_into`` (one contiguous region per key) and the
  ``*_multi_buffers`` variants (a list of pieces per key);
- every per-key return code becomes an ``Outcome``; a batch returns a
  ``BatchResult`` (a sequence of outcomes plus raw codes, bytes moved and
  latency), never an exception;
- a circuit breaker on ``health_check()`` (a cached flag, well under 1 us)
  turns a dead or hung master into one bounded stall followed by immediate
  ``MASTER_UNREACHABLE`` results, and lets one call through every
  ``breaker_probe_ms`` to detect recovery;
- per-operation counters (``stats``) for a metrics layer.

Theory of operation, per call: check the client is open, ask the breaker
(``health_check() == 0`` while closed), issue exactly one Mooncake batch
call (a put issues two: ``batch_is_exist`` first, then puts only the
missing keys), map the codes, feed RPC failures back into the breaker,
record stats. The Mooncake calls release the GIL and may run concurrently
from transfer threads; all client state is guarded by locks.

Bounds (measured with 0.3.13.post1, see the reference notes): a hung master
costs ``rpc_timeout_ms`` per RPC (``MC_RPC_TIMEOUT_MS``); a dead master
costs a fixed reconnect stall of about 4.3-4.6 s that no setting shortens.
The breaker makes either happen at most once per outage per concurrent
caller (``DEAD_MASTER_STALL_S`` documents the second bound).
"""

from __future__ import annotations

import bisect
import collections
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Protocol,
    Self,
    TypeGuard,
    overload,
)

import attrs

from connector.errors import (
    RegionError,
    RegistrationError,
    StoreClosedError,
    StoreUnavailable,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import TracebackType

    import torch

    from connector.config import StoreConfig

__all__ = [
    "DEAD_MASTER_STALL_S",
    "BatchResult",
    "BreakerState",
    "CircuitBreaker",
    "ErrorCode",
    "MooncakeStore",
    "Op",
    "OpStats",
    "Outcome",
    "Region",
    "Regions",
    "StoreClient",
    "StoreStats",
    "outcome_of_error",
]

log = logging.getLogger(__name__)

DEAD_MASTER_STALL_S: Final = 5.0
"""Upper bound of one call against a freshly killed master (measured 4.6 s).

Mooncake retries the connection internally for about 4.3-4.6 s before it
returns ``RPC_FAIL``; neither ``MC_RPC_TIMEOUT_MS`` nor
``MC_RPC_CONNECT_TIMEOUT_MS`` shortens it.
"""

_LATENCY_SAMPLES: Final = 1024


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
    REMOVE = "remove"


# -- the Mooncake surface we use -------------------------------------------


class MooncakeStore(Protocol):
    """The subset of ``MooncakeDistributedStore`` this client calls."""

    def setup(  # noqa: D102, PLR0917
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        /,
    ) -> int: ...

    def get_hostname(self) -> str: ...  # noqa: D102

    def register_buffer(self, buffer_ptr: int, size: int, /) -> int: ...  # noqa: D102

    def unregister_buffer(self, buffer_ptr: int, /) -> int: ...  # noqa: D102

    def batch_is_exist(self, keys: list[str], /) -> list[int]: ...  # noqa: D102

    def batch_put_from(  # noqa: D102
        self,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        config: Any,
        /,
    ) -> list[int]: ...

    def batch_get_into(  # noqa: D102
        self, keys: list[str], ptrs: list[int], sizes: list[int], /
    ) -> list[int]: ...

    def batch_put_from_multi_buffers(  # noqa: D102
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: Any,
        /,
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(  # noqa: D102
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        /,
    ) -> list[int]: ...

    def batch_remove(self, keys: list[str], force: bool, /) -> list[int]: ...  # noqa: D102, FBT001

    def remove_all(self, force: bool, /) -> int: ...  # noqa: D102, FBT001

    def health_check(self) -> int: ...  # noqa: D102

    def close(self) -> int: ...  # noqa: D102


def _mooncake_store() -> tuple[MooncakeStore, Any]:
    """Create a real ``MooncakeDistributedStore`` and a ``ReplicateConfig``."""
    from mooncake.store import (  # noqa: PLC0415 - optional, heavy import
        MooncakeDistributedStore,
        ReplicateConfig,
    )

    store: MooncakeStore = MooncakeDistributedStore()
    return store, ReplicateConfig()


# -- regions ------------------------------------------------------------------

Region = tuple[int, int]
"""``(ptr, nbytes)`` of one contiguous piece of registered memory."""


@attrs.define(slots=True)
class Regions:
    """Memory for a batch: one contiguous region or a piece list per key.

    Treat it as immutable. (Not ``frozen``: a frozen init costs about
    0.4 us more, and regions are built on every transfer.)

    Build it with ``contiguous``/``blocks`` (fast path, one region per
    key, ``batch_put_from``/``batch_get_into``) or ``pieces``/``of``
    (adjacent pieces are coalesced; if every key ends up contiguous the
    fast path is used, else the ``*_multi_buffers`` calls).

    Attributes:
        ptrs: per key, the region's address (contiguous layout).
        sizes: per key, the object size in bytes.
        piece_ptrs: per key, the pieces' addresses (``None`` when
            contiguous).
        piece_sizes: per key, the pieces' sizes (``None`` when contiguous).
        nbytes: total bytes of the batch.
    """

    ptrs: list[int]
    sizes: list[int]
    piece_ptrs: list[list[int]] | None = None
    piece_sizes: list[list[int]] | None = None
    nbytes: int = 0

    @property
    def contiguous_layout(self) -> bool:
        """Whether every key is one contiguous region."""
        return self.piece_ptrs is None

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def contiguous(cls, ptrs: list[int], sizes: list[int]) -> Regions:
        """One ``(ptrs[i], sizes[i])`` region per key (no copying).

        Raises:
            RegionError: lengths differ or a size is not positive.
        """
        if len(ptrs) != len(sizes):
            reason = f"{len(ptrs)} pointers but {len(sizes)} sizes"
            raise RegionError(None, reason)
        nbytes = sum(sizes)
        if sizes and min(sizes) <= 0:
            index = next(i for i, s in enumerate(sizes) if s <= 0)
            raise RegionError(index, f"size {sizes[index]} is not positive")
        return cls(ptrs, sizes, None, None, nbytes)

    @classmethod
    def blocks(
        cls, base_ptr: int, block_bytes: int, block_ids: Sequence[int]
    ) -> Regions:
        """Whole blocks ``block_ids`` of a blocks-first buffer at ``base_ptr``.

        The common KV layout: block ``b`` lives at
        ``base_ptr + b * block_bytes`` and is stored as one object.
        """
        if block_bytes <= 0:
            reason = f"block_bytes {block_bytes} is not positive"
            raise RegionError(None, reason)
        ptrs = [base_ptr + b * block_bytes for b in block_ids]
        return cls(ptrs, [block_bytes] * len(ptrs), None, None,
                   block_bytes * len(ptrs))  # fmt: skip

    @classmethod
    def pieces(
        cls,
        ptr_lists: Sequence[Sequence[int]],
        size_lists: Sequence[Sequence[int]],
    ) -> Regions:
        """Per key, the object is the concatenation of its pieces.

        Adjacent pieces (``ptr + size == next ptr``) are merged; when every
        key collapses to one region the contiguous fast path is used.

        Raises:
            RegionError: lengths differ, a key has no pieces, or a size is
                not positive.
        """
        if len(ptr_lists) != len(size_lists):
            reason = f"{len(ptr_lists)} piece lists but {len(size_lists)}"
            raise RegionError(None, reason + " size lists")
        all_ptrs: list[list[int]] = []
        all_sizes: list[list[int]] = []
        totals: list[int] = []
        single = True
        for index, (ptrs, sizes) in enumerate(
            zip(ptr_lists, size_lists, strict=True)
        ):
            merged_p, merged_s = _coalesce(index, ptrs, sizes)
            single = single and len(merged_p) == 1
            all_ptrs.append(merged_p)
            all_sizes.append(merged_s)
            totals.append(sum(merged_s))
        nbytes = sum(totals)
        if single:
            return cls([p[0] for p in all_ptrs], totals, None, None, nbytes)
        return cls([p[0] for p in all_ptrs], totals, all_ptrs, all_sizes,
                   nbytes)  # fmt: skip

    @classmethod
    def of(cls, regions: Sequence[Region | Sequence[Region]]) -> Regions:
        """From ``(ptr, size)`` or ``[(ptr, size), ...]`` per key.

        Raises:
            RegionError: an entry is neither form.
        """
        if all(_is_region(r) for r in regions):
            return cls.contiguous(
                [r[0] for r in regions],  # type: ignore[misc]
                [r[1] for r in regions],  # type: ignore[misc]
            )
        ptr_lists: list[list[int]] = []
        size_lists: list[list[int]] = []
        for index, region in enumerate(regions):
            if _is_region(region):
                ptr_lists.append([region[0]])
                size_lists.append([region[1]])
            elif all(_is_region(piece) for piece in region):
                ptr_lists.append([piece[0] for piece in region])  # type: ignore[index]
                size_lists.append([piece[1] for piece in region])  # type: ignore[index]
            else:
                reason = "expected (ptr, size) or a list of (ptr, size)"
                raise RegionError(index, reason)
        return cls.pieces(ptr_lists, size_lists)

    def select(self, indices: Sequence[int]) -> Regions:
        """The regions of the keys at ``indices``, in that order."""
        ptrs = [self.ptrs[i] for i in indices]
        sizes = [self.sizes[i] for i in indices]
        if self.piece_ptrs is None or self.piece_sizes is None:
            return Regions(ptrs, sizes, None, None, sum(sizes))
        piece_ptrs = [self.piece_ptrs[i] for i in indices]
        piece_sizes = [self.piece_sizes[i] for i in indices]
        return Regions(ptrs, sizes, piece_ptrs, piece_sizes, sum(sizes))

    def spans(self) -> Iterator[tuple[int, int, int]]:
        """``(key index, ptr, size)`` of every piece."""
        if self.piece_ptrs is None or self.piece_sizes is None:
            for index, (ptr, size) in enumerate(
                zip(self.ptrs, self.sizes, strict=True)
            ):
                yield index, ptr, size
            return
        for index, (ptrs, sizes) in enumerate(
            zip(self.piece_ptrs, self.piece_sizes, strict=True)
        ):
            for ptr, size in zip(ptrs, sizes, strict=True):
                yield index, ptr, size


def _is_region(value: object) -> TypeGuard[Region]:
    return (
        isinstance(value, tuple)
        and len(value) == 2  # noqa: PLR2004
        and isinstance(value[0], int)
        and isinstance(value[1], int)
    )


def _coalesce(
    index: int, ptrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int], list[int]]:
    if len(ptrs) != len(sizes):
        reason = f"{len(ptrs)} piece pointers but {len(sizes)} piece sizes"
        raise RegionError(index, reason)
    if not ptrs:
        raise RegionError(index, "no pieces")
    out_p = [ptrs[0]]
    out_s = [sizes[0]]
    for size in sizes:
        if size <= 0:
            raise RegionError(index, f"piece size {size} is not positive")
    for ptr, size in zip(ptrs[1:], sizes[1:], strict=True):
        if out_p[-1] + out_s[-1] == ptr:
            out_s[-1] += size
        else:
            out_p.append(ptr)
            out_s.append(size)
    return out_p, out_s


RegionsLike = Regions | Sequence[Region | Sequence[Region]]


# -- results ------------------------------------------------------------------


@attrs.define(slots=True, eq=False)
class BatchResult(Sequence[Outcome]):
    """The per-key outcomes of one batch call, in key order.

    A ``Sequence[Outcome]`` (index, iterate, ``len``, ``count``), plus the
    raw Mooncake codes and summary helpers. Treat it as immutable (not
    ``frozen`` only to keep the per-call cost down).

    Attributes:
        op: which operation.
        outcomes: one ``Outcome`` per key.
        codes: one raw Mooncake code per key (bytes read for a get,
            ``1``/``0`` for exists, synthetic ``-900`` when the breaker
            short-circuited, ``1`` for a put skipped as already present).
        nbytes: bytes moved by this call (written or read).
        elapsed_s: wall time of the call.
        short_circuited: nothing was sent: the breaker was open.
        num_failed: keys that did not succeed (``-1``: not counted yet).
    """

    op: Op
    outcomes: list[Outcome]
    codes: list[int]
    nbytes: int = 0
    elapsed_s: float = 0.0
    short_circuited: bool = False
    num_failed: int = -1

    @overload
    def __getitem__(self, index: int) -> Outcome: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Outcome]: ...
    def __getitem__(self, index: int | slice) -> Outcome | Sequence[Outcome]:
        return self.outcomes[index]

    def __len__(self) -> int:
        return len(self.outcomes)

    def __iter__(self) -> Iterator[Outcome]:
        return iter(self.outcomes)

    def __repr__(self) -> str:
        counts = ", ".join(f"{o.name}={n}" for o, n in self.counts().items())
        return (
            f"<BatchResult {self.op.value} {len(self)} keys: {counts}; "
            f"{self.nbytes} B in {self.elapsed_s * 1e3:.3f} ms"
            f"{' (short-circuited)' if self.short_circuited else ''}>"
        )

    @property
    def ok(self) -> bool:
        """Whether every key succeeded."""
        if self.num_failed >= 0:
            return self.num_failed == 0
        return _num_ok(self.outcomes) == len(self.outcomes)

    @property
    def succeeded(self) -> list[bool]:
        """Per key, whether it succeeded."""
        return [o in _SUCCESS for o in self.outcomes]

    @property
    def num_ok(self) -> int:
        """How many keys succeeded."""
        return _num_ok(self.outcomes)

    @property
    def hit_prefix(self) -> int:
        """Length of the leading run of HITs (longest cached prefix)."""
        for index, outcome in enumerate(self.outcomes):
            if outcome is not Outcome.HIT:
                return index
        return len(self.outcomes)

    @property
    def back_pressure(self) -> bool:
        """Whether some key got STORE_FULL (skip or retry the save)."""
        return Outcome.STORE_FULL in self.outcomes

    @property
    def unavailable(self) -> bool:
        """Whether some key failed because the master was out of reach."""
        return any(o in _OUTAGE for o in self.outcomes)

    def counts(self) -> dict[Outcome, int]:
        """How many keys got each outcome (only outcomes that occurred)."""
        return dict(collections.Counter(self.outcomes))

    def failures(self) -> list[tuple[int, Outcome, int]]:
        """``(index, outcome, code)`` of every key that did not succeed."""
        return [
            (i, o, c)
            for i, (o, c) in enumerate(
                zip(self.outcomes, self.codes, strict=True)
            )
            if o not in _SUCCESS
        ]


# -- stats --------------------------------------------------------------------


@attrs.define(slots=True)
class OpStats:
    """Counters of one operation since start (or the last reset).

    Attributes:
        ops: calls.
        keys: keys over all calls.
        bytes: bytes moved.
        failures: failed keys by outcome (MISS counts as a failure of a
            get and of exists; read ``failures[Outcome.MISS]`` for misses).
        short_circuited: calls answered by the open breaker.
        latencies_s: the last 1024 call latencies.
    """

    ops: int = 0
    keys: int = 0
    bytes: int = 0
    failures: dict[Outcome, int] = attrs.Factory(dict)
    short_circuited: int = 0
    latencies_s: collections.deque[float] = attrs.Factory(
        lambda: collections.deque(maxlen=_LATENCY_SAMPLES)
    )

    def copy(self) -> OpStats:
        """An independent copy."""
        latencies: collections.deque[float] = collections.deque(
            self.latencies_s, maxlen=_LATENCY_SAMPLES
        )
        return OpStats(
            self.ops,
            self.keys,
            self.bytes,
            dict(self.failures),
            self.short_circuited,
            latencies,
        )


class StoreStats:
    """Thread-safe per-operation counters, read by a metrics layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops = {op: OpStats() for op in Op}
        self.breaker_trips = 0
        self._recorded = False

    @property
    def recorded(self) -> bool:
        """Whether a call was recorded since the last reset (lock-free)."""
        return self._recorded

    def record(self, result: BatchResult, failed: int) -> None:
        """Account one call; ``failed`` = number of non-OK keys."""
        with self._lock:
            self._recorded = True
            stats = self._ops[result.op]
            stats.ops += 1
            stats.keys += len(result.outcomes)
            stats.bytes += result.nbytes
            stats.latencies_s.append(result.elapsed_s)
            if result.short_circuited:
                stats.short_circuited += 1
            if failed:
                failures = stats.failures
                for outcome in result.outcomes:
                    if outcome not in _SUCCESS:
                        failures[outcome] = failures.get(outcome, 0) + 1

    def trip(self) -> None:
        """Count one breaker trip."""
        with self._lock:
            self.breaker_trips += 1

    def snapshot(self, *, reset: bool = False) -> dict[Op, OpStats]:
        """Copies of the counters; ``reset`` starts a new interval."""
        with self._lock:
            snap = {op: s.copy() for op, s in self._ops.items()}
            if reset:
                self._ops = {op: OpStats() for op in Op}
                self._recorded = False
            return snap

    def __getitem__(self, op: Op) -> OpStats:
        """A copy of one operation's counters."""
        with self._lock:
            return self._ops[op].copy()


# -- circuit breaker ----------------------------------------------------------


class BreakerState(enum.Enum):
    """States of ``CircuitBreaker``."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Stops calling a master that is known to be unreachable.

    - CLOSED: every call asks ``health()`` (Mooncake's cached 1 Hz ping
      flag, ~0.4 us); a non-zero answer, or an RPC failure/timeout
      reported through ``record``, trips it OPEN.
    - OPEN: calls are refused at once. After ``probe_interval_s`` the next
      call checks ``health()``; if it is 0 that one call goes through as a
      trial (HALF_OPEN), everyone else is still refused.
    - HALF_OPEN: the trial's result closes the breaker (success) or opens
      it again for another interval (outage).
    """

    def __init__(
        self,
        health: Callable[[], int],
        probe_interval_s: float,
        *,
        on_trip: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._health = health
        self._interval = probe_interval_s
        self._on_trip = on_trip
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._next_probe = 0.0
        self._trial: int | None = None

    @property
    def state(self) -> BreakerState:
        """The current state."""
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to the master now."""
        if self._state is BreakerState.CLOSED:
            if self._health() == 0:
                return True
            self.trip("health_check() reports the master unreachable")
            return False
        now = self._clock()
        with self._lock:
            state = self.state  # re-read under the lock
            if state is BreakerState.CLOSED:
                return True
            if state is BreakerState.HALF_OPEN or now < self._next_probe:
                return False
            self._next_probe = now + self._interval
            if self._health() != 0:
                return False
            self._state = BreakerState.HALF_OPEN
            self._trial = threading.get_ident()
            log.info("master looks healthy again; trying one call")
            return True

    def record(self, *, outage: bool) -> None:
        """Feed back one call's result (``outage``: RPC fail/timeout)."""
        if outage:
            self.trip("a call failed with an RPC failure or timeout")
            return
        if self._state is BreakerState.CLOSED:
            return
        with self._lock:
            if self.state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._trial = None
                log.warning("Mooncake master reachable again; breaker closed")

    def release(self) -> None:
        """End a trial that raised before ``record`` (back to OPEN)."""
        with self._lock:
            if (
                self._state is BreakerState.HALF_OPEN
                and self._trial == threading.get_ident()
            ):
                self._state = BreakerState.OPEN
                self._trial = None

    def trip(self, reason: str) -> None:
        """Open the breaker (idempotent while open)."""
        with self._lock:
            was = self._state
            self._state = BreakerState.OPEN
            self._trial = None
            self._next_probe = self._clock() + self._interval
        if was is not BreakerState.OPEN:
            log.warning(
                "Mooncake master unreachable (%s); breaker open", reason
            )
            if self._on_trip is not None:
                self._on_trip()


# -- the client ---------------------------------------------------------------

_OUTAGE_CODES: Final = frozenset(
    {
        ErrorCode.RPC_FAIL,
        ErrorCode.RPC_TIMEOUT,
        ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
        ErrorCode.UNAVAILABLE_IN_CURRENT_MODE,
    }
)


def _has_outage(codes: list[int]) -> bool:
    # NOTE(store): on the hot path every code is >= 0; one C-level min()
    # of plain ints settles it (IntEnum comparisons are slower).
    if not codes or min(codes) >= 0:
        return False
    return any(c in _OUTAGE_CODES for c in codes)


def _local_address(host: str, port: int) -> str:
    """The local IP address that routes to ``host``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class StoreClient:
    """A Mooncake store client with typed, bounded, thread-safe calls.

    Create with ``StoreClient.open(config)``; use from any thread; call
    ``close()`` once (or use it as a context manager). Data calls never
    raise for per-key failures: read the ``BatchResult``. They raise
    ``StoreClosedError`` after ``close()`` and ``RegionError`` for
    malformed regions.
    """

    def __init__(
        self,
        store: MooncakeStore,
        config: StoreConfig,
        *,
        replicate_config: Any = None,
        check_regions: bool = False,
    ) -> None:
        """Wrap an already set-up ``store``; prefer ``StoreClient.open``."""
        self._store = store
        self.config = config
        self._replicate = replicate_config
        self._check_regions = check_regions
        self.stats = StoreStats()
        self.breaker = CircuitBreaker(
            store.health_check,
            config.breaker_probe_ms / 1000,
            on_trip=self.stats.trip,
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._registered: dict[int, int] = {}
        self._starts: list[int] = []

    # -- set-up and teardown --------------------------------------------------

    @classmethod
    def open(
        cls,
        config: StoreConfig,
        *,
        store_factory: Callable[[], tuple[MooncakeStore, Any]] | None = None,
        check_regions: bool = False,
    ) -> StoreClient:
        """Set up a client against the master named in ``config``.

        Sets ``MC_RPC_TIMEOUT_MS``, ``MC_STORE_CLIENT_SETUP_RETRIES`` (and
        ``MC_LOG_LEVEL`` if configured) in ``os.environ`` first: Mooncake
        reads them at set-up, process-wide. With the real store, the master
        RPC port is probed with a TCP connect first, so a master that is
        down fails at once instead of after Mooncake's retries.

        Args:
            config: validated configuration.
            store_factory: returns ``(store, replicate_config)``; default
                ``MooncakeDistributedStore()`` (tests pass fakes; no
                probe then).
            check_regions: verify on every call that each region lies in
                registered memory (debugging; costs a bisect per piece).

        Raises:
            StoreUnavailable: the master is unreachable or ``setup()``
                failed; ``code`` is Mooncake's return code.
        """
        os.environ.update(config.client_env())
        address = config.master_server_address
        if store_factory is None:
            _probe_master(config)
            store_factory = _mooncake_store
        hostname = config.local_hostname or _local_address(
            config.master_host, config.master_port
        )
        store, replicate = store_factory()
        if replicate is not None and hasattr(replicate, "replica_num"):
            replicate.replica_num = config.replica_num
        started = time.monotonic()
        rc = store.setup(
            hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            address,
        )
        if rc != 0:
            reason = (
                f"setup() returned {rc} after "
                f"{time.monotonic() - started:.1f} s (metadata server "
                f"{config.metadata_server}, protocol {config.protocol})"
            )
            raise StoreUnavailable(address, rc, reason)
        log.info(
            "Mooncake store client %s connected to %s in %.2f s "
            "(segment %d B, protocol %s, namespace %r)",
            store.get_hostname(),
            address,
            time.monotonic() - started,
            config.global_segment_size,
            config.protocol,
            config.namespace,
        )
        return cls(
            store,
            config,
            replicate_config=replicate,
            check_regions=check_regions,
        )

    def close(self) -> bool:
        """Close the client; idempotent, bounded by ``close_timeout_ms``.

        Waits for in-flight calls (new calls raise ``StoreClosedError``),
        then closes the Mooncake client in a helper thread (it blocks for
        1-2 s).

        Returns:
            Whether everything finished within the bound.
        """
        deadline = time.monotonic() + self.config.close_timeout_ms / 1000
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "closing with %d call(s) still in flight",
                        self._inflight,
                    )
                    break
                self._idle.wait(left)
        result: list[int] = []
        closer = threading.Thread(
            target=lambda: result.append(self._store.close()),
            name="mooncake-store-close",
            daemon=True,
        )
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            log.warning(
                "Mooncake store close() still running after %d ms; "
                "continuing without it",
                self.config.close_timeout_ms,
            )
            return False
        if result and result[0] != 0:
            log.warning("Mooncake store close() returned %d", result[0])
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def hostname(self) -> str:
        """This client's ``ip:port`` (its segment name)."""
        return self._store.get_hostname()

    @property
    def raw(self) -> MooncakeStore:
        """The underlying Mooncake client (benchmarks, diagnostics)."""
        return self._store

    @property
    def replicate_config(self) -> Any:
        """The ``ReplicateConfig`` passed to puts."""
        return self._replicate

    def healthy(self) -> bool:
        """Open, breaker not open, and ``health_check() == 0``."""
        return (
            not self._closed
            and self.breaker.state is BreakerState.CLOSED
            and self._store.health_check() == 0
        )

    # -- registration ---------------------------------------------------------

    def register(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` for zero-copy transfers.

        Idempotent: a region inside an already registered one is a no-op.

        Returns:
            ``True`` if Mooncake was called, ``False`` if already covered.

        Raises:
            RegistrationError: Mooncake refused, or a region starting at
                ``ptr`` is registered with a different size.
            StoreClosedError: after ``close()``.
        """
        if ptr <= 0 or nbytes <= 0:
            reason = "pointer and size must be positive"
            raise RegistrationError(ptr, nbytes, 0, reason)
        with self._lock:
            if self._closed:
                operation = "register"
                raise StoreClosedError(operation)
            if self._covered(ptr, nbytes):
                return False
            if ptr in self._registered:
                reason = (
                    "already registered with size "
                    f"{self._registered[ptr]}; unregister first"
                )
                raise RegistrationError(ptr, nbytes, 0, reason)
            rc = self._store.register_buffer(ptr, nbytes)
            if rc != 0:
                raise RegistrationError(ptr, nbytes, rc, "Mooncake refused")
            self._registered[ptr] = nbytes
            bisect.insort(self._starts, ptr)
            log.debug("registered %d B at %#x", nbytes, ptr)
            return True

    def register_tensor(self, tensor: torch.Tensor) -> bool:
        """Register the whole storage behind ``tensor`` (see ``register``)."""
        storage = tensor.untyped_storage()
        return self.register(storage.data_ptr(), storage.nbytes())

    def unregister(self, ptr: int) -> None:
        """Forget a region registered at exactly ``ptr``.

        Raises:
            RegistrationError: it was not registered or Mooncake refused.
        """
        with self._lock:
            nbytes = self._registered.pop(ptr, None)
            if nbytes is None:
                reason = "not registered"
                raise RegistrationError(ptr, 0, 0, reason)
            self._starts.remove(ptr)
            rc = self._store.unregister_buffer(ptr)
            if rc != 0:
                reason = "Mooncake refused to unregister"
                raise RegistrationError(ptr, nbytes, rc, reason)

    def _covered(self, ptr: int, nbytes: int) -> bool:
        index = bisect.bisect_right(self._starts, ptr) - 1
        if index < 0:
            return False
        start = self._starts[index]
        return ptr + nbytes <= start + self._registered[start]

    def _validate(self, regions: Regions) -> None:
        with self._lock:
            for index, ptr, size in regions.spans():
                if not self._covered(ptr, size):
                    reason = (
                        f"{size} B at {ptr:#x} is not inside registered "
                        "memory (call register() first)"
                    )
                    raise RegionError(index, reason)

    # -- data calls -----------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> BatchResult:
        """Which keys are stored: HIT / MISS / an error outcome per key.

        A HIT grants the object a read lease (the master's
        ``default_kv_lease_ttl``), so it cannot be evicted right away.
        """
        return self._lookup_call(
            Op.EXISTS, keys, _exists_outcomes, self._store.batch_is_exist
        )

    def put(
        self,
        keys: Sequence[str],
        regions: RegionsLike,
        *,
        dedupe: bool = True,
    ) -> BatchResult:
        """Store each key's region; existing keys keep their first value.

        With ``dedupe`` (the default) one ``batch_is_exist`` runs first and
        only missing keys are written, so a repeated prefix costs no
        transfer and reports ALREADY_PRESENT, and a key repeated within
        the batch is written once. Without it every key is sent and
        reports STORED (Mooncake keeps the old value of an existing key
        either way); use that only when the caller has just looked up.

        Raises:
            RegionError: ``regions`` do not match ``keys``.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        regions = self._regions(keys, regions)
        n = len(keys)
        if not n:
            return BatchResult(Op.PUT, [], [], num_failed=0)
        self._enter("put")
        try:
            if not self.breaker.allow():
                return self._short(Op.PUT, n, started)
            if not dedupe:
                codes = self._put(keys, regions)
                return self._finish_put(codes, regions, started)
            return self._put_missing(keys, regions, started)
        finally:
            self._exit()

    def get(self, keys: Sequence[str], regions: RegionsLike) -> BatchResult:
        """Read each key into its region: HIT only if all bytes arrived.

        A MISS, or any error outcome, means the region's contents are
        undefined and the block must be recomputed. A stored object whose
        size differs from the region is INVALID (code = its size).

        Raises:
            RegionError: ``regions`` do not match ``keys``.
            StoreClosedError: after ``close()``.
        """
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        regions = self._regions(keys, regions)
        if not keys:
            return BatchResult(Op.GET, [], [], num_failed=0)
        self._enter("get")
        try:
            if not self.breaker.allow():
                return self._short(Op.GET, len(keys), started)
            if regions.piece_ptrs is None or regions.piece_sizes is None:
                codes = self._call(
                    self._store.batch_get_into,
                    keys,
                    regions.ptrs,
                    regions.sizes,
                )
            else:
                codes = self._call(
                    self._store.batch_get_into_multi_buffers,
                    keys,
                    regions.piece_ptrs,
                    regions.piece_sizes,
                )
            if codes == regions.sizes:  # all hits, compared in C
                return self._finish(
                    Op.GET,
                    [Outcome.HIT] * len(codes),
                    codes,
                    regions.nbytes,
                    started,
                    failed=0,
                )
            hit = Outcome.HIT
            outcomes = [
                hit
                if c == s
                else outcome_of_error(c)
                if c < 0
                else Outcome.INVALID
                for c, s in zip(codes, regions.sizes, strict=True)
            ]
            nbytes = _sum_ok(regions.sizes, outcomes, regions.nbytes)
            return self._finish(Op.GET, outcomes, codes, nbytes, started)
        finally:
            self._exit()

    def remove(
        self, keys: Sequence[str], *, force: bool = False
    ) -> BatchResult:
        """Remove keys: HIT (removed), MISS, or an error outcome.

        Without ``force`` a leased key (read recently) is not removed
        (``OTHER``, code ``-706``).
        """
        return self._lookup_call(
            Op.REMOVE, keys, _remove_outcomes, self._store.batch_remove, force
        )

    def remove_all(self, *, force: bool = True) -> int:
        """Remove every object of the whole store (all namespaces).

        Returns:
            The number removed, or a negative Mooncake code.
        """
        self._enter("remove_all")
        try:
            if not self.breaker.allow():
                return int(ErrorCode.RPC_FAIL)
            rc = self._store.remove_all(force)
            self.breaker.record(outage=rc in _OUTAGE_CODES)
            return rc
        finally:
            self._exit()

    # -- internals ------------------------------------------------------------

    def _regions(self, keys: list[str], regions: RegionsLike) -> Regions:
        if not isinstance(regions, Regions):
            regions = Regions.of(regions)
        if len(regions.sizes) != len(keys):
            reason = f"{len(keys)} keys but {len(regions.sizes)} regions"
            raise RegionError(None, reason)
        if self._check_regions:
            self._validate(regions)
        return regions

    def _put(self, keys: list[str], regions: Regions) -> list[int]:
        if regions.piece_ptrs is None or regions.piece_sizes is None:
            return self._call(
                self._store.batch_put_from,
                keys,
                regions.ptrs,
                regions.sizes,
                self._replicate,
            )
        return self._call(
            self._store.batch_put_from_multi_buffers,
            keys,
            regions.piece_ptrs,
            regions.piece_sizes,
            self._replicate,
        )

    def _put_missing(
        self, keys: list[str], regions: Regions, started: float
    ) -> BatchResult:
        exist = self._call(self._store.batch_is_exist, keys)
        n = len(keys)
        if not any(exist) and len(set(keys)) == n:
            # Hot path: nothing stored yet, no duplicates.
            return self._finish_put(self._put(keys, regions), regions, started)
        outcomes = [Outcome.ALREADY_PRESENT] * n
        codes = [1] * n
        todo: list[int] = []
        seen: set[str] = set()
        for i, (key, code) in enumerate(zip(keys, exist, strict=True)):
            if code == 0 and key not in seen:
                seen.add(key)
                todo.append(i)
            elif code < 0:
                outcomes[i] = outcome_of_error(code)
                codes[i] = code
        if todo and _has_outage(exist):
            # The master failed the lookup: do not add a second stall.
            self.breaker.record(outage=True)
            for i in todo:
                outcomes[i] = Outcome.MASTER_UNREACHABLE
                codes[i] = int(ErrorCode.RPC_FAIL)
            todo = []
        nbytes = 0
        if todo:
            sub = regions.select(todo)
            put_codes = self._put([keys[i] for i in todo], sub)
            for i, code, size in zip(todo, put_codes, sub.sizes, strict=True):
                codes[i] = code
                if code == 0:
                    outcomes[i] = Outcome.STORED
                    nbytes += size
                else:
                    outcomes[i] = outcome_of_error(code)
        return self._finish(Op.PUT, outcomes, codes, nbytes, started)

    def _lookup_call(
        self,
        op: Op,
        keys: Sequence[str],
        outcomes_of: Callable[[list[int]], list[Outcome]],
        fn: Callable[..., list[int]],
        *args: Any,
    ) -> BatchResult:
        """One keys-only batch call (no data moved), guarded and timed."""
        started = time.perf_counter()
        keys = keys if isinstance(keys, list) else list(keys)
        if not keys:
            return BatchResult(op, [], [], num_failed=0)
        self._enter(op.value)
        try:
            if not self.breaker.allow():
                return self._short(op, len(keys), started)
            codes = self._call(fn, keys, *args)
            return self._finish(op, outcomes_of(codes), codes, 0, started)
        finally:
            self._exit()

    def _call(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        """One Mooncake batch call; feeds RPC failures to the breaker."""
        try:
            codes = fn(*args)
        except RuntimeError:
            log.exception("Mooncake call %s raised", fn.__name__)
            codes = [int(ErrorCode.INTERNAL_ERROR)] * len(args[0])
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.record(outage=_has_outage(codes))
        return codes

    def _finish_put(
        self, codes: list[int], regions: Regions, started: float
    ) -> BatchResult:
        if not any(codes):  # all stored, checked in C
            n = len(codes)
            return self._finish(
                Op.PUT,
                [Outcome.STORED] * n,
                codes,
                regions.nbytes,
                started,
                failed=0,
            )
        outcomes = [
            Outcome.STORED if c == 0 else outcome_of_error(c) for c in codes
        ]
        nbytes = _sum_ok(regions.sizes, outcomes, regions.nbytes)
        return self._finish(Op.PUT, outcomes, codes, nbytes, started)

    def _finish(
        self,
        op: Op,
        outcomes: list[Outcome],
        codes: list[int],
        nbytes: int,
        started: float,
        *,
        failed: int | None = None,
    ) -> BatchResult:
        if failed is None:
            failed = len(outcomes) - _num_ok(outcomes)
        result = BatchResult(
            op,
            outcomes,
            codes,
            nbytes,
            time.perf_counter() - started,
            False,  # noqa: FBT003 - positional for speed
            failed,
        )
        self.stats.record(result, failed)
        if failed and log.isEnabledFor(logging.DEBUG):
            log.debug("%r", result)
        return result

    def _short(self, op: Op, n: int, started: float) -> BatchResult:
        result = BatchResult(
            op,
            [Outcome.MASTER_UNREACHABLE] * n,
            [int(ErrorCode.RPC_FAIL)] * n,
            0,
            time.perf_counter() - started,
            short_circuited=True,
            num_failed=n,
        )
        self.stats.record(result, n)
        return result

    def _enter(self, operation: str) -> None:
        with self._lock:
            if self._closed:
                raise StoreClosedError(operation)
            self._inflight += 1

    def _exit(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._closed and not self._inflight:
                self._idle.notify_all()


_OK_ORDER: Final = (Outcome.HIT, Outcome.STORED, Outcome.ALREADY_PRESENT)


def _num_ok(outcomes: list[Outcome]) -> int:
    # NOTE(store): list.count runs in C; a Python loop per key would be
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


def _probe_master(config: StoreConfig) -> None:
    """Fail fast if nothing accepts TCP connections at the master address."""
    timeout = min(config.rpc_timeout_ms / 1000, 2.0)
    try:
        with socket.create_connection(
            (config.master_host, config.master_port), timeout=timeout
        ):
            pass
    except OSError as exc:
        reason = f"cannot connect to the master RPC port: {exc}"
        raise StoreUnavailable(
            config.master_server_address, None, reason
        ) from exc
