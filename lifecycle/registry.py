"""The caller's map from request id to tracker, with the lifecycle policy.

A connector keeps exactly one `Registry` per lifecycle: it is the only
per-request (or per-resource) map.  Events for unknown ids get the same
policy as illegal orderings (counted, logged at a bounded rate, raised in
strict mode), and a tracker is dropped the moment it reaches a terminal
state, so finished requests leave nothing behind.

Firing: `Registry.fire` by id, `Registry.fire_on` with the tracker in hand
(the fast path, same policy), `Registry.fire_if_tracked` for a completion
that may legitimately outlive its request.

Identity: a key (any hashable: a request id, a block hash) names one
tracker at a time.  When a key is reused after its tracker ended, the new
tracker's epoch continues above the old one's, so a completion issued for
the earlier incarnation is stale, never applied to the new one.

Threads: over a thread-safe machine (the default), every method may be
called from any thread.  Transitions are serialised by the machine's
lock; creating and dropping trackers are atomic, so two threads never get
two trackers for one key.  Over a machine built with ``thread_safe=False``
the registry is as single-threaded as its machine: it takes no lock, and
every call must come from the one thread that fires its events, or be
made under the lock the machine shares (`lifecycle.atomic`).

Cyclic tables (no terminal state): ``retire_at=`` names the idle states
where a tracker is dropped as if it ended, so the registry stays bounded
by the trackers in use; the key's epochs stay monotonic (above).
"""

from __future__ import annotations

import collections
import enum
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Generic,
    Never,
    Protocol,
    overload,
)

import attrs

from lifecycle._generic import Padded
from lifecycle.machine import ILLEGAL, LifecycleMachine, Outcome
from lifecycle.table import Table
from lifecycle.tracker import (
    Tracker,
    check_tracker_class,
    compiled_factory,
)

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    D = TypeVar("D", contravariant=True, default=Never)  # noqa: PLC0105
    # The key type: ``str`` unless the factory takes another.
    K = TypeVar("K", contravariant=True, default=str)  # noqa: PLC0105
else:
    from typing import TypeVar

    D = TypeVar("D", contravariant=True)  # noqa: PLC0105
    K = TypeVar("K", contravariant=True)  # noqa: PLC0105

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T", bound=Tracker[Any, Any])
T_co = TypeVar("T_co", covariant=True)
K_contra = TypeVar("K_contra", contravariant=True)


class TrackerFactory(Protocol[T_co]):
    """Builds the tracker of a new key, in the table's initial state."""

    def __call__(self, req_id: Any, /) -> T_co:
        """A new tracker for `req_id`."""


class _KeyedFactory(Protocol[K_contra, T_co]):
    """A `TrackerFactory` that says its key type."""

    def __call__(self, req_id: K_contra, /) -> T_co: ...


RETIRED_KEYS: Final = 16_384
"""Ended keys whose last epoch a registry remembers individually."""


