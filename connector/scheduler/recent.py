"""Memory of what the store did not hold and what this instance saved.

An admission lookup costs the request a scheduling step: vLLM is told
"cannot tell yet" while the store is asked off the scheduler thread.
When the answer is already known, the step is wasted.  `RecentBlocks`
knows two things:

- **recent misses**: for each lookup that came back short, the block
  hash at its first miss.  A lookup's hit is the leading run of stored
  blocks, so a prompt with a recent miss among the blocks up to its
  first loadable one (the first past vLLM's local hit) cannot load a
  block: it is answered "0 external tokens" at once.  A miss is
  forgotten after `ttl_s`, oldest first beyond `capacity`, and as soon
  as this instance saves or loads the block (then the store may hold
  it: ask);
- **own saves**: the block hashes this instance saved (or loaded) most
  recently, so a request served from vLLM's local prefix cache does not
  save them again.  Bounded by `capacity`; it only ever skips a save.

Either memory may be stale: another instance can save a remembered
miss, and the store can evict a remembered save.  A stale miss costs a
miss (the request computes what it could have loaded), a stale save a
block not saved again; neither ever makes a hit, so neither can serve
wrong KV.

Scheduler thread only; no vLLM or store import.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

__all__ = ["DEFAULT_MISS_TTL_S", "DEFAULT_RECENT_CAPACITY", "RecentBlocks"]

#: How long a miss is trusted: long enough to cover a burst and the
#: steps its requests wait, short against another instance saving the
#: same prefix.
DEFAULT_MISS_TTL_S: Final = 1.0
DEFAULT_RECENT_CAPACITY: Final = 65_536


class RecentBlocks:
    """Bounded memories of recent misses (expiring) and own saves.

    Args:
        ttl_s: How long a remembered miss is trusted.
        capacity: Most entries of each memory (oldest dropped first).
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_MISS_TTL_S,
        capacity: int = DEFAULT_RECENT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or capacity <= 0:
            msg = f"ttl_s and capacity must be positive: {ttl_s}, {capacity}"
            raise ValueError(msg)
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.clock = clock
        # hash -> when the miss stops being trusted; oldest first.
        self._misses: collections.OrderedDict[bytes, float] = (
            collections.OrderedDict()
        )
        self._saved: collections.OrderedDict[bytes, None] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        """Misses and saves remembered (expired misses included)."""
        return len(self._misses) + len(self._saved)

    def clear(self) -> None:
        """Forget every miss and save (the keys they were about changed)."""
        self._misses.clear()
        self._saved.clear()

    # -- misses ---------------------------------------------------------------

    def missed(self, block_hash: bytes) -> None:
        """A lookup found `block_hash` absent (its first miss)."""
        misses = self._misses
        misses[block_hash] = self.clock() + self.ttl_s
        misses.move_to_end(block_hash)
        if len(misses) > self.capacity:
            misses.popitem(last=False)

    def absent(self, block_hash: bytes) -> bool:
        """Whether `block_hash` missed within `ttl_s`, not saved since."""
        until = self._misses.get(block_hash)
        if until is None:
            return False
        if until > self.clock():
            return True
        del self._misses[block_hash]
        return False

    def cuts(self, block_hashes: Sequence[bytes]) -> bool:
        """Whether a block of `block_hashes` is a recent miss.

        A lookup's hit is the leading run of stored blocks, so a hit of a
        prefix cannot reach past a block in it that is absent.  One dict
        lookup per block; none while nothing is remembered.
        """
        misses = self._misses
        if not misses:
            return False
        now = None
        for h in block_hashes:  # `absent`, inline (once per ask)
            until = misses.get(h)
            if until is None:
                continue
            if now is None:
                now = self.clock()
            if until > now:
                return True
            del misses[h]
        return False

    # -- own saves ------------------------------------------------------------

    def saving(self, block_hashes: Iterable[bytes]) -> None:
        """This instance is saving these blocks: no longer misses."""
        misses = self._misses
        if misses:
            for h in block_hashes:
                misses.pop(h, None)

    def saved(self, block_hashes: Sequence[bytes]) -> None:
        """The store now holds these blocks (a save or a load succeeded)."""
        misses, saved = self._misses, self._saved
        if misses:
            for h in block_hashes:
                misses.pop(h, None)
        before = len(saved)
        saved.update(dict.fromkeys(block_hashes))
        if len(saved) - before != len(block_hashes):
            # Some were remembered already: they are the newest now.
            for h in block_hashes:
                saved.move_to_end(h)
        while len(saved) > self.capacity:
            saved.popitem(last=False)

    def saved_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of `block_hashes` this instance saved recently."""
        saved = self._saved
        for i, h in enumerate(block_hashes):
            if h not in saved:
                return i
        return len(block_hashes)
