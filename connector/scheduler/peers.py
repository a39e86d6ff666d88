"""A sick peer is fenced as a peer, not key by key.

Every stored block lives in some instance's segment (its replicas'
``transport_endpoint``, ``"ip:port"``).  When a load fails or passes its
deadline, the peer it read from is sick (dead, hung, cut off), and so is
every other block it holds: asking for them one by one would cost one
failed load, or one deadline, per block.

`PeerFence` keeps the sick peers:

* `failed` (scheduler thread): a load's failed block hashes are queued;
  the lookup thread resolves them to the peer each get read from (one
  store call) and fences those peers.
* While any fence stands, each lookup batch also asks where its hit
  blocks live (one more store call, only then), and `clip` cuts each hit
  before the first block read from a fenced peer: the request is answered
  at once with the blocks before it, and computes the rest.
* Every `probe_s` one request is let through per fenced peer: its load
  is the probe.  `loaded` (scheduler thread) lifts the fence when a probe
  load succeeds; a failed probe renews it.
* A fence lapses after `ttl_s`: by then the master has dropped a dead
  peer's segment (its keys miss), or a hung one is probed again anyway.

Which replica a get reads is Mooncake's choice, not ours: a replica in the
reader's own segment, else the first complete memory replica the master
lists (`mooncake-store/include/replica_selection.h`).  The fence mirrors
that rule (`read_from`): a block whose read replica sits on a fenced peer
is cut even if another replica lives (the worker could read that one,
`StoreClient.read_replicas`, but the lookup does not count on it).

Thread-safe; no store or vLLM import: the lookup wraps a `Where`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:
    from connector.scheduler.lookup import BatchLookup

__all__ = ["FencedLookup", "PeerFence", "PeerStats", "Where", "read_from"]

Where = Callable[[Sequence[bytes]], list[tuple[str, ...]]]
"""Per block hash, the peer each shard's get reads it from ("": none)."""

MAX_QUEUED: Final = 4096
"""Most failed block hashes waiting to be resolved to their peers."""


def read_from(endpoints: Sequence[str], local: str = "") -> str:
    """The segment a get reads ("" when there is no replica).

    `local` if it holds a replica, else the first listed (Mooncake's rule).
    """
    if local and local in endpoints:
        return local
    return endpoints[0] if endpoints else ""


@attrs.frozen
class PeerStats:
    """Counters of a `PeerFence` (monotonic except `fenced`).

    Attributes:
        fenced: Peers fenced now.
        fences: Times a peer was fenced (a renewal counts again).
        lifted: Fences lifted by a probe load that succeeded.
        lapsed: Fences that ran out (`ttl_s`).
        probes: Requests let through to probe a fenced peer.
        clipped: Lookup answers the fence shortened.
        blocks_clipped: Blocks those answers lost.
    """

    fenced: int = 0
    fences: int = 0
    lifted: int = 0
    lapsed: int = 0
    probes: int = 0
    clipped: int = 0
    blocks_clipped: int = 0


@attrs.define
class _Fence:
    until: float
    probe_at: float