class Registry(Padded, Generic[S, E, T, D, K]):
    """Live trackers by key, all driven by one shared machine.

    Args:
        machine: The shared lifecycle machine.
        factory: Builds a tracker for a new key, in the table's initial
            state: usually the tracker class itself.  The base `Tracker`
            class is accepted too: its trackers start in the table's
            initial state.
        continue_epochs: Start the tracker of a reused key above its
            predecessor's epoch (the default), so that predecessor's
            completions are stale.  False restarts at 0 and remembers
            nothing of ended keys: only for a registry that mirrors
            another one's epochs (it learns them from the jobs it is
            given), or whose late events reach an ended tracker through
            the tracker object itself, never through its key.
        retire_at: States of a cyclic table (``terminal=()``) where a
            tracker is *idle*: reaching one drops it like a terminal
            state, so the registry holds only trackers in use (bounded
            by them, not by every key ever seen).  The key's next
            tracker starts in the initial state at an epoch above the
            retired one's (completions for the old one are stale), so
            each such state must be the initial state or accept the same
            rows (event, guard, destination) as it does.  A caller still
            holding the retired tracker must get the key's live one with
            `get_or_create` before firing again.

    Raises:
        ValueError: a `retire_at` state is terminal, not a state of the
            table, or not equivalent to the initial state.
        TypeError: the factory is a tracker class that would be slow or
            compare by value (see `lifecycle.define_tracker`), or whose
            default state is not the table's initial state; for other
            factories, at the first tracker that is.
    """

    _defaults = (Any, Any)  # D and K have defaults (see `Padded`)
    __slots__ = (
        "_checked",
        "_continue",
        "_factory",
        "_fire",
        "_floor",
        "_lock",
        "_retired",
        "_terminal",
        "_trackers",
        "machine",
    )

    @overload
    def __init__(
        self,
        machine: LifecycleMachine[S, E, T, D],
        factory: _KeyedFactory[K, T],
        *,
        continue_epochs: bool = True,
        retire_at: Iterable[S] = (),
    ) -> None: ...

    @overload
    def __init__(
        self,
        machine: LifecycleMachine[S, E, T, D],
        factory: Callable[[K, S], T],
        *,
        continue_epochs: bool = True,
        retire_at: Iterable[S] = (),
    ) -> None: ...

    def __init__(
        self,
        machine: LifecycleMachine[S, E, Any, D],
        factory: Any,
        *,
        continue_epochs: bool = True,
        retire_at: Iterable[S] = (),
    ) -> None:
        self.machine = machine
        self._continue = continue_epochs
        """The shared machine (its table, counters and observers)."""
        table = machine.table
        self._trackers: dict[K, T] = {}
        # Oldest first; an OrderedDict pops its oldest in O(1) (a dict
        # scans the holes its earlier pops left at the front).
        self._retired: collections.OrderedDict[K, int] = (
            collections.OrderedDict()
        )
        self._floor = 0
        # One lock per lifecycle; none where one thread owns the machine.
        self._lock = machine._lock if machine.thread_safe else None  # noqa: SLF001
        self._fire = machine.fire
        # A tuple: `in` compares by identity first (no Enum.__hash__).
        # Idle states of a cyclic table end a tracker the same way.
        self._terminal: tuple[S, ...] = (
            *table.terminal,
            *_retire_states(table, retire_at),
        )
        self._checked: type | None = None
        if isinstance(factory, type):
            check_tracker_class(factory)
            self._checked = factory
            default = attrs.fields(factory).state.default
            if default is attrs.NOTHING:
                initial = table.initial
                cls = factory

                def at_initial(req_id: Hashable) -> Any:
                    return cls(req_id, initial)

                factory = at_initial
            elif default is not table.initial:
                raise TypeError(_wrong_start(factory, default, table.name))
            else:
                # The class's own constructor, less re-validating its
                # defaults at every tracker.
                factory = compiled_factory(factory) or factory
        self._factory: TrackerFactory[T] = factory

    def __repr__(self) -> str:
        return f"Registry({self.machine.table.name!r}, {len(self)} live)"

    def get(self, req_id: K) -> T | None:
        """The live tracker for `req_id`, or None."""
        return self._trackers.get(req_id)

    def get_or_create(self, req_id: K) -> T:
        """The live tracker for `req_id`, created in the initial state.

        A new tracker for a key whose earlier tracker ended starts at an
        epoch above every epoch of that earlier one.
        """
        tracker = self._trackers.get(req_id)
        if tracker is None:
            if self._lock is None:  # one thread: no race to re-check
                return self._add(req_id)
            tracker = self._create(req_id)
        return tracker

    def _create(self, req_id: K) -> T:
        if self._lock is None:
            return self._add(req_id)
        with self._lock:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                return tracker  # another thread created it meanwhile
            return self._add(req_id)

    def _add(self, req_id: K) -> T:
        """Create and register the tracker of a key not tracked now."""
        tracker = self._factory(req_id)
        if type(tracker) is not self._checked:
            self._check(tracker)
        if self._continue:
            start = self._retired.pop(req_id, self._floor)
            if start:
                tracker.epoch = start
        self._trackers[req_id] = tracker
        return tracker

    def _check(self, tracker: T) -> None:
        check_tracker_class(type(tracker))
        table = self.machine.table
        if tracker.state is not table.initial:
            raise TypeError(
                _wrong_start(type(tracker), tracker.state, table.name)
            )
        self._checked = type(tracker)

    def fire(
        self,
        req_id: K,
        event: E,
        *,
        epoch: int | None = None,
        data: D | None = None,
        known: bool | None = None,
    ) -> bool:
        """Fire `event` on the tracker of `req_id`; drop it if it ended.

        An id the registry does not track is an illegal ordering (the
        policy applies: counted, logged, `UnknownRequest` in strict mode);
        see `fire_if_tracked` for events that may arrive after the end.

        Args:
            req_id: The key.
            event: The event.
            epoch: The epoch of the transfer job reporting, if any.
            data: Passed to the guards and callbacks the event runs.
            known: Deprecated: ``known=False`` is `fire_if_tracked`.

        Returns:
            Whether a transition applied.
        """
        if known is not None:
            warnings.warn(
                "Registry.fire(known=...) is deprecated: use "
                "Registry.fire_if_tracked for events that may arrive "
                "after the tracker ended",
                DeprecationWarning,
                stacklevel=2,
            )
        tracker = self._trackers.get(req_id)
        if tracker is None:
            if known is False:
                return False
            return self.machine.unknown(req_id, event)
        return self.fire_on(tracker, event, epoch=epoch, data=data)

    def fire_if_tracked(
        self,
        req_id: K,
        event: E,
        *,
        epoch: int | None = None,
        data: D | None = None,
    ) -> bool:
        """`fire`, but an untracked id is silently ignored (returns False).

        For completions that may normally outlive their tracker (a save
        finishing after its request ended).
        """
        tracker = self._trackers.get(req_id)
        if tracker is None:
            return False
        return self.fire_on(tracker, event, epoch=epoch, data=data)

    def fire_on(
        self,
        tracker: T,
        event: E,
        *,
        epoch: int | None = None,
        data: D | None = None,
    ) -> bool:
        """Fire `event` on `tracker`; drop it from the registry if it ended.

        The fast path of `fire` for a caller holding the tracker.  "Ended"
        means a state in the table's ``terminal`` set.
        """
        applied = self._fire(tracker, event, epoch=epoch, data=data)
        if applied and tracker.state in self._terminal:
            if self._lock is None:
                self._remove(tracker)
            else:
                self._drop(tracker)
        return applied

    def fire_outcome(
        self,
        req_id: K,
        event: E,
        *,
        epoch: int | None = None,
        data: D | None = None,
    ) -> Outcome[S, E]:
        """`fire`, returning the `Outcome` (`LifecycleMachine.fire_outcome`).

        An untracked id is an illegal ordering (the policy applies):
        ``Outcome(ILLEGAL, None, None)``.  A tracker that ended is dropped.
        """
        tracker = self._trackers.get(req_id)
        if tracker is None:
            self.machine.unknown(req_id, event)
            return Outcome(ILLEGAL, None, None)
        outcome = self.machine.fire_outcome(
            tracker, event, epoch=epoch, data=data
        )
        if outcome and tracker.state in self._terminal:
            self._drop(tracker)
        return outcome

    def _drop(self, tracker: T) -> None:
        if self._lock is None:
            self._remove(tracker)
            return
        with self._lock:
            self._remove(tracker)

    def _remove(self, tracker: T) -> None:
        """Forget `tracker`, remembering its epoch for its key's reuse."""
        key = tracker.req_id
        if self._trackers.get(key) is tracker:
            del self._trackers[key]
        if not self._continue:
            return
        retired = self._retired
        last = retired.get(key, 0)
        retired[key] = tracker.epoch + 1 if tracker.epoch >= last else last
        if len(retired) > RETIRED_KEYS:
            _, oldest = retired.popitem(last=False)
            self._floor = max(self._floor, oldest)

    def discard(self, req_id: K) -> T | None:
        """Forget `req_id` without an event (e.g. at shutdown)."""
        tracker = self._trackers.get(req_id)
        if tracker is not None:
            self._drop(tracker)
        return tracker

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._trackers

    def __len__(self) -> int:
        return len(self._trackers)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._trackers.values()))


def _retire_states(table: Table[S, Any, Any], given: Iterable[S]) -> list[S]:
    """`given` checked as `Registry`'s ``retire_at`` states."""
    states = list(dict.fromkeys(given))

    def rows(state: S) -> set[tuple[object, object, object]]:
        return {
            (r.event, r.guard, r.dest) for r in table.rows if r.source is state
        }

    start = rows(table.initial)
    for state in states:
        why = (
            "is not a state of the table"
            if state not in table.states
            else "is terminal (its trackers are dropped anyway)"
            if state in table.terminal
            else ""
            if state is table.initial or rows(state) == start
            else (
                f"accepts other rows than the initial state "
                f"{table.initial.name} (a retired key restarts there)"
            )
        )
        if why:
            msg = f"retire_at state {state!r} of table {table.name!r} {why}"
            raise ValueError(msg)
    return states


def _wrong_start(cls: type, state: object, table: str) -> str:
    return (
        f"tracker class {cls.__qualname__} starts in {state!r}, not in the "
        f"initial state of table {table!r}: redeclare `state` with the "
        "table's initial state as its default"
    )
