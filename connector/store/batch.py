"""``BatchResult``: what one batch call did, key by key."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import (
    TYPE_CHECKING,
    overload,
)

import attrs

from connector.store.codes import _OUTAGE, _SUCCESS, Op, Outcome, _num_ok

if TYPE_CHECKING:
    from collections.abc import Iterator


@attrs.define(slots=True, eq=False)
class BatchResult(Sequence[Outcome]):
    """The per-key outcomes of one batch call, in key order.

    A ``Sequence[Outcome]`` (index, iterate, ``len``, ``count``), plus the
    raw Mooncake codes and summary helpers. Treat it as immutable (not
    ``frozen`` only to keep the per-call cost down).

    Attributes:
        op: which operation.
        outcomes: one ``Outcome`` per key.
        codes: one raw Mooncake code per key (bytes read for a get,
            ``1``/``0`` for exists, synthetic ``-900`` when the breaker
            short-circuited, ``1`` for a put skipped as already present).
        nbytes: bytes moved by this call (written or read).
        elapsed_s: wall time of the call.
        short_circuited: nothing was sent: the breaker was open.
        num_failed: keys that did not succeed (``-1``: not counted yet).
        failed_segments: segments a get's transfer failed on, for keys
            then read again from another replica (empty otherwise).
    """

    op: Op
    outcomes: list[Outcome]
    codes: list[int]
    nbytes: int = 0
    elapsed_s: float = 0.0
    short_circuited: bool = False
    num_failed: int = -1
    failed_segments: frozenset[str] = frozenset()

    @overload
    def __getitem__(self, index: int) -> Outcome: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Outcome]: ...
    def __getitem__(self, index: int | slice) -> Outcome | Sequence[Outcome]:
        return self.outcomes[index]

    def __len__(self) -> int:
        return len(self.outcomes)

    def __iter__(self) -> Iterator[Outcome]:
        return iter(self.outcomes)

    def __repr__(self) -> str:
        counts = ", ".join(f"{o.name}={n}" for o, n in self.counts().items())
        return (
            f"<BatchResult {self.op.value} {len(self)} keys: {counts}; "
            f"{self.nbytes} B in {self.elapsed_s * 1e3:.3f} ms"
            f"{' (short-circuited)' if self.short_circuited else ''}>"
        )

    @property
    def ok(self) -> bool:
        """Whether every key succeeded."""
        if self.num_failed >= 0:
            return self.num_failed == 0
        return _num_ok(self.outcomes) == len(self.outcomes)

    @property
    def succeeded(self) -> list[bool]:
        """Per key, whether it succeeded."""
        return [o in _SUCCESS for o in self.outcomes]

    @property
    def num_ok(self) -> int:
        """How many keys succeeded."""
        return _num_ok(self.outcomes)

    @property
    def hit_prefix(self) -> int:
        """Length of the leading run of HITs (longest cached prefix)."""
        for index, outcome in enumerate(self.outcomes):
            if outcome is not Outcome.HIT:
                return index
        return len(self.outcomes)

    @property
    def back_pressure(self) -> bool:
        """Whether some key got STORE_FULL (skip or retry the save)."""
        return Outcome.STORE_FULL in self.outcomes

    @property
    def unavailable(self) -> bool:
        """Whether some key failed because the master was out of reach."""
        return any(o in _OUTAGE for o in self.outcomes)

    def counts(self) -> dict[Outcome, int]:
        """How many keys got each outcome (only outcomes that occurred)."""
        return dict(collections.Counter(self.outcomes))

    def failures(self) -> list[tuple[int, Outcome, int]]:
        """``(index, outcome, code)`` of every key that did not succeed."""
        return [
            (i, o, c)
            for i, (o, c) in enumerate(
                zip(self.outcomes, self.codes, strict=True)
            )
            if o not in _SUCCESS
        ]


# -- stats --------------------------------------------------------------------