class PeerFence:
    """The fenced peers, their probes and their expiry.

    Args:
        ttl_s: How long a fence stands without a new failure (> 0).
        probe_s: How often one request probes a fenced peer (> 0).
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        *,
        ttl_s: float,
        probe_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (ttl_s > 0 and probe_s > 0):
            msg = f"ttl_s and probe_s must be positive: {ttl_s}, {probe_s}"
            raise ValueError(msg)
        self.ttl_s = ttl_s
        self.probe_s = probe_s
        self._clock = clock
        self._lock = threading.Lock()
        self._fences: dict[str, _Fence] = {}
        self._queued: list[bytes] = []
        self._probes: dict[bytes, tuple[str, ...]] = {}  # block -> peers
        self._counts = PeerStats()

    # -- scheduler thread ---------------------------------------------------

    def failed(self, hashes: Sequence[bytes]) -> None:
        """A load of these blocks failed: fence the peers they live on."""
        if not hashes:
            return
        with self._lock:
            room = MAX_QUEUED - len(self._queued)
            self._queued.extend(hashes[: max(room, 0)])
            for h in hashes:
                for peer in self._probes.pop(h, ()):  # a failed probe
                    self._fence(peer, self._clock())

    def loaded(self, hashes: Sequence[bytes]) -> None:
        """A load of these blocks succeeded: a probe's lifts its fence."""
        if not self._probes:
            return
        with self._lock:
            for h in hashes:
                for peer in self._probes.pop(h, ()):
                    if self._fences.pop(peer, None):
                        self._count(lifted=1)

    # -- lookup thread ------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a fence stands or failures wait to be resolved."""
        return bool(self._fences or self._queued)

    def fenced(self) -> frozenset[str]:
        """The peers fenced now."""
        with self._lock:
            self._expire(self._clock())
            return frozenset(self._fences)

    def resolve(self, where: Where) -> None:
        """Fence the peers of the failed blocks queued so far."""
        with self._lock:
            queued, self._queued = self._queued, []
        if not queued:
            return
        peers = {p for shards in where(queued) for p in shards if p}
        with self._lock:
            now = self._clock()
            for peer in peers:
                self._fence(peer, now)

    def clip(
        self,
        prefixes: Sequence[Sequence[bytes]],
        hits: Sequence[int],
        where: Where,
    ) -> list[int]:
        """Each hit cut before its first block read from a fenced peer.

        A peer due for a probe lets the first prefix that reaches it
        through (that request's load is the probe).
        """
        out = list(hits)
        with self._lock:
            self._expire(self._clock())
            if not self._fences:
                return out
        pairs = list(zip(prefixes, hits, strict=True))
        asked = list(dict.fromkeys(h for p, n in pairs for h in p[:n]))
        if not asked:
            return out
        peers = dict(zip(asked, where(asked), strict=True))
        with self._lock:
            now = self._clock()
            for i, (prefix, hit) in enumerate(pairs):
                probing: set[str] = set()  # this request probes them
                for j, block in enumerate(prefix[:hit]):
                    sick = [p for p in peers[block] if p in self._fences]
                    if not sick or probing.issuperset(sick):
                        continue
                    if self._probe(block, sick, now):
                        probing.update(sick)
                        continue
                    out[i] = j
                    self._count(clipped=1, blocks_clipped=hit - j)
                    break
        return out

    def stats(self) -> PeerStats:
        """A snapshot of the counters."""
        with self._lock:
            self._expire(self._clock())
            return attrs.evolve(self._counts, fenced=len(self._fences))

    # -- internals (lock held) ----------------------------------------------

    def _fence(self, peer: str, now: float) -> None:
        self._fences[peer] = _Fence(now + self.ttl_s, now + self.probe_s)
        self._count(fences=1)

    def _probe(self, block: bytes, sick: list[str], now: float) -> bool:
        """Let `block` through as the probe of its peers, if all are due."""
        fences = [self._fences[p] for p in sick]
        if any(f.probe_at > now for f in fences):
            return False
        for fence in fences:
            fence.probe_at = now + self.probe_s
        self._probes[block] = tuple(sick)
        self._count(probes=1)
        return True

    def _expire(self, now: float) -> None:
        for peer in [p for p, f in self._fences.items() if f.until <= now]:
            del self._fences[peer]
            self._count(lapsed=1)
        if not self._fences:
            self._probes.clear()

    def _count(self, **more: int) -> None:
        counts = self._counts
        self._counts = attrs.evolve(
            counts, **{k: getattr(counts, k) + v for k, v in more.items()}
        )


@attrs.frozen
class FencedLookup:
    """A batch lookup whose hits stop short of fenced peers.

    Attributes:
        inner: The store lookup (`hit_blocks_many`).
        fence: The fenced peers.
        where: Where each block's get would read it from.
    """

    inner: Any
    fence: PeerFence
    where: Where

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """One prefix's hit (see `hit_blocks_many`)."""
        return self.hit_blocks_many([block_hashes])[0]

    def hit_blocks_many(
        self, prefixes: Sequence[Sequence[bytes]]
    ) -> list[int]:
        """The inner hits; while a peer is fenced, clipped before it."""
        inner: BatchLookup = self.inner
        hits = inner.hit_blocks_many(prefixes)
        if not self.fence.busy:
            return hits
        self.fence.resolve(self.where)
        return self.fence.clip(prefixes, hits, self.where)
