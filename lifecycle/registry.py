"""The caller's map from request id to tracker, with the lifecycle policy.

A connector keeps exactly one `Registry`: it is the only per-request map.
Events for unknown ids get the same policy as illegal orderings (counted,
logged at a bounded rate, raised in strict mode), and a tracker is dropped
the moment it reaches a terminal state, so finished requests leave nothing
behind.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic

from lifecycle._generic import Padded
from lifecycle.machine import LifecycleMachine
from lifecycle.tracker import Tracker, check_tracker_class

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    D = TypeVar("D", default=Any)
else:
    from typing import TypeVar

    D = TypeVar("D")

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T", bound=Tracker[Any])


class Registry(Padded, Generic[S, E, T, D]):
    """Live trackers by request id, all driven by one shared machine.

    Args:
        machine: The shared lifecycle machine.
        factory: Builds a tracker for a new request id, in the table's
            initial state: usually the tracker class itself.

    Raises:
        TypeError: the factory is a tracker class that would be slow or
            compare by value (see `lifecycle.define_tracker`); for other
            factories, at the first tracker of such a class.
    """

    __slots__ = ("_checked", "_factory", "_terminal", "_trackers", "machine")

    def __init__(
        self,
        machine: LifecycleMachine[S, E, Any, D],
        factory: Callable[[str], T],
    ) -> None:
        self.machine = machine
        self._factory = factory
        self._trackers: dict[str, T] = {}
        # A tuple: `in` compares by identity first (no Enum.__hash__).
        self._terminal: tuple[S, ...] = tuple(machine.table.terminal)
        self._checked: type | None = None
        if isinstance(factory, type):
            check_tracker_class(factory)
            self._checked = factory

    def get(self, req_id: str) -> T | None:
        """The live tracker for `req_id`, or None."""
        return self._trackers.get(req_id)

    def get_or_create(self, req_id: str) -> T:
        """The live tracker for `req_id`, created in the initial state."""
        tracker = self._trackers.get(req_id)
        if tracker is None:
            tracker = self._factory(req_id)
            if type(tracker) is not self._checked:
                check_tracker_class(type(tracker))
                self._checked = type(tracker)
            self._trackers[req_id] = tracker
        return tracker

    def fire(
        self,
        req_id: str,
        event: E,
        *,
        epoch: int | None = None,
        known: bool = True,
        data: D | None = None,
    ) -> bool:
        """Fire `event` on the tracker of `req_id`; drop it if it ended.

        Args:
            req_id: The request id.
            event: The event.
            epoch: The epoch of the transfer job reporting, if any.
            data: Passed to the guards and callbacks the event runs.
            known: Whether the caller expects the id to be tracked.  An
                unknown id is then an illegal ordering (policy applies);
                with False it is silently ignored (e.g. a save completing
                after its request finished, which is normal).

        Returns:
            Whether a transition applied.
        """
        tracker = self._trackers.get(req_id)
        if tracker is None:
            return self.machine.unknown(req_id, event) if known else False
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

        "Ended" means a state in the table's ``terminal`` set.
        """
        applied = self.machine.fire(tracker, event, epoch=epoch, data=data)
        if applied and tracker.state in self._terminal:
            self._trackers.pop(tracker.req_id, None)
        return applied

    def discard(self, req_id: str) -> T | None:
        """Forget `req_id` without an event (e.g. at shutdown)."""
        return self._trackers.pop(req_id, None)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._trackers

    def __len__(self) -> int:
        return len(self._trackers)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._trackers.values()))
