"""The lifecycle machine: `transitions.Machine` with a precompiled dispatch.

`LifecycleMachine` is built from a `Table`.  It registers every row with
`transitions` (``auto_transitions=False``), then compiles a dispatch from
the machine's own `Event.transitions`, so the fast path and the stock
trigger path share one definition and a differential test can hold them
to the same result.  One machine serves every tracker: trackers are never
passed to `add_model`, never get bound methods, and the machine keeps no
list of them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Final, Protocol

from transitions import EventData, Machine

from lifecycle._ratelimit import RateLimitedLog
from lifecycle.errors import IllegalTransition, UnknownRequest
from lifecycle.states import Event, State
from lifecycle.table import TABLE, Row, Table
from lifecycle.tracker import CALLBACKS, Callback, Tracker

log: Final = logging.getLogger("lifecycle")


class Observer(Protocol):
    """Called after every transition (under the machine's lock)."""

    def __call__(
        self, tracker: Tracker, source: State, event: Event, dest: State
    ) -> None:
        """Observe `tracker` moving from `source` to `dest` on `event`."""


class RejectObserver(Protocol):
    """Called for every event not applied (under the machine's lock)."""

    def __call__(
        self,
        req_id: str,
        epoch: int | None,
        state: State | None,
        event: Event,
        job_epoch: int | None,
    ) -> None:
        """Observe a refused `event`.

        Stale when `job_epoch` is set (the completion's epoch); otherwise
        an illegal ordering, with `state` and `epoch` None for an id the
        registry does not track.
        """


_FIRE_DOC: Final = """Apply `event` to `tracker` as the table says.

Args:
    tracker: The request's tracker.
    event: The event.
    epoch: The epoch a transfer job was issued in.  If it differs
        from the tracker's, the event is stale: counted, never
        applied, never raised.

Returns:
    True if a row applied.  False for an illegal ordering (tracker
    unchanged, counted, logged at a bounded rate) or a stale event.

Raises:
    IllegalTransition: in strict mode, for an illegal ordering.
"""


class _Fire(Protocol):
    def __call__(
        self, tracker: Tracker, event: Event, *, epoch: int | None = None
    ) -> bool: ...


class _TxCallback:
    """Adapts a tracker callback to transitions' ``send_event`` calling."""

    __slots__ = ("target",)

    def __init__(self, target: Callback) -> None:
        self.target = target

    def __call__(self, event_data: EventData) -> None:
        self.target(event_data.model)


# A compiled row: (dest, callbacks run after the change, row index).
_Compiled = tuple[State, tuple[Callback, ...], int]


class LifecycleMachine(Machine):
    """The shared state machine of every request tracker.

    Args:
        table: The transition table (default: the KV request lifecycle).
        strict: Raise `IllegalTransition` on an illegal ordering instead
            of the logged, counted no-op.  For tests.
        thread_safe: Hold a lock for each transition (the default).  Only
            a machine whose events all come from one thread may pass
            False, which halves the cost of an event.
        log_interval: Seconds between two log records for the same
            (state, event) illegal pair; the rest are counted.
        logger: Where illegal orderings are logged.

    Thread safety: `fire` holds one lock for the whole transition, so
    events fired concurrently from transfer threads and the scheduler
    thread never interleave inside a transition.  Callbacks and observers
    run under that lock and must not fire events.
    """

    fire: _Fire
    """Apply an event to a tracker: see `_FIRE_DOC` (the compiled hot path).
    """

    def __init__(
        self,
        table: Table = TABLE,
        *,
        strict: bool = False,
        thread_safe: bool = True,
        log_interval: float = 10.0,
        logger: logging.Logger = log,
    ) -> None:
        config = [
            {
                "trigger": r.event.value,
                "source": r.source,
                "dest": r.dest,
                "after": [_TxCallback(CALLBACKS[n]) for n in r.after],
            }
            for r in table.rows
        ]
        super().__init__(
            model=None,
            states=list(table.states),
            transitions=config,
            initial=table.initial,
            auto_transitions=False,
            ignore_invalid_triggers=True,
            send_event=True,
            name="lifecycle",
        )
        self.table = table
        self.strict = strict
        self.illegal_counts: Counter[tuple[State | None, Event]] = Counter()
        self.stale_counts: Counter[tuple[State, Event]] = Counter()
        self._lock = threading.Lock()
        self._illegal_log = RateLimitedLog(logger, log_interval)
        self._stale_log = RateLimitedLog(logger, log_interval, logging.DEBUG)
        self._observers: tuple[Observer, ...] = ()
        self._reject_observers: tuple[RejectObserver, ...] = ()
        self._rows: tuple[Row, ...] = table.rows
        self._counts: list[int] = [0] * len(table.rows)
        self._dispatch = self._compile()
        self.thread_safe = thread_safe
        self.fire = self._compiled_fire()

    def _compile(self) -> dict[Event, dict[State, _Compiled]]:
        """Build the fast dispatch from transitions' own event objects."""
        index = {(r.source, r.event): i for i, r in enumerate(self._rows)}
        dispatch: dict[Event, dict[State, _Compiled]] = {e: {} for e in Event}
        for name, tx_event in self.events.items():
            event = Event(name)
            for source_name, transitions in tx_event.transitions.items():
                (tx,) = transitions  # one row per (state, event): validated
                source = State[source_name]
                dispatch[event][source] = (
                    State[str(tx.dest)],
                    tuple(
                        cb.target
                        for cb in tx.after
                        if isinstance(cb, _TxCallback)
                    ),
                    index[(source, event)],
                )
        return dispatch

    def _compiled_fire(self) -> _Fire:
        """`fire` as a closure over the dispatch: the hot path.

        Same semantics as the `fire` method body; locals instead of
        attribute lookups, tuples instead of records.  Bound to this
        machine only: trackers never see it.
        """
        fast = self._dispatch
        counts = self._counts
        acquire, release = self._lock.acquire, self._lock.release
        illegal, stale = self._illegal, self._stale
        machine = self

        def fire_unlocked(
            tracker: Tracker, event: Event, *, epoch: int | None = None
        ) -> bool:
            state = tracker.state
            if epoch is not None and epoch != tracker.epoch:
                stale(tracker, event, epoch)
                return False
            row = fast[event].get(state)
            if row is None:
                return illegal(tracker, event)
            dest, after, index = row
            tracker.state = dest
            for callback in after:
                callback(tracker)
            counts[index] += 1
            for observer in machine._observers:
                observer(tracker, state, event, dest)
            return True

        def fire_locked(
            tracker: Tracker, event: Event, *, epoch: int | None = None
        ) -> bool:
            acquire()
            try:
                return fire_unlocked(tracker, event, epoch=epoch)
            finally:
                release()

        chosen = fire_locked if self.thread_safe else fire_unlocked
        chosen.__doc__ = _FIRE_DOC
        return chosen

    # -- the typed event API ----------------------------------------------

    def can_fire(self, tracker: Tracker, event: Event) -> bool:
        """Whether `event` has a row for the tracker's current state."""
        return tracker.state in self._dispatch[event]

    def fire_stock(self, tracker: Tracker, event: Event) -> bool:
        """Apply `event` through transitions' stock trigger path.

        Same table, same callbacks, same result as `fire` (checked by a
        differential test); 10-20 times slower.  No counters, no policy:
        an illegal event returns False and transitions logs its own
        warning.
        """
        with self._lock:
            return bool(self.events[event.value].trigger(tracker))

    # -- policy -----------------------------------------------------------

    def _illegal(self, tracker: Tracker, event: Event) -> bool:
        state = tracker.state
        self.illegal_counts[(state, event)] += 1
        for observer in self._reject_observers:
            observer(tracker.req_id, tracker.epoch, state, event, None)
        if self.strict:
            raise IllegalTransition(
                state, event, tracker.req_id, tracker.epoch
            )
        self._illegal_log.emit(
            (state, event),
            "illegal lifecycle event (ignored):",
            {
                "req_id": tracker.req_id,
                "epoch": tracker.epoch,
                "state": state.name,
                "event": event.value,
            },
        )
        return False

    def _stale(self, tracker: Tracker, event: Event, epoch: int) -> None:
        state = tracker.state
        self.stale_counts[(state, event)] += 1
        for observer in self._reject_observers:
            observer(tracker.req_id, tracker.epoch, state, event, epoch)
        self._stale_log.emit(
            ("stale", event),
            "stale lifecycle event (ignored):",
            {
                "req_id": tracker.req_id,
                "epoch": tracker.epoch,
                "job_epoch": epoch,
                "state": tracker.state.name,
                "event": event.value,
            },
        )

    def unknown(self, req_id: str, event: Event) -> bool:
        """Apply the illegal-ordering policy to an event for an unknown id.

        Returns:
            False (the event was not applied).

        Raises:
            UnknownRequest: in strict mode.
        """
        with self._lock:
            self.illegal_counts[(None, event)] += 1
            for observer in self._reject_observers:
                observer(req_id, None, None, event, None)
            if self.strict:
                raise UnknownRequest(event, req_id)
            self._illegal_log.emit(
                (None, event),
                "lifecycle event for unknown request (ignored):",
                {"req_id": req_id, "state": None, "event": event.value},
            )
            return False

    # -- observation ------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Call `observer` after every applied transition."""
        with self._lock:
            self._observers = (*self._observers, observer)

    def add_reject_observer(self, observer: RejectObserver) -> None:
        """Call `observer` for every illegal or stale event."""
        with self._lock:
            self._reject_observers = (*self._reject_observers, observer)

    def remove_observer(self, observer: Observer | RejectObserver) -> None:
        """Stop calling `observer`; unknown observers are ignored."""
        with self._lock:
            self._observers = tuple(
                o for o in self._observers if o is not observer
            )
            self._reject_observers = tuple(
                o for o in self._reject_observers if o is not observer
            )

    def transition_counts(self) -> dict[Row, int]:
        """How often each row applied, for every row (zeros included)."""
        with self._lock:
            return dict(zip(self._rows, self._counts, strict=True))

    def row_counts(self) -> tuple[int, ...]:
        """`transition_counts` as a tuple in `table.rows` order (cheap)."""
        with self._lock:
            return tuple(self._counts)

    def rejected_counts(
        self,
    ) -> tuple[
        dict[tuple[State | None, Event], int], dict[tuple[State, Event], int]
    ]:
        """Copies of `illegal_counts` and `stale_counts`, under the lock."""
        with self._lock:
            return dict(self.illegal_counts), dict(self.stale_counts)

    @property
    def illegal_total(self) -> int:
        """Illegal orderings seen so far (unknown ids included)."""
        return sum(self.illegal_counts.values())
