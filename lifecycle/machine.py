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

Fire events through a `Registry` (`Registry.fire` by id, `Registry.fire_on`
with the tracker in hand): it also drops trackers that ended.
`LifecycleMachine.fire` is the step both use.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, Generic, Never, Protocol

import attrs

from lifecycle._counts import Counts
from lifecycle._generic import Padded
from lifecycle._ratelimit import RateLimitedLog
from lifecycle._stock import TxCallback, TxGuard, stock_machine
from lifecycle.errors import (
    GuardRefused,
    IllegalTransition,
    ReentrantFire,
    UnknownRequest,
)
from lifecycle.table import Callback, Guard, Row, Table, event_name
from lifecycle.tracker import Tracker

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    S = TypeVar("S", bound=enum.Enum)
    E = TypeVar("E", bound=enum.Enum)
    T = TypeVar(  # noqa: PLC0105 - T reads best in every signature
        "T",
        bound=Tracker[Any, Any],
        contravariant=True,
        default=Never,
    )
    D = TypeVar("D", contravariant=True, default=Never)  # noqa: PLC0105
    D_contra = TypeVar("D_contra", contravariant=True)
    S_contra = TypeVar("S_contra", bound=enum.Enum, contravariant=True)
    E_contra = TypeVar("E_contra", bound=enum.Enum, contravariant=True)
    T_contra = TypeVar("T_contra", bound=Tracker[Any, Any], contravariant=True)
else:
    from typing import TypeVar

    S = TypeVar("S", bound=enum.Enum)
    E = TypeVar("E", bound=enum.Enum)
    T = TypeVar("T", bound=Tracker, contravariant=True)  # noqa: PLC0105
    D = TypeVar("D", contravariant=True)  # noqa: PLC0105
    D_contra = TypeVar("D_contra", contravariant=True)
    S_contra = TypeVar("S_contra", bound=enum.Enum, contravariant=True)
    E_contra = TypeVar("E_contra", bound=enum.Enum, contravariant=True)
    T_contra = TypeVar("T_contra", bound=Tracker, contravariant=True)

log: Final = logging.getLogger("lifecycle")

ILLEGAL: Final = "illegal"
STALE: Final = "stale"
REFUSED: Final = "refused"
APPLIED: Final = "applied"
FAILED: Final = "failed"


@attrs.frozen
class Outcome(Generic[S, E]):
    """What one `LifecycleMachine.fire_outcome` did, read under the lock.

    Truthy exactly when a row applied (as `fire`'s bool).

    Attributes:
        kind: `APPLIED`, `ILLEGAL` (no row for the state), `STALE` (an
            older epoch), `REFUSED` (every guard said no) or `FAILED` (a
            guard or callback raised; state and epoch restored).
        source: The state the event found (None for an unknown id).
        state: The state after the event (None for an unknown id).
        row: The row that applied (which guarded alternative), else None.
        expected: A refusal the table lists in ``expected_refusals``.
    """

    kind: str
    source: S | None
    state: S | None
    row: Row[S, E, Any, Any] | None = None
    expected: bool = False

    def __bool__(self) -> bool:
        return self.kind == APPLIED


class Observer(Protocol[T_contra, S_contra, E_contra]):
    """Called after every transition (inside it, under the machine's lock).

    Any callable ``(tracker, source, event, dest)`` whatever its parameter
    names: the machine passes them by position.  ``source`` and ``dest``
    are states of the table.
    """

    def __call__(
        self,
        tracker: T_contra,
        source: S_contra,
        event: E_contra,
        dest: S_contra,
        /,
    ) -> None:
        """Observe `tracker` moving from `source` to `dest` on `event`."""


