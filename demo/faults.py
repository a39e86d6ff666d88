"""Faults a demo session injects into the store path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class LoadFault:
    """Wraps a worker's store: an armed `get` loses its last key first.

    The key is removed from the store right before the load reads it, as
    an eviction between lookup and load would: the store answers MISS,
    the load fails, and vLLM recomputes the block.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self.armed = 0
        self.injected = 0

    def get(self, keys: Sequence[str], regions: Any) -> Any:
        """Load `keys`; if armed, remove the last one first."""
        if self.armed > 0 and keys:
            self.armed -= 1
            self.injected += 1
            self._store.remove(list(keys[-1:]), force=True)
        return self._store.get(keys, regions)

    def put(self, keys: Sequence[str], regions: Any) -> Any:
        """Save `keys` unchanged."""
        return self._store.put(keys, regions)
