"""Per-operation counters of a ``StoreClient`` (read by a metrics layer).

``OpCounters`` counts one operation; ``StoreCounters`` holds one per
``Op`` behind a lock.  They are raw counters of the store client, named
apart from ``connector.integration.stats`` (the vLLM
``KVConnectorStats`` that a metrics layer builds from them).
"""

from __future__ import annotations

import collections
import threading
from typing import (
    Final,
)

import attrs

from connector.store.batch import BatchResult
from connector.store.codes import _SUCCESS, Op, Outcome

_LATENCY_SAMPLES: Final = 1024

FAULT_KINDS: Final = (
    "transfer",
    "metadata_missing",
    "metadata_restored",
    "metadata_stale",
)
"""What `StoreCounters.fault` counts: keys that failed although the
master answered (``transfer``), the client's own transfer-metadata
entries found missing from the metadata server and written back, and
registered regions its published descriptor did not list
(``connector.store.metadata``)."""


@attrs.define(slots=True)
class OpCounters:
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

    def copy(self) -> OpCounters:
        """An independent copy."""
        latencies: collections.deque[float] = collections.deque(
            self.latencies_s, maxlen=_LATENCY_SAMPLES
        )
        return OpCounters(
            self.ops,
            self.keys,
            self.bytes,
            dict(self.failures),
            self.short_circuited,
            latencies,
        )


class StoreCounters:
    """Thread-safe per-operation counters, read by a metrics layer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops = {op: OpCounters() for op in Op}
        self.breaker_trips = 0
        self.faults: dict[str, int] = {}
        """Cumulative fault counts by kind (`FAULT_KINDS`)."""
        self.fault_total = 0
        """Their sum (read lock-free to tell whether any changed)."""
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

    def fault(self, kind: str, count: int = 1) -> None:
        """Count ``count`` faults of ``kind`` (one of `FAULT_KINDS`)."""
        with self._lock:
            self.faults[kind] = self.faults.get(kind, 0) + count
            self.fault_total += count

    def faults_copy(self) -> dict[str, int]:
        """A copy of the cumulative fault counts."""
        with self._lock:
            return dict(self.faults)

    def trip(self) -> None:
        """Count one breaker trip."""
        with self._lock:
            self.breaker_trips += 1

    def snapshot(self, *, reset: bool = False) -> dict[Op, OpCounters]:
        """Copies of the counters; ``reset`` starts a new interval."""
        with self._lock:
            snap = {op: s.copy() for op, s in self._ops.items()}
            if reset:
                self._ops = {op: OpCounters() for op in Op}
                self._recorded = False
            return snap

    def __getitem__(self, op: Op) -> OpCounters:
        """A copy of one operation's counters."""
        with self._lock:
            return self._ops[op].copy()