class RejectObserver(Protocol[S_contra, E_contra]):
    """Called for every event not applied (under the machine's lock).

    Any callable ``(req_id, epoch, state, event, job_epoch, outcome)``
    whatever its parameter names (passed by position).
    """

    def __call__(  # noqa: PLR0917 - the observer protocol
        self,
        req_id: Any,
        epoch: int | None,
        state: S_contra | None,
        event: E_contra,
        job_epoch: int | None,
        outcome: str,
        /,
    ) -> None:
        """Observe an `event` that was not applied.

        `outcome` says why: ``"illegal"`` (no row for the state; `state`
        and `epoch` are None for an id the registry does not track),
        ``"stale"`` (`job_epoch` is the completion's older epoch) or
        ``"refused"`` (every guard of the state's rows said no).
        """


class _Fire(Protocol[T_contra, E_contra, D_contra]):
    def __call__(
        self,
        tracker: T_contra,
        event: E_contra,
        *,
        epoch: int | None = None,
        data: D_contra | None = None,
    ) -> bool:
        """Apply `event` to `tracker` (see `LifecycleMachine.fire`)."""


# One alternative: (dest, callbacks run after the change, row index, guard).
_Alt = tuple[Any, tuple[Callback, ...], int, Guard | None]
# A compiled (state, event): the first alternative, then the rest or None.
_Compiled = tuple[Any, tuple[Callback, ...], int, Guard | None, Any]


