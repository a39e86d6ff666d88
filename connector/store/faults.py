"""A store that answers but cannot transfer: the outcomes, a bounded warning.

A master that answers while transfers fail (a peer's segment or
transfer metadata missing after a master restart, puts failing for want
of a mounted segment, gets failing by code) looks like a cold cache from
outside: every lookup misses and every request computes.  The store
client counts such keys (``StoreCounters.faults``, exported as
``vllm:kv_lifecycle_store_faults_total``) and logs them with
`RateLimitedWarning`: the first at once, then one summary per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Final

from connector.store.codes import Op, Outcome

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["FAULT_LOG_INTERVAL_S", "RateLimitedWarning", "transfer_faults"]

FAULT_LOG_INTERVAL_S: Final = 30.0
"""At most one warning per interval per kind and client."""

_TRANSFER: Final = frozenset(
    {Outcome.TRANSFER_FAILED, Outcome.INVALID, Outcome.OTHER}
)
_PUT: Final = _TRANSFER | {Outcome.STORE_FULL}


def transfer_faults(
    op: Op, outcomes: Iterable[Outcome], codes: Iterable[int]
) -> Counter[int]:
    """Codes of the keys that failed although the master answered.

    A get's, exists' or remove's MISS and an outage are not faults; for a
    put, a full store (``-200``, also what a master with no mounted
    segment answers) is.
    """
    faulty = _PUT if op is Op.PUT else _TRANSFER
    if faulty.isdisjoint(outcomes):  # misses only: no per-key loop
        return Counter()
    return Counter(
        code
        for outcome, code in zip(outcomes, codes, strict=True)
        if outcome in faulty
    )


class RateLimitedWarning:
    """Logs a kind of problem at most once per ``interval_s``.

    ``note`` counts occurrences; the first is logged at once, later ones
    are folded into the next warning once the interval has passed (with
    how many there were meanwhile).  Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = FAULT_LOG_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self.logged = 0

    def note(self, kind: str, count: int, message: str, *args: object) -> bool:
        """Count ``count`` occurrences of ``kind``; log if it is time.

        ``message % args`` is followed by how many occurrences the
        warning covers.  Returns whether it logged.
        """
        now = self._clock()
        with self._lock:
            held = self._held.get(kind, 0) + count
            if now < self._next.get(kind, 0.0):
                self._held[kind] = held
                return False
            self._held[kind] = 0
            self._next[kind] = now + self.interval_s
            self.logged += 1
        self._log.warning(
            message + " (%d since the previous warning; at most one every "
            "%.0f s)",
            *args,
            held,
            self.interval_s,
        )
        return True
