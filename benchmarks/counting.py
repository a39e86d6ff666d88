"""A store wrapper the benchmarks use to count what puts offer."""

from __future__ import annotations

from typing import Any


class CountingStore:
    """A worker's (or a rank's) store, counting the keys and bytes its
    puts offer; gets pass through."""

    def __init__(self, real: Any, object_bytes: int) -> None:
        self.real = real
        self.object_bytes = object_bytes
        self.bytes_put = 0
        self.keys_put = 0

    def put(self, keys: Any, regions: Any) -> Any:
        self.keys_put += len(keys)
        self.bytes_put += len(keys) * self.object_bytes
        return self.real.put(keys, regions)

    def get(self, keys: Any, regions: Any) -> Any:
        return self.real.get(keys, regions)