class LifecycleMachine(Padded, Generic[S, E, T, D]):
    """The shared state machine of every tracker of one table.

    Type parameters: the table's states ``S``, events ``E``, the trackers
    it accepts ``T`` (default: any `Tracker` of ``S``, so a tracker of
    another table's states is a type error) and the event data ``D``.

    Args:
        table: The transition table.
        strict: Raise `IllegalTransition` on an illegal ordering,
            `GuardRefused` when every guard refuses (except the table's
            ``expected_refusals``, never raised), and re-raise what a
            callback raised, instead of the logged, counted no-op.  For
            tests.
        thread_safe: Hold the machine's lock for each transition (the
            default).  A machine may pass False (an event about 1.5
            times cheaper) exactly when no two of its events, its
            registries' creations and drops, and its counter reads can
            run at once: all come from one thread, or every caller holds
            one lock while it fires (e.g. `atomic` over a shared
            ``lock=``).  It then also skips the `ReentrantFire` check.
        lock: The lock `fire` holds (default: a new `threading.RLock` of
            this machine's own).  Pass one `threading.RLock` to several
            machines to compose them: under `atomic` (or ``with lock:``)
            a sequence of events across their tables is atomic.
        log_interval: Seconds between two log records for the same
            (state, event) pair; the rest are counted.
        logger: Where illegal orderings, refusals and callback failures
            are logged.  Every record names the table (``table=``).

    Callback failures: if a row's guard, enter hook or ``after`` callback
    raises, the event is refused: the tracker's state and epoch are put
    back as they were before the event (other fields a callback already
    changed are not), the row is not counted, no observer runs,
    ``callback_errors[(state, event)]`` is incremented and one
    rate-limited ERROR record is logged; `fire` returns False, or in
    strict mode re-raises.  Only `Exception`s are absorbed.

    Thread safety: `fire` holds one lock for the whole transition, so
    events fired concurrently from transfer threads and the scheduler
    thread never interleave inside a transition.  Callbacks, guards and
    observers run inside the transition and must not fire events: one that
    does gets `ReentrantFire` (a machine with ``thread_safe=False`` does
    not check).

    Composition: per-machine locks make each event atomic, not a sequence
    of events across tables.  Build the machines with one shared
    ``lock=threading.RLock()`` and fire the sequence inside
    ``with atomic(a, b):`` (claim a block, fire on the request, undo on
    failure): no other thread sees it half done.
    """

    _defaults = (Any, Any)  # T and D have defaults (see `Padded`)

    fire: _Fire[T, E, D]
    """Apply `event` to `tracker` as the table says (the compiled hot path).

    ``fire(tracker, event, *, epoch=None, data=None) -> bool``.
    Prefer `Registry.fire_on` (the same step, and it drops a tracker that
    reached a terminal state).

    Args:
        tracker: The request's tracker.
        event: The event (a member of the table's event enum).
        epoch: The epoch a transfer job was issued in.  If it differs
            from the tracker's, the event is stale: counted, never
            applied, never raised; the ``always`` callbacks of the
            event's rows still run.
        data: Passed to every guard and callback the event runs, as
            their second argument (None when not given).

    Returns:
        True if a row applied.  False for an illegal ordering (tracker
        unchanged, counted, logged at a bounded rate), a stale event, an
        event every guard refused (counted in `guard_counts`, logged at
        INFO at a bounded rate; at DEBUG for the table's
        ``expected_refusals``), or a callback that raised (state and epoch
        restored, counted, logged).

    Raises:
        IllegalTransition: in strict mode, for an illegal ordering.
        GuardRefused: in strict mode, when every guard refused (not for
            the table's ``expected_refusals``).
        Exception: in strict mode, what a callback or guard raised.
        ReentrantFire: called from a callback, guard or observer.
        TypeError: `event` is not an event of the table.
    """

    def __init__(
        self,
        table: Table[S, E, D, T],
        *,
        strict: bool = False,
        thread_safe: bool = True,
        log_interval: float = 10.0,
        logger: logging.Logger = log,
        lock: threading.RLock | None = None,
    ) -> None:
        self.table: Table[S, E, D, T] = table
        """The table this machine applies."""
        self.strict = strict
        """Whether policy violations raise (see the class)."""
        self.thread_safe = thread_safe
        """Whether `fire` holds the machine's lock."""
        self._illegal_counts: Counter[tuple[S | None, E]] = Counter()
        self._stale_counts: Counter[tuple[S, E]] = Counter()
        self._guard_counts: Counter[tuple[S, E]] = Counter()
        self._callback_errors: Counter[tuple[S, E]] = Counter()
        self._tx = stock_machine(table)
        self._lock = threading.RLock() if lock is None else lock
        self._illegal_log = RateLimitedLog(logger, log_interval)
        self._refused_log = RateLimitedLog(logger, log_interval, logging.INFO)
        self._stale_log = RateLimitedLog(logger, log_interval, logging.DEBUG)
        self._expected_log = RateLimitedLog(
            logger, log_interval, logging.DEBUG
        )
        self._expected_refusals = table.expected_refusals
        self._error_log = RateLimitedLog(logger, log_interval, logging.ERROR)
        self._observers: tuple[Observer[T, S, E], ...] = ()
        self._reject_observers: tuple[RejectObserver[S, E], ...] = ()
        self._rows: tuple[Row[S, E, D, T], ...] = table.rows
        self._counts: list[int] = [0] * len(table.rows)
        # What `fire_outcome` returns for each applied row, built once.
        self._applied: tuple[Outcome[S, E], ...] = tuple(
            Outcome(APPLIED, r.source, r.dest, r) for r in table.rows
        )
        self._busy = [False]  # inside a transition (the reentrancy check)
        # Why the last event under the lock was not applied (fire_outcome).
        self._rejected = ""
        self._dispatch = self._compile()
        self._always: dict[E, tuple[Callback, ...]] = {
            r.event: table.stale_callbacks(r.event)
            for r in table.rows
            if r.always
        }
        self.fire = self._compiled_fire()

    def __repr__(self) -> str:
        return (
            f"LifecycleMachine({self.table!r}, strict={self.strict}, "
            f"thread_safe={self.thread_safe})"
        )

    @property
    def name(self) -> str:
        """The table's name, as logs, traces, metrics and errors call it."""
        return self.table.name

    # -- read-only counters -----------------------------------------------

    @property
    def illegal_counts(self) -> Counts[tuple[S | None, E]]:
        """Illegal orderings by (state, event), state None for unknown ids.

        A read-only live view (missing keys read 0); `rejected_counts`
        copies it under the lock.
        """
        return Counts(self._illegal_counts)

    @property
    def stale_counts(self) -> Counts[tuple[S, E]]:
        """Stale completions by (tracker state, event); read-only view."""
        return Counts(self._stale_counts)

    @property
    def guard_counts(self) -> Counts[tuple[S, E]]:
        """Events every guard refused, by (state, event); read-only view."""
        return Counts(self._guard_counts)

    @property
    def callback_errors(self) -> Counts[tuple[S, E]]:
        """Guards or callbacks that raised, by (state, event); read-only."""
        return Counts(self._callback_errors)

    # -- compiling ----------------------------------------------------------

    def _compile(self) -> dict[E, dict[S, _Compiled]]:
        """Build the fast dispatch from transitions' own event objects."""
        table = self.table
        dispatch: dict[E, dict[S, _Compiled]] = {e: {} for e in table.events}
        for name, tx_event in self._tx.events.items():
            event = table.event_named(name)
            for source_name, transitions in tx_event.transitions.items():
                source = table.state_named(source_name)
                indices = [
                    i
                    for i, r in enumerate(self._rows)
                    if r.source is source and r.event is event
                ]
                alts: list[_Alt] = []
                for index, tx in zip(indices, transitions, strict=True):
                    dest = table.state_named(str(tx.dest))
                    enter = self._tx.get_state(str(tx.dest)).on_enter
                    guards = [
                        c.func.target
                        for c in tx.conditions
                        if isinstance(c.func, TxGuard)
                    ]
                    alts.append(
                        (
                            dest,
                            tuple(
                                cb.target
                                for cb in (*enter, *tx.after)
                                if isinstance(cb, TxCallback)
                            ),
                            index,
                            guards[0] if guards else None,
                        )
                    )
                first, *rest = alts
                dispatch[event][source] = (
                    *first,
                    tuple(rest) if rest else None,
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
        choose, failed = self._choose, self._failed
        busy = self._busy
        machine = self

        def fire_unlocked(  # noqa: C901 - one flat function is fastest
            tracker: T,
            event: E,
            epoch: int | None = None,
            data: D | None = None,
        ) -> bool:
            state = tracker.state
            if epoch is not None and epoch != tracker.epoch:
                return stale(tracker, event, epoch, data)
            try:
                dest, callbacks, index, guard, rest = fast[event][state]
            except KeyError:
                return illegal(tracker, event)
            if guard is not None:
                try:
                    allowed = guard(tracker, data)
                except Exception as exc:  # noqa: BLE001 - policy below
                    return failed(tracker, state, tracker.epoch, event, exc)
                if not allowed:
                    chosen = choose(tracker, event, data, rest)
                    if chosen is None:
                        return False
                    dest, callbacks, index, _ = chosen
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
                if busy[0]:
                    raise ReentrantFire(event, tracker.req_id, machine.name)
                busy[0] = True
                try:
                    return fire_unlocked(tracker, event, epoch, data)
                finally:
                    busy[0] = False

        self._step = fire_unlocked
        chosen = fire_locked if self.thread_safe else fire_unlocked
        chosen.__doc__ = "Apply `event` to `tracker`: `LifecycleMachine.fire`."
        return chosen

    @property
    def lock(self) -> threading.RLock:
        """The lock `fire` holds (shared by machines built with ``lock=``)."""
        return self._lock

    def fire_outcome(
        self,
        tracker: T,
        event: E,
        *,
        epoch: int | None = None,
        data: D | None = None,
    ) -> Outcome[S, E]:
        """`fire`, returning what happened instead of a bool.

        The same step and policy (strict mode raises the same), read under
        the machine's lock, so the row and state are the event's own even
        while other threads fire.  An applied row's outcome is built once
        per row; `fire` stays the bool hot path.
        """
        with self._lock:
            busy = self._busy
            if busy[0] and self.thread_safe:
                raise ReentrantFire(event, tracker.req_id, self.name)
            busy[0] = True
            try:
                source: S = tracker.state
                compiled = self._dispatch.get(event, {}).get(source)
                self._rejected = ""
                if compiled is not None and compiled[4] is None:
                    # One row for the pair: applied means that row.
                    if self._step(tracker, event, epoch, data):
                        return self._applied[compiled[2]]
                elif compiled is not None:
                    counts = self._counts
                    indices = self._indices(compiled)
                    before = [counts[i] for i in indices]
                    if self._step(tracker, event, epoch, data):
                        for i, n in zip(indices, before, strict=True):
                            if counts[i] != n:
                                return self._applied[i]
                else:
                    self._step(tracker, event, epoch, data)
            finally:
                busy[0] = False
            kind = self._rejected or ILLEGAL
            return Outcome(
                kind,
                source,
                tracker.state,
                expected=kind == REFUSED
                and (source, event) in self._expected_refusals,
            )

    @staticmethod
    def _indices(compiled: _Compiled) -> tuple[int, ...]:
        """The row indices of a compiled (state, event), in order."""
        rest: tuple[_Alt, ...] = compiled[4] or ()
        return (compiled[2], *(alt[2] for alt in rest))

    # -- the typed event API ----------------------------------------------

    def can_fire(self, tracker: T, event: E) -> bool:
        """Whether `event` has a row for the tracker's state (guards aside)."""
        return tracker.state in self._dispatch[event]

    # -- policy -----------------------------------------------------------

    def _fields(
        self, tracker: Tracker[Any], state: S | None, event: E
    ) -> dict[str, object]:
        return {
            "table": self.table.name,
            "req_id": tracker.req_id,
            "epoch": tracker.epoch,
            "state": None if state is None else state.name,
            "event": event_name(event),
        }

    def _illegal(self, tracker: T, event: E) -> bool:
        self._rejected = ILLEGAL
        if event not in self._dispatch:
            msg = (
                f"{event!r} is not an event of table {self.table.name!r} "
                f"(events: {', '.join(map(event_name, self.table.events))})"
            )
            raise TypeError(msg)
        state: S = tracker.state
        self._illegal_counts[(state, event)] += 1
        for observer in self._reject_observers:
            observer(
                tracker.req_id, tracker.epoch, state, event, None, ILLEGAL
            )
        if self.strict:
            raise IllegalTransition(
                state, event, tracker.req_id, tracker.epoch, self.table.name
            )
        self._illegal_log.emit(
            (state, event),
            "illegal lifecycle event (ignored):",
            self._fields(tracker, state, event),
        )
        return False

    def _choose(
        self, tracker: T, event: E, data: D | None, rest: tuple[_Alt, ...]
    ) -> _Alt | None:
        """The first alternative after the first whose guard passes.

        None when every guard refused (policy applied) or one raised.
        """
        state: S = tracker.state
        for alt in rest or ():
            guard = alt[3]
            if guard is None:
                return alt
            try:
                if guard(tracker, data):
                    return alt
            except Exception as exc:  # noqa: BLE001 - the failure policy
                self._failed(tracker, state, tracker.epoch, event, exc)
                return None
        self._refused(tracker, event)
        return None

    def _refused(self, tracker: T, event: E) -> None:
        self._rejected = REFUSED
        state: S = tracker.state
        self._guard_counts[(state, event)] += 1
        for observer in self._reject_observers:
            observer(
                tracker.req_id, tracker.epoch, state, event, None, REFUSED
            )
        if (state, event) in self._expected_refusals:
            self._expected_log.emit(
                ("expected", state, event),
                "lifecycle event declined by its guards (expected):",
                self._fields(tracker, state, event),
            )
            return
        if self.strict:
            raise GuardRefused(
                state,
                event,
                tracker.req_id,
                tracker.epoch,
                self.table.rows_for(state, event),
                self.table.name,
            )
        self._refused_log.emit(
            ("refused", state, event),
            "lifecycle event refused by every guard (ignored):",
            self._fields(tracker, state, event),
        )

    def _stale(self, tracker: T, event: E, epoch: int, data: D | None) -> bool:
        self._rejected = STALE
        state: S = tracker.state
        self._stale_counts[(state, event)] += 1
        for observer in self._reject_observers:
            observer(tracker.req_id, tracker.epoch, state, event, epoch, STALE)
        self._stale_log.emit(
            ("stale", event),
            "stale lifecycle event (ignored):",
            self._fields(tracker, state, event) | {"job_epoch": epoch},
        )
        always = self._always.get(event)
        if always:
            current = tracker.epoch
            try:
                for callback in always:
                    callback(tracker, data)
            except Exception as exc:  # noqa: BLE001 - the failure policy
                self._failed(tracker, state, current, event, exc)
        return False

    def _failed(
        self, tracker: T, state: S, epoch: int, event: E, exc: Exception
    ) -> bool:
        """A guard or callback raised: restore, count, log (or re-raise)."""
        self._rejected = FAILED
        tracker.state = state
        tracker.epoch = epoch
        if isinstance(exc, ReentrantFire):
            raise exc
        self._callback_errors[(state, event)] += 1
        if self.strict:
            raise exc
        self._error_log.emit(
            ("callback", state, event),
            "lifecycle callback failed (event refused):",
            self._fields(tracker, state, event) | {"error": repr(exc)},
        )
        return False

    def unknown(self, req_id: object, event: E) -> bool:
        """Apply the illegal-ordering policy to an event for an unknown id.

        `Registry.fire` calls it for an id it does not track.

        Returns:
            False (the event was not applied).

        Raises:
            UnknownRequest: in strict mode.
        """
        with self._lock:
            if self._busy[0]:
                raise ReentrantFire(event, req_id, self.name)
            self._illegal_counts[(None, event)] += 1
            for observer in self._reject_observers:
                observer(req_id, None, None, event, None, ILLEGAL)
            if self.strict:
                raise UnknownRequest(event, req_id, self.table.name)
            self._illegal_log.emit(
                (None, event),
                "lifecycle event for unknown request (ignored):",
                {
                    "table": self.table.name,
                    "req_id": req_id,
                    "state": None,
                    "event": event_name(event),
                },
            )
            return False

    # -- observation ------------------------------------------------------

    def add_observer(self, observer: Observer[T, S, E]) -> None:
        """Call `observer` after every applied transition."""
        with self._lock:
            self._observers = (*self._observers, observer)

    def add_reject_observer(self, observer: RejectObserver[S, E]) -> None:
        """Call `observer` for every illegal, stale or refused event."""
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

    def transition_counts(self) -> dict[Row[S, E, D, T], int]:
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
            return dict(self._illegal_counts), dict(self._stale_counts)

    def refused_counts(self) -> dict[tuple[S, E], int]:
        """A copy of `guard_counts`, under the lock."""
        with self._lock:
            return dict(self._guard_counts)

    @property
    def illegal_total(self) -> int:
        """Illegal orderings seen so far (unknown ids included)."""
        return sum(self._illegal_counts.values())


@contextmanager
def atomic(*machines: LifecycleMachine[Any, Any, Any, Any]) -> Iterator[None]:
    """Hold the one lock `machines` share: their events inside are atomic.

    Build the machines with one ``lock=threading.RLock()``; inside the
    block, no other thread fires on any of them (nor creates or drops
    their trackers), so "claim a block, fire on the request, undo on
    failure" across tables is one step.  Do not fire from callbacks: fire
    in sequence inside the block.

    Raises:
        ValueError: no machines, or they do not share one lock.
    """
    locks = {id(m.lock): m.lock for m in machines}
    if len(locks) != 1:
        names = ", ".join(m.name for m in machines) or "none"
        msg = (
            f"atomic() needs machines built with one shared lock= "
            f"(got {len(locks)} locks for: {names})"
        )
        raise ValueError(msg)
    with next(iter(locks.values())):
        yield
