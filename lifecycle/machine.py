"""The lifecycle machine: a `transitions.Machine` and a precompiled dispatch.

`LifecycleMachine` is built from a `Table`.  It *holds* one
`transitions.Machine` (``auto_transitions=False``) with every row, guard and
enter hook registered, then compiles its dispatch from that machine's own
event objects, so the fast path and the stock trigger path share one
definition and a differential test holds them to the same result.  The
`transitions` machine is private: nothing public mutates it, so the stock
path and `fire` cannot disagree.  One machine serves every tracker:
trackers are never passed to `add_model`, never get bound methods, and the
machine keeps no list of them.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol

from transitions import EventData, Machine

from lifecycle._generic import Padded
from lifecycle._ratelimit import RateLimitedLog
from lifecycle.errors import IllegalTransition, UnknownRequest
from lifecycle.table import Callback, Guard, Row, Table, event_name
from lifecycle.tracker import Tracker

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    S = TypeVar("S", bound=enum.Enum)
    E = TypeVar("E", bound=enum.Enum)
    T = TypeVar("T", bound=Tracker[Any], default=Tracker[Any])
    D = TypeVar("D", default=Any)
    D_contra = TypeVar("D_contra", contravariant=True)
    S_contra = TypeVar("S_contra", bound=enum.Enum, contravariant=True)
    E_contra = TypeVar("E_contra", bound=enum.Enum, contravariant=True)
    T_contra = TypeVar("T_contra", bound=Tracker[Any], contravariant=True)
else:
    from typing import TypeVar

    S = TypeVar("S", bound=enum.Enum)
    E = TypeVar("E", bound=enum.Enum)
    T = TypeVar("T", bound=Tracker)
    D = TypeVar("D")
    D_contra = TypeVar("D_contra", contravariant=True)
    S_contra = TypeVar("S_contra", bound=enum.Enum, contravariant=True)
    E_contra = TypeVar("E_contra", bound=enum.Enum, contravariant=True)
    T_contra = TypeVar("T_contra", bound=Tracker, contravariant=True)

log: Final = logging.getLogger("lifecycle")


class Observer(Protocol[T_contra, S_contra, E_contra]):
    """Called after every transition (under the machine's lock)."""

    def __call__(
        self, tracker: T_contra, source: S_contra, event: E_contra, dest: Any
    ) -> None:
        """Observe `tracker` moving from `source` to `dest` on `event`."""


class RejectObserver(Protocol[S_contra, E_contra]):
    """Called for every event not applied (under the machine's lock)."""

    def __call__(
        self,
        req_id: str,
        epoch: int | None,
        state: S_contra | None,
        event: E_contra,
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
    event: The event (a member of the table's event enum).
    epoch: The epoch a transfer job was issued in.  If it differs
        from the tracker's, the event is stale: counted, never
        applied, never raised (the ``always`` callbacks of its rows
        from the tracker's state still run).
    data: Passed to every guard and callback the event runs, as their
        second argument (None when not given).

Returns:
    True if a row applied.  False for an illegal ordering (tracker
    unchanged, counted, logged at a bounded rate), a stale event, a
    row whose guard said no, or a callback that raised (state and
    epoch restored, counted, logged).

Raises:
    IllegalTransition: in strict mode, for an illegal ordering.
    Exception: in strict mode, what a callback or guard raised.
    TypeError: `event` is not an event of the table.
"""


class _Fire(Protocol[T_contra, E_contra, D_contra]):
    def __call__(
        self,
        tracker: T_contra,
        event: E_contra,
        *,
        epoch: int | None = None,
        data: D_contra | None = None,
    ) -> bool: ...


class _TxCallback:
    """Adapts a tracker callback to transitions' ``send_event`` calling."""

    __slots__ = ("target",)

    def __init__(self, target: Callback) -> None:
        self.target = target

    def __call__(self, event_data: EventData) -> None:
        self.target(event_data.model, event_data.kwargs.get("data"))


class _TxGuard:
    """Adapts a row guard to a transitions condition."""

    __slots__ = ("target",)

    def __init__(self, target: Guard) -> None:
        self.target = target

    def __call__(self, event_data: EventData) -> bool:
        return bool(
            self.target(event_data.model, event_data.kwargs.get("data"))
        )


# A compiled row: (dest, callbacks run after the change, row index, guard).
_Compiled = tuple[Any, tuple[Callback, ...], int, Guard | None]


class LifecycleMachine(Padded, Generic[S, E, T, D]):
    """The shared state machine of every tracker of one table.

    Args:
        table: The transition table.
        strict: Raise `IllegalTransition` on an illegal ordering, and
            re-raise what a callback raised, instead of the logged,
            counted no-op.  For tests.
        thread_safe: Hold a lock for each transition (the default).  Only
            a machine whose events all come from one thread may pass
            False, which makes an event about 1.5 times cheaper.
        log_interval: Seconds between two log records for the same
            (state, event) pair; the rest are counted.
        logger: Where illegal orderings and callback failures are logged.

    Callback failures: if a row's guard, enter hook or ``after`` callback
    raises, the event is refused: the tracker's state and epoch are put
    back as they were before the event (other fields a callback already
    changed are not), the row is not counted, no observer runs,
    ``callback_errors[(state, event)]`` is incremented and one
    rate-limited ERROR record is logged; `fire` returns False, or in
    strict mode re-raises.  Only `Exception`s are absorbed.

    Thread safety: `fire` holds one lock for the whole transition, so
    events fired concurrently from transfer threads and the scheduler
    thread never interleave inside a transition.  Callbacks and observers
    run under that lock and must not fire events.
    """

    _defaulted = 2  # T and D have defaults (see `Padded`)

    fire: _Fire[T, E, D]
    """Apply an event to a tracker: see `_FIRE_DOC` (the compiled hot path).
    """

    def __init__(
        self,
        table: Table[S, E, D],
        *,
        strict: bool = False,
        thread_safe: bool = True,
        log_interval: float = 10.0,
        logger: logging.Logger = log,
    ) -> None:
        self.table: Table[S, E, D] = table
        self.strict = strict
        self.thread_safe = thread_safe
        self.illegal_counts: Counter[tuple[S | None, E]] = Counter()
        self.stale_counts: Counter[tuple[S, E]] = Counter()
        self.guard_counts: Counter[tuple[S, E]] = Counter()
        self.callback_errors: Counter[tuple[S, E]] = Counter()
        self._tx = _stock_machine(table)
        self._lock = threading.Lock()
        self._illegal_log = RateLimitedLog(logger, log_interval)
        self._stale_log = RateLimitedLog(logger, log_interval, logging.DEBUG)
        self._error_log = RateLimitedLog(logger, log_interval, logging.ERROR)
        self._observers: tuple[Observer[T, S, E], ...] = ()
        self._reject_observers: tuple[RejectObserver[S, E], ...] = ()
        self._rows: tuple[Row[S, E], ...] = table.rows
        self._counts: list[int] = [0] * len(table.rows)
        self._dispatch = self._compile()
        self._always: dict[tuple[S, E], tuple[Callback, ...]] = {
            (r.source, r.event): table.stale_callbacks(r.source, r.event)
            for r in table.rows
            if r.always
        }
        self.fire = self._compiled_fire()

    def __repr__(self) -> str:
        return (
            f"LifecycleMachine({self.table!r}, strict={self.strict}, "
            f"thread_safe={self.thread_safe})"
        )

    def _compile(self) -> dict[E, dict[S, _Compiled]]:
        """Build the fast dispatch from transitions' own event objects."""
        table = self.table
        index = {(r.source, r.event): i for i, r in enumerate(self._rows)}
        dispatch: dict[E, dict[S, _Compiled]] = {e: {} for e in table.events}
        for name, tx_event in self._tx.events.items():
            event = table.event_named(name)
            for source_name, transitions in tx_event.transitions.items():
                (tx,) = transitions  # one row per (state, event): validated
                source = table.state_named(source_name)
                dest = table.state_named(str(tx.dest))
                enter = self._tx.get_state(str(tx.dest)).on_enter
                guards = [
                    c.func.target
                    for c in tx.conditions
                    if isinstance(c.func, _TxGuard)
                ]
                dispatch[event][source] = (
                    dest,
                    tuple(
                        cb.target
                        for cb in (*enter, *tx.after)
                        if isinstance(cb, _TxCallback)
                    ),
                    index[(source, event)],
                    guards[0] if guards else None,
                )
        return dispatch

    def _compiled_fire(self) -> _Fire[T, E, D]:  # noqa: C901 - the hot path
        """`fire` as a closure over the dispatch: the hot path.

        Locals instead of attribute lookups, tuples instead of records.
        Bound to this machine only: trackers never see it.
        """
        fast = self._dispatch
        counts = self._counts
        lock = self._lock
        illegal, stale = self._illegal, self._stale
        guarded, failed = self._guarded, self._failed
        machine = self

        def fire_unlocked(  # noqa: C901 - one flat function is fastest
            tracker: T,
            event: E,
            *,
            epoch: int | None = None,
            data: D | None = None,
        ) -> bool:
            state = tracker.state
            if epoch is not None and epoch != tracker.epoch:
                return stale(tracker, event, epoch, data)
            try:
                dest, callbacks, index, guard = fast[event][state]
            except KeyError:
                return illegal(tracker, event)
            if guard is not None:
                try:
                    allowed = guard(tracker, data)
                except Exception as exc:  # noqa: BLE001 - policy below
                    return failed(tracker, state, tracker.epoch, event, exc)
                if not allowed:
                    return guarded(tracker, event)
            if callbacks:
                before = tracker.epoch
                tracker.state = dest
                try:
                    for callback in callbacks:
                        callback(tracker, data)
                except Exception as exc:  # noqa: BLE001 - policy below
                    return failed(tracker, state, before, event, exc)
            else:
                tracker.state = dest
            counts[index] += 1
            observers = machine._observers
            if observers:
                for observer in observers:
                    observer(tracker, state, event, dest)
            return True

        def fire_locked(
            tracker: T,
            event: E,
            *,
            epoch: int | None = None,
            data: D | None = None,
        ) -> bool:
            with lock:
                return fire_unlocked(tracker, event, epoch=epoch, data=data)

        chosen = fire_locked if self.thread_safe else fire_unlocked
        chosen.__doc__ = _FIRE_DOC
        return chosen

    # -- the typed event API ----------------------------------------------

    def can_fire(self, tracker: T, event: E) -> bool:
        """Whether `event` has a row for the tracker's state (guards aside)."""
        return tracker.state in self._dispatch[event]

    def fire_stock(self, tracker: T, event: E, data: D | None = None) -> bool:
        """Apply `event` through transitions' stock trigger path.

        Same table, same callbacks, same result as `fire` for callbacks
        that do not raise (checked by a differential test); 10-20 times
        slower.  No counters, no policy: an illegal event returns False
        and transitions logs its own warning.  The test oracle.
        """
        with self._lock:
            trigger = self._tx.events[event_name(event)].trigger
            return bool(trigger(tracker, data=data))

    def stock_trigger(self, event: E) -> Callable[[T], bool]:
        """transitions' own trigger for `event`, unlocked (benchmarks)."""
        trigger = self._tx.events[event_name(event)].trigger

        def stock(tracker: T) -> bool:
            return bool(trigger(tracker))

        return stock

    def stock_graph(self) -> tuple[frozenset[str], frozenset[tuple[S, E, S]]]:
        """The `transitions` machine's state names and (src, event, dst).

        For `lifecycle.testing.machine_mismatches`.
        """
        table = self.table
        edges = frozenset(
            (
                table.state_named(src),
                table.event_named(name),
                table.state_named(str(t.dest)),
            )
            for name, ev in self._tx.events.items()
            for src, trans in ev.transitions.items()
            for t in trans
        )
        return frozenset(self._tx.states), edges

    # -- policy -----------------------------------------------------------

    def _illegal(self, tracker: T, event: E) -> bool:
        if event not in self._dispatch:
            msg = (
                f"{event!r} is not an event of table {self.table.name!r} "
                f"(events: {', '.join(map(event_name, self.table.events))})"
            )
            raise TypeError(msg)
        state: S = tracker.state
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
                "event": event_name(event),
            },
        )
        return False

    def _stale(self, tracker: T, event: E, epoch: int, data: D | None) -> bool:
        state: S = tracker.state
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
                "state": state.name,
                "event": event_name(event),
            },
        )
        always = self._always.get((state, event))
        if always:
            current = tracker.epoch
            try:
                for callback in always:
                    callback(tracker, data)
            except Exception as exc:  # noqa: BLE001 - the failure policy
                self._failed(tracker, state, current, event, exc)
        return False

    def _guarded(self, tracker: T, event: E) -> bool:
        self.guard_counts[(tracker.state, event)] += 1
        return False

    def _failed(
        self, tracker: T, state: S, epoch: int, event: E, exc: Exception
    ) -> bool:
        """A guard or callback raised: restore, count, log (or re-raise)."""
        tracker.state = state
        tracker.epoch = epoch
        self.callback_errors[(state, event)] += 1
        if self.strict:
            raise exc
        self._error_log.emit(
            ("callback", state, event),
            "lifecycle callback failed (event refused):",
            {
                "req_id": tracker.req_id,
                "epoch": epoch,
                "state": state.name,
                "event": event_name(event),
                "error": repr(exc),
            },
        )
        return False

    def unknown(self, req_id: str, event: E) -> bool:
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
                {"req_id": req_id, "state": None, "event": event_name(event)},
            )
            return False

    # -- observation ------------------------------------------------------

    def add_observer(self, observer: Observer[T, S, E]) -> None:
        """Call `observer` after every applied transition."""
        with self._lock:
            self._observers = (*self._observers, observer)

    def add_reject_observer(self, observer: RejectObserver[S, E]) -> None:
        """Call `observer` for every illegal or stale event."""
        with self._lock:
            self._reject_observers = (*self._reject_observers, observer)

    def remove_observer(self, observer: object) -> None:
        """Stop calling `observer`; unknown observers are ignored."""
        with self._lock:
            self._observers = tuple(
                o for o in self._observers if o is not observer
            )
            self._reject_observers = tuple(
                o for o in self._reject_observers if o is not observer
            )

    def transition_counts(self) -> dict[Row[S, E], int]:
        """How often each row applied, for every row (zeros included)."""
        with self._lock:
            return dict(zip(self._rows, self._counts, strict=True))

    def row_counts(self) -> tuple[int, ...]:
        """`transition_counts` as a tuple in `table.rows` order (cheap)."""
        with self._lock:
            return tuple(self._counts)

    def rejected_counts(
        self,
    ) -> tuple[dict[tuple[S | None, E], int], dict[tuple[S, E], int]]:
        """Copies of `illegal_counts` and `stale_counts`, under the lock."""
        with self._lock:
            return dict(self.illegal_counts), dict(self.stale_counts)

    @property
    def illegal_total(self) -> int:
        """Illegal orderings seen so far (unknown ids included)."""
        return sum(self.illegal_counts.values())


def _stock_machine(table: Table[Any, Any]) -> Machine:
    """The private `transitions.Machine` of `table` (no model)."""
    config = [
        {
            "trigger": event_name(r.event),
            "source": r.source,
            "dest": r.dest,
            "after": [_TxCallback(cb) for cb in (*r.after, *r.always)],
            "conditions": [_TxGuard(r.guard)] if r.guard is not None else [],
        }
        for r in table.rows
    ]
    machine = Machine(
        model=None,
        states=list(table.states),
        transitions=config,
        initial=table.initial,
        auto_transitions=False,
        ignore_invalid_triggers=True,
        send_event=True,
        name=table.name,
    )
    for state, hooks in table.on_enter.items():
        tx_state = machine.get_state(state.name)
        for hook in hooks:
            tx_state.add_callback("enter", _TxCallback(hook))
    return machine
