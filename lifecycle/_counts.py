"""A read-only live view of a machine's counters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TypeVar

K = TypeVar("K")


class Counts(Mapping[K, int]):
    """A read-only view of a `Counter`: missing keys read 0.

    Live (it follows the machine's counter); copy it (``dict(view)``) or
    use the machine's ``*_counts()`` methods for a consistent snapshot.
    """

    __slots__ = ("_counter",)

    def __init__(self, counter: Counter[K]) -> None:
        self._counter = counter

    def __getitem__(self, key: K) -> int:
        return self._counter[key]

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._counter))

    def __len__(self) -> int:
        return len(self._counter)

    def __repr__(self) -> str:
        return f"Counts({dict(self._counter)!r})"

    def total(self) -> int:
        """The sum of every count."""
        return sum(self._counter.values())
