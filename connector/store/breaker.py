"""``CircuitBreaker``: stops calling a master known to be unreachable."""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import (
    TYPE_CHECKING,
)

if TYPE_CHECKING:
    from collections.abc import Callable


log = logging.getLogger(__name__)


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
