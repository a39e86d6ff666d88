"""Memory of blocks whose load failed, until the master forgets them.

When the instance that owns a stored block dies, Mooncake's master keeps
answering "exists" for the block's key for about ``client_ttl`` + 1 s
while every get of it fails (``-800``).  Without a memory, every request
that looks the prefix up in that window is told "hit", allocates, loads,
fails and recomputes.  `FailedKeys` remembers the block hashes whose load
failed, and `clip` cuts a lookup's hit before the first remembered block,
so each instance pays one failed load per dead block, not one per
request.

A failed load is learned only when it ends, and after a peer's death a
get of its blocks takes about a second to fail over TCP (the transfer
engine's reconnect attempts), so requests arriving meanwhile would each
load too.  The memory therefore also tracks loads in flight
(`loading` / `loaded`): `clip` answers None while a block of the hit is
being loaded by another request, and the caller asks again next step
(vLLM's "lookup not determined yet").  One load per block is in flight
per instance; when it succeeds, the waiting request hits the blocks in
vLLM's own prefix cache or loads them; when it fails, it is clipped.
A load in flight for longer than `max_wait_s` is suspect: `clip` cuts
the hit before its blocks (recompute now) instead of waiting for it; one
in flight for `ttl_s` (it never ended) is forgotten.

An entry is forgotten:

- when a lookup shows the master no longer holds the key (the block at
  the lookup's first miss is remembered: the master dropped it, so a
  fresh save of it can be served again);
- after `ttl_s` seconds (a bound, for keys no lookup reaches again and
  for a transient failure of a block that is still fine);
- oldest first, beyond `capacity` entries.

Thread-safe; holds no vLLM or Mooncake import.  The memory only ever
lowers a hit, so it can cost a load that would have succeeded, never
serve wrong KV.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Final

import attrs

from connector.config import DEFAULT_FAILED_LOAD_TTL_S

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable, Sequence

    from connector.scheduler.peers import PeerFence

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_TTL_S", "FailedKeys", "FailedStats"]

DEFAULT_TTL_S: Final = DEFAULT_FAILED_LOAD_TTL_S
"""Mooncake's default ``client_ttl`` (10 s) plus the ~1 s the master
takes to drop a dead client's keys, plus margin (the default of the
``failed_load_ttl_s`` key)."""
DEFAULT_CAPACITY: Final = 65_536
DEFAULT_MAX_WAIT_S: Final = 0.5
"""A healthy load of a prefix takes milliseconds to a few hundred (TCP);
one against a dead peer about a second."""


@attrs.frozen
class FailedStats:
    """Counters of a `FailedKeys`, monotonic except `size`.

    Attributes:
        recorded: Keys recorded as failed (a repeat counts again).
        clipped: Lookups whose hit the memory shortened.
        blocks_clipped: Blocks those lookups lost.
        forgotten: Entries dropped because the master forgot the key.
        expired: Entries dropped after `ttl_s`.
        evicted: Entries dropped beyond `capacity`.
        deferred: Lookups answered None (a block's load in flight).
        slow: Lookups cut before a block loading for over `max_wait_s`.
        size: Entries held now.
        in_flight: Blocks being loaded now.
    """

    recorded: int = 0
    clipped: int = 0
    blocks_clipped: int = 0
    forgotten: int = 0
    expired: int = 0
    evicted: int = 0
    deferred: int = 0
    slow: int = 0
    size: int = 0
    in_flight: int = 0


class FailedKeys:
    """A bounded, time-expiring set of keys whose load failed.

    Args:
        ttl_s: How long an entry lives at most (> 0).
        capacity: Most entries held (> 0); the oldest go first.
        max_wait_s: How long a load in flight defers other lookups.
        clock: Monotonic seconds (tests pass a fake).
        peers: Told of every load's end too, to fence the peer of a
            failed one (`connector.scheduler.peers`).

    Raises:
        ValueError: `ttl_s` or `capacity` not positive.
    """

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        capacity: int = DEFAULT_CAPACITY,
        *,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        peers: PeerFence | None = None,
    ) -> None:
        if not ttl_s > 0:
            msg = f"ttl_s must be positive, got {ttl_s!r}"
            raise ValueError(msg)
        if capacity <= 0:
            msg = f"capacity must be positive, got {capacity!r}"
            raise ValueError(msg)
        self.ttl_s = float(ttl_s)
        self.capacity = capacity
        self.max_wait_s = max_wait_s
        self._clock = clock
        self.peers = peers
        # key -> (loads in flight, when the oldest began)
        self._loading: dict[Hashable, tuple[int, float]] = {}
        self._deferred = 0
        self._slow = 0
        self._lock = threading.Lock()
        # key -> expiry; insertion order is expiry order (one ttl for all).
        self._until: collections.OrderedDict[Hashable, float] = (
            collections.OrderedDict()
        )
        self._recorded = 0
        self._clipped = 0
        self._blocks_clipped = 0
        self._forgotten = 0
        self._expired = 0
        self._evicted = 0

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._until)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            self._expire(self._clock())
            return key in self._until

    def record(self, keys: Iterable[Hashable]) -> None:
        """Remember `keys` as failed from now for `ttl_s` (refreshes)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            until = now + self.ttl_s
            for key in keys:
                self._recorded += 1
                if key in self._until:
                    del self._until[key]
                self._until[key] = until
            while len(self._until) > self.capacity:
                self._until.popitem(last=False)
                self._evicted += 1

    def loading(self, keys: Iterable[Hashable]) -> None:
        """A load of `keys` was issued (pair with `loaded`)."""
        with self._lock:
            now = self._clock()
            for key in keys:
                count, since = self._loading.get(key, (0, now))
                self._loading[key] = (count + 1, since)

    def loaded(
        self, keys: Iterable[Hashable], failed: Iterable[Hashable] = ()
    ) -> None:
        """A load of `keys` ended; remember those of them that `failed`."""
        keys, failed = list(keys), list(failed)
        with self._lock:
            for key in keys:
                count, since = self._loading.pop(key, (0, 0.0))
                if count > 1:
                    self._loading[key] = (count - 1, since)
        if failed:
            self.record(failed)
        if self.peers is not None:
            if failed:
                self.peers.failed(failed)  # type: ignore[arg-type]
            else:
                self.peers.loaded(keys)  # type: ignore[arg-type]

    def clip(self, keys: Sequence[Hashable], found: int) -> int | None:
        """The lookup's hit with remembered failures cut off.

        `keys` are the keys asked, in prefix order; the store said the
        first `found` of them exist.  Returns the number of leading keys
        up to the first remembered one, or the first one whose load has
        been in flight for `max_wait_s` (at most `found`), or None while
        one of those is being loaded more briefly (ask again later).  If
        none of them is remembered and the key at `found` (the lookup's
        first miss) is, the master has forgotten it: so is the entry.
        """
        found = max(0, min(found, len(keys)))
        if not self._until and not self._loading:
            return found  # nothing remembered, nothing loading
        with self._lock:
            now = self._clock()
            self._expire(now)
            for i in range(found):
                key = keys[i]
                if key in self._until:
                    self._clipped += 1
                    self._blocks_clipped += found - i
                    return i
                loading = self._loading.get(key)
                if loading is None:
                    continue
                if now - loading[1] >= self.ttl_s:  # never ended: drop it
                    del self._loading[key]
                    continue
                if now - loading[1] < self.max_wait_s:
                    self._deferred += 1
                    return None
                self._slow += 1
                return i
            if found < len(keys) and keys[found] in self._until:
                del self._until[keys[found]]
                self._forgotten += 1
            return found

    def stats(self) -> FailedStats:
        """A snapshot of the counters."""
        with self._lock:
            self._expire(self._clock())
            return FailedStats(
                recorded=self._recorded,
                clipped=self._clipped,
                blocks_clipped=self._blocks_clipped,
                forgotten=self._forgotten,
                expired=self._expired,
                evicted=self._evicted,
                deferred=self._deferred,
                slow=self._slow,
                size=len(self._until),
                in_flight=len(self._loading),
            )

    def _expire(self, now: float) -> None:
        until = self._until
        while until:
            key, deadline = next(iter(until.items()))
            if deadline > now:
                return
            del until[key]
            self._expired += 1
