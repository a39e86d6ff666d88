"""The worker's own memory of peers whose gets just failed.

After a peer dies, Mooncake's TCP transport fails the first gets of its
blocks within milliseconds (connection refused) and every later one only
after a 1 s reconnect cooldown; loads are served one after another, so a
queue of loads from the dead peer costs about a second each.  The
scheduler half fences the peer for lookups (`connector.scheduler.peers`),
but loads issued before it learned of the failure are already queued.

`SickPeerStore` wraps the store the worker loads through: when a get
fails with a transfer failure, it asks the master where those keys live
(`replica_endpoints`) and marks the peer each was read from as sick for
`hold_s`; while a peer is sick, a get first asks where its keys live and
fails the keys read from a sick peer at once, without a transfer.  After
`hold_s` the next get tries the peer again (a probe).  Saves pass
through.  No vLLM import.

With a store that reads other replicas (`StoreClient.read_replicas`, on
a transfer engine of its own), a key read from a sick peer is read from
another live replica instead of failing, and a get never retries a key
on a sick peer (`avoid`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

__all__ = ["SickPeerStore"]

_FAILED: Final = "transfer_failed"


@attrs.frozen
class _Skipped:
    """A get's per-key success, some keys failed without a transfer."""

    succeeded: list[bool]


class SickPeerStore:
    """A store whose gets skip peers that just failed.

    Args:
        store: The store client (`get`, `put`, `replica_endpoints`,
            `hostname`).
        hold_s: How long a failed peer is skipped (> 0).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        store: Any,
        *,
        hold_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sick: dict[str, float] = {}  # peer -> until
        self._local = str(getattr(store, "hostname", "") or "")
        #: Keys failed without a transfer because their peer was sick.
        self.skipped = 0

    def put(self, keys: Sequence[str], regions: Any) -> Any:
        """The store's put."""
        return self._store.put(keys, regions)

    def local_reads(self, keys: Sequence[str]) -> list[bool]:
        """The store's ``local_reads`` (all False if it has none)."""
        ask = getattr(self._store, "local_reads", None)
        return list(ask(keys)) if ask is not None else [False] * len(keys)

    def get(self, keys: Sequence[str], regions: Any) -> Any:
        """The store's get, minus the keys read from a sick peer.

        Those are read from another live replica when the store can.
        """
        skip = self._skip(keys)
        replicas = getattr(self._store, "read_replicas", None)
        if not any(skip):
            result = self._get(keys, regions, replicas is not None)
            self._learn(keys, result)
            return result
        keep = [i for i, s in enumerate(skip) if not s]
        flags = [False] * len(keys)
        with self._lock:
            self.skipped += len(keys) - len(keep)
        if keep:
            sub = [keys[i] for i in keep]
            result = self._get(sub, regions.select(keep), replicas is not None)
            self._learn(sub, result)
            for i, ok in zip(keep, result.succeeded, strict=True):
                flags[i] = ok
        if replicas is not None:
            moved = [i for i, s in enumerate(skip) if s]
            result = replicas(
                [keys[i] for i in moved],
                regions.select(moved),
                avoid=self.sick(),
            )
            for i, ok in zip(moved, result.succeeded, strict=True):
                flags[i] = ok
        return _Skipped(flags)

    @property
    def reads_spans(self) -> bool:
        """The store's ``reads_spans`` (False if it has none)."""
        return bool(getattr(self._store, "reads_spans", False))

    def get_spans(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        spans: Sequence[tuple[int, int]],
        landed: Callable[[int, list[bool]], bool] | None = None,
    ) -> Any:
        """The store's ``get_spans``, minus the keys read from a sick peer.

        Those fail at once (no other replica is read in spans: their
        blocks are recomputed); `landed` sees them failed.
        """
        skip = self._skip(keys)
        keep = [i for i, s in enumerate(skip) if not s]
        flags = [False] * len(keys)
        with self._lock:
            self.skipped += len(keys) - len(keep)
        if not keep:
            return _Skipped(flags)
        sub = [keys[i] for i in keep]

        def widen(index: int, ok: list[bool]) -> bool:
            full = [False] * len(keys)
            for i, good in zip(keep, ok, strict=True):
                full[i] = good
            return landed(index, full) if landed is not None else True

        result = self._store.get_spans(
            sub, [ptrs[i] for i in keep], spans, widen
        )
        self._learn(sub, result)
        for i, ok in zip(keep, result.succeeded, strict=True):
            flags[i] = ok
        return _Skipped(flags)

    def _get(self, keys: Sequence[str], regions: Any, avoid: bool) -> Any:  # noqa: FBT001
        if avoid:
            return self._store.get(keys, regions, avoid=self.sick())
        return self._store.get(keys, regions)

    def sick(self) -> frozenset[str]:
        """The peers skipped now."""
        with self._lock:
            self._expire(self._clock())
            return frozenset(self._sick)

    def _skip(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._expire(self._clock())
            if not self._sick:
                return [False] * len(keys)
        peers = self._read_from(keys)
        with self._lock:
            return [p in self._sick for p in peers]

    def _learn(self, keys: Sequence[str], result: Any) -> None:
        """Mark the peers of keys whose transfer failed.

        Those of keys then read from another replica come with the
        result (`failed_segments`).
        """
        outcomes = getattr(result, "outcomes", None)
        if not outcomes:
            return
        failed = [
            k
            for k, o in zip(keys, outcomes, strict=False)
            if getattr(o, "value", o) == _FAILED
        ]
        peers = set(getattr(result, "failed_segments", ()))
        if failed:
            peers.update(self._read_from(failed))
        local = self._local
        peers = {p for p in peers if p and p != local}
        if not peers:
            return
        with self._lock:
            until = self._clock() + self.hold_s
            for peer in peers:
                self._sick[peer] = until

    def _read_from(self, keys: Sequence[str]) -> list[str]:
        """The peer each key's get reads (a local replica first)."""
        ask = getattr(self._store, "replica_endpoints", None)
        if ask is None:
            return [""] * len(keys)
        local = self._local
        return [
            local if local and local in found else (found[0] if found else "")
            for found in ask(list(keys))
        ]

    def _expire(self, now: float) -> None:
        for peer in [p for p, t in self._sick.items() if t <= now]:
            del self._sick[peer]
