"""Declarative transition tables over the caller's own enums.

A `Table` is the single source of truth of one lifecycle.  The machine
(`lifecycle.machine`), the typed event API, the diagrams
(`lifecycle.render`), the generated transition-table tests
(`lifecycle.testing`) and trace replay (`lifecycle.trace`) are all derived
from it; nothing about a lifecycle may be written anywhere else.

A table is generic over two enums of the caller's: its states ``S`` and
its events ``E``.  The KV request lifecycle (`lifecycle.kv.TABLE`) is one
instance; a connector author writes their own the same way::

    class PState(enum.Enum):
        WAITING = "waiting"
        RUNNING = "running"
        DONE = "done"

    class PEvent(enum.Enum):
        START = "start"
        FINISH = "finish"

    TABLE = Table(
        [
            Row(PState.WAITING, PEvent.START, PState.RUNNING),
            Row(PState.WAITING, PEvent.FINISH, PState.DONE),
            Row(PState.RUNNING, PEvent.FINISH, PState.DONE, after=(log,)),
        ],
        initial=PState.WAITING,
        terminal={PState.DONE},
        total_events={PEvent.FINISH},
    )

Rules
-----
* An event with no row for the tracker's current state is an *illegal
  ordering*: a counted, logged no-op (strict mode raises
  `IllegalTransition`).
* Several rows may share a (state, event) as *guarded alternatives*: they
  are tried in table order and the first whose guard passes applies.  An
  unguarded row shadows every later row of its pair (a validation error).
  When every guard refuses, the event is *refused*: a counted, logged
  (at INFO) no-op, traced, raised in strict mode (`GuardRefused`).  A
  refusal the table lists in ``expected_refusals=`` is a normal outcome
  (a guard declining, e.g. "don't evict a block in use"): counted and
  traced the same, logged at DEBUG, never raised, not even in strict
  mode.
* Terminal states (``terminal=``) have no exits; a `Registry` drops a
  tracker the moment it reaches one.  "Terminal" is decided by the table,
  never by a property of the enum.  ``terminal=()`` declares a cyclic
  lifecycle (no end; no dead ends either).
* ``total_events`` must be accepted by every non-terminal state.
* Rows hold their callbacks as callables (``after=``), plus an optional
  ``guard``; states may have enter hooks (``on_enter=``).  Every callback
  and guard is called ``(tracker, data)``: ``data`` is what the caller
  passed as ``fire(..., data=)`` (None by default), typed by the table's
  third parameter ``D``.  ``always=`` names callbacks that also run for a
  stale completion of the row's event, in any state.  Callbacks only touch
  the tracker (and their data); they never fire events.

Building a `Table` validates it and reports every defect at once in one
`InvalidTable`.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic

import attrs

from lifecycle._generic import Padded
from lifecycle.errors import InvalidTable, TableProblem

if TYPE_CHECKING:
    from collections.abc import Hashable

    from typing_extensions import TypeVar

    from lifecycle.tracker import Tracker
else:
    from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
"""The state enum of a table."""
E = TypeVar("E", bound=enum.Enum)
"""The event enum of a table."""
if TYPE_CHECKING:
    # No default on a row's data type: a row without callbacks leaves it
    # unsolved, so a list of rows takes the data type of those that have
    # callbacks (a default, even Any, would decide the join instead).
    D_row = TypeVar("D_row", contravariant=True)  # noqa: PLC0105
    D = TypeVar("D", contravariant=True, default=None)  # noqa: PLC0105
    # The same for the tracker the callbacks take: a row without callbacks
    # leaves it open; a table's defaults to any tracker of its states.
    T_row = TypeVar(  # noqa: PLC0105
        "T_row", bound=Tracker[Any, Any], contravariant=True
    )
    T = TypeVar(  # noqa: PLC0105 - T reads best in every signature
        "T",
        bound=Tracker[Any, Any],
        contravariant=True,
        default=Tracker[S, Hashable],
    )
else:
    D_row = TypeVar("D_row", contravariant=True)  # noqa: PLC0105
    D = TypeVar("D", contravariant=True)  # noqa: PLC0105
    T_row = TypeVar("T_row", contravariant=True)  # noqa: PLC0105
    T = TypeVar("T", contravariant=True)  # noqa: PLC0105
"""The event data a table's callbacks receive (``fire(..., data=)``).

Contravariant (callbacks consume it); ``Table[S, E]`` means ``None``: no
data but None reaches the callbacks."""

Callback = Callable[[Any, Any], object]
"""A row or enter callback: takes the tracker and the event's data."""
Guard = Callable[[Any, Any], bool]
"""A row guard: takes the tracker and the event's data, says whether the
row may apply."""


def event_name(event: enum.Enum) -> str:
    """How an event is spelled in traces, diagrams and trigger names.

    Its value when that is a string (``"lookup"``), else its name.
    """
    value = event.value
    return value if isinstance(value, str) else event.name


def callback_name(callback: object) -> str:
    """A callback's display name (its ``__name__``)."""
    return str(getattr(callback, "__name__", repr(callback)))


@attrs.frozen
class Row(Padded, Generic[S, E, D_row, T_row]):
    """One legal transition: `event` in `source` moves to `dest`.

    Attributes:
        source: The state the event is accepted in.
        event: The event.
        dest: The state after the event (may equal `source`).
        after: Callables run after the state change, in order, each with
            the tracker and the event's data (``fire(..., data=)``, None
            when the caller gives none).  If one raises, the event is
            refused (see `LifecycleMachine`).
        guard: Optional predicate on the tracker and the event's data;
            when it returns False the event is refused without a state
            change (counted in `LifecycleMachine.guard_counts`, not an
            illegal ordering).
        always: Callables that run after `after` when the row applies,
            and also, alone and without a state change, for every *stale*
            completion of `event` (an older epoch), whatever the tracker's
            state then: work that must happen whatever the epoch, such as
            settling what the completing job held.

    Rows compare and hash by (source, event, dest, guard).  Several rows
    may share a (source, event) when all but the last have a guard: they
    are tried in table order and the first whose guard passes applies
    (*guarded alternatives*).
    """

    _defaults = (Any, Any)  # D and T have defaults (see `Padded`)

    source: S
    event: E
    dest: S
    after: tuple[Callable[[T_row, D_row], object], ...] = attrs.field(
        default=(), eq=False
    )
    guard: Callable[[T_row, D_row], bool] | None = attrs.field(default=None)
    always: tuple[Callable[[T_row, D_row], object], ...] = attrs.field(
        default=(), eq=False
    )

    def __str__(self) -> str:
        return (
            f"{self.source.name} --{event_name(self.event)}--> "
            f"{self.dest.name}"
        )


class Table(Padded, Generic[S, E, D, T]):
    """A validated, frozen transition table over state enum ``S``.

    Args:
        rows: The transitions.
        initial: The state new trackers start in.
        terminal: States that end a lifecycle (no exits).  Required: pass
            ``()`` for a *cyclic* lifecycle that never ends (a cache
            block): validation then requires every state to be reachable
            and to have a row to another state, instead of a way to a
            terminal state.
        total_events: Events every non-terminal state must accept.
        states: Every state, in display order (default: every member of
            the initial state's enum).
        events: Every event (default: every member of the rows' event
            enum).
        on_enter: Per-state enter hooks: callables run, with the tracker
            and the event's data, on every row whose `dest` is that state
            (self-loops included, as in `transitions`), before the row's
            `after` callbacks.
        name: A short identifier: diagram file stem and trace label.
        title: The diagram title (default: `name`).
        expected_refusals: Refusals that are normal outcomes, not
            errors: ``(state, event)`` pairs, or events (every state
            where all of the event's rows are guarded).  Each must be a
            pair whose rows are all guarded (else it can never be
            refused: a validation error).

    Raises:
        InvalidTable: listing every defect found.
    """

    _defaults = (Any, Any)  # D and T have defaults (see `Padded`)
    __slots__ = (
        "_by_key",
        "events",
        "expected_refusals",
        "fingerprint",
        "initial",
        "name",
        "on_enter",
        "rows",
        "states",
        "terminal",
        "title",
        "total_events",
    )

    def __init__(
        self,
        rows: Iterable[Row[S, E, D, T]],
        *,
        initial: S,
        terminal: Iterable[S],
        total_events: Iterable[E] = (),
        states: Iterable[S] | None = None,
        events: Iterable[E] | None = None,
        on_enter: Mapping[S, Sequence[Callable[[T, D], object]]] | None = None,
        name: str = "lifecycle",
        title: str | None = None,
        expected_refusals: Iterable[tuple[S, E] | E] = (),
    ) -> None:
        self.rows: tuple[Row[S, E, D, T], ...] = tuple(rows)
        self.initial: S = initial
        self.states: tuple[S, ...] = (
            tuple(type(initial)) if states is None else tuple(states)
        )
        if events is None:
            first = self.rows[0].event if self.rows else None
            events = () if first is None else tuple(type(first))
        self.events: tuple[E, ...] = tuple(events)
        self.terminal: frozenset[S] = frozenset(terminal)
        self.total_events: tuple[E, ...] = tuple(total_events)
        self.on_enter: dict[S, tuple[Callable[[T, D], object], ...]] = {
            s: tuple(cbs) for s, cbs in (on_enter or {}).items()
        }
        self.name = name
        self.title = name if title is None else title
        expected, refusal_problems = self._expected(expected_refusals)
        self.expected_refusals: frozenset[tuple[S, E]] = expected
        """The (state, event) pairs whose refusal is a normal outcome."""
        problems = (*self._problems(), *refusal_problems)
        if problems:
            raise InvalidTable(problems)
        self._by_key: dict[tuple[S, E], tuple[Row[S, E, D, T], ...]] = {}
        for r in self.rows:
            key = (r.source, r.event)
            self._by_key[key] = (*self._by_key.get(key, ()), r)
        self.fingerprint: str = self._fingerprint()

    def _expected(
        self, given: Iterable[tuple[S, E] | E]
    ) -> tuple[frozenset[tuple[S, E]], list[TableProblem]]:
        """`expected_refusals` as pairs, and what is wrong with them."""
        pairs: dict[tuple[S, E], tuple[Row[S, E, D, T], ...]] = {}
        for r in self.rows:
            key = (r.source, r.event)
            pairs[key] = (*pairs.get(key, ()), r)

        def refusable(key: tuple[S, E]) -> bool:
            rows = pairs.get(key, ())
            return bool(rows) and all(r.guard is not None for r in rows)

        expected: set[tuple[S, E]] = set()
        problems = []
        for item in given:
            if isinstance(item, tuple):
                if refusable(item):
                    expected.add(item)
                    continue
                state, event = item
                what = f"({_spell(state, str)}, {_spell(event, event_name)})"
                why = (
                    "has an unguarded row: it is never refused"
                    if item in pairs
                    else "has no row"
                )
            else:
                found = {k for k in pairs if k[1] is item and refusable(k)}
                if found:
                    expected |= found
                    continue
                what = f"`{_spell(item, event_name)}`"
                why = "has no state where all its rows are guarded"
            problems.append(
                TableProblem(
                    "bad-expected-refusal",
                    f"expected refusal {what} {why}",
                    pairs.get(item, ()) if isinstance(item, tuple) else (),
                )
            )
        return frozenset(expected), problems

    def is_expected_refusal(self, state: S, event: E) -> bool:
        """Whether every guard refusing `event` in `state` is normal."""
        return (state, event) in self.expected_refusals

    def __repr__(self) -> str:
        return (
            f"Table({self.name!r}, {len(self.states)} states, "
            f"{len(self.rows)} rows, fingerprint={self.fingerprint})"
        )

    @property
    def state_type(self) -> type[S]:
        """The state enum."""
        return type(self.initial)

    def get(self, state: S, event: E) -> Row[S, E, D, T] | None:
        """The (first) row for `event` in `state`, None if it is illegal.

        Guarded alternatives share a (state, event): see `rows_for`.
        """
        rows = self._by_key.get((state, event))
        return None if rows is None else rows[0]

    def rows_for(self, state: S, event: E) -> tuple[Row[S, E, D, T], ...]:
        """Every row for `event` in `state`, in the order they are tried."""
        return self._by_key.get((state, event), ())

    def events_from(self, state: S) -> tuple[E, ...]:
        """The events accepted in `state`, in table order, each once."""
        return tuple(
            dict.fromkeys(r.event for r in self.rows if r.source is state)
        )

    def dest(self, state: S, event: E) -> S | None:
        """Where `event` in `state` leads (its first row), None if illegal."""
        row = self.get(state, event)
        return None if row is None else row.dest

    def callbacks(self, row: Row[S, E, D, T]) -> tuple[Callback, ...]:
        """What applying `row` runs: enter hooks, `after`, then `always`."""
        return (*self.on_enter.get(row.dest, ()), *row.after, *row.always)

    def stale_callbacks(self, event: E) -> tuple[Callback, ...]:
        """What a stale `event` runs, in any state: its rows' `always`.

        Each callable once, in table order.
        """
        seen: list[Callback] = []
        for row in self.rows:
            if row.event is event:
                seen.extend(cb for cb in row.always if cb not in seen)
        return tuple(seen)

    def without_callbacks(self) -> Table[S, E, D, T]:
        """This table's structure with no callbacks or enter hooks.

        Same states, rows, fingerprint and name; for trace replay and
        reachability checks, where the tracker data callbacks read is
        absent.  A guard becomes a *route*: it passes when the event's
        data is None or the row's `dest`, so replay chooses among guarded
        alternatives by the recorded outcome (``data=dest``).
        """
        return Table(
            [
                Row(
                    r.source,
                    r.event,
                    r.dest,
                    guard=None if r.guard is None else Route(r.dest),
                )
                for r in self.rows
            ],
            initial=self.initial,
            terminal=self.terminal,
            total_events=self.total_events,
            states=self.states,
            events=self.events,
            name=self.name,
            title=self.title,
            expected_refusals=self.expected_refusals,
        )

    def state_named(self, name: str) -> S:
        """The table's state called `name`.

        Raises:
            KeyError: no such state in this table.
        """
        for state in self.states:
            if state.name == name:
                return state
        raise KeyError(name)

    def event_named(self, name: str) -> E:
        """The table's event spelled `name` (see `event_name`).

        Raises:
            KeyError: no such event in this table.
        """
        for event in self.events:
            if event_name(event) == name:
                return event
        raise KeyError(name)

    def _fingerprint(self) -> str:
        """A short hash of the table's structure (not of callback code)."""
        data = {
            "states": [s.name for s in self.states],
            "events": [event_name(e) for e in self.events],
            "initial": self.initial.name,
            "terminal": sorted(s.name for s in self.terminal),
            "total": [event_name(e) for e in self.total_events],
            "rows": [
                [r.source.name, event_name(r.event), r.dest.name]
                for r in self.rows
            ],
        }
        if self.expected_refusals:  # absent: fingerprints stay as they were
            data["expected_refusals"] = sorted(
                [s.name, event_name(e)] for s, e in self.expected_refusals
            )
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- validation -------------------------------------------------------

    def _problems(self) -> tuple[TableProblem, ...]:
        problems: list[TableProblem] = []
        declared = set(self.states)
        problems += self._declaration_problems(declared)
        problems += self._row_problems(declared)
        if not any(p.kind == "unknown-state" for p in problems):
            problems += self._graph_problems()
        return tuple(problems)

    def _declaration_problems(self, declared: set[S]) -> list[TableProblem]:
        problems = []
        if self.initial not in declared:
            problems.append(
                TableProblem(
                    "unknown-state",
                    f"initial state {self.initial.name} is not declared",
                )
            )
        problems.extend(
            TableProblem(
                "unknown-state", f"terminal state {s.name} is not declared"
            )
            for s in sorted(self.terminal - declared, key=_by_name)
        )
        problems.extend(
            TableProblem(
                "unknown-state", f"enter hooks for undeclared state {s.name}"
            )
            for s in sorted(set(self.on_enter) - declared, key=_by_name)
        )
        problems.extend(
            TableProblem(
                "bad-callback", f"enter hook {cb!r} of {s.name} {why}"
            )
            for s, cbs in self.on_enter.items()
            for cb in cbs
            if (why := _callback_problem(cb))
        )
        events = set(self.events)
        problems.extend(
            TableProblem(
                "unknown-event",
                f"total event {event_name(e)} is not an event of the table",
            )
            for e in self.total_events
            if e not in events
        )
        return problems

    def _row_problems(self, declared: set[S]) -> list[TableProblem]:
        problems = []
        seen: dict[tuple[S, E], Row[S, E, D, T]] = {}
        events = set(self.events)
        for row in self.rows:
            unknown = [s for s in (row.source, row.dest) if s not in declared]
            if unknown:
                names = ", ".join(s.name for s in unknown)
                problems.append(
                    TableProblem(
                        "unknown-state",
                        f"row `{row}` uses undeclared state {names}",
                        (row,),
                    )
                )
            if row.event not in events:
                problems.append(
                    TableProblem(
                        "unknown-event",
                        f"row `{row}` uses event {row.event!r}, not an "
                        "event of the table",
                        (row,),
                    )
                )
            key = (row.source, row.event)
            if key in seen:
                # `seen` holds the last unguarded row of the pair, if any:
                # it would always win, so this later row never applies.
                first = seen[key]
                problems.append(
                    TableProblem(
                        "duplicate-row"
                        if row.guard is None
                        else "shadowed-row",
                        f"rows `{first}` and `{row}` share "
                        f"({row.source.name}, {event_name(row.event)}) and "
                        f"`{first}` has no guard: it shadows `{row}` (give "
                        "every alternative but the last a guard)",
                        (first, row),
                    )
                )
            elif row.guard is None:
                seen[key] = row
            if row.source in self.terminal:
                problems.append(
                    TableProblem(
                        "terminal-exit",
                        f"row `{row}` leaves terminal state {row.source.name}",
                        (row,),
                    )
                )
            problems.extend(
                TableProblem(
                    "bad-callback",
                    f"row `{row}` has a callback {cb!r} that {why}",
                    (row,),
                )
                for cb in (*row.after, *row.always, row.guard)
                if cb is not None and (why := _callback_problem(cb))
            )
        for state in self.states:
            if state in self.terminal:
                continue
            accepted = {r.event for r in self.rows if r.source is state}
            problems.extend(
                TableProblem(
                    "missing-total-event",
                    f"non-terminal state {state.name} does not accept "
                    f"`{event_name(event)}`",
                )
                for event in self.total_events
                if event not in accepted
            )
        return problems

    def _graph_problems(self) -> list[TableProblem]:
        problems = []
        reachable = _closure({self.initial}, self._successors())
        for state in self.states:
            if state not in reachable:
                into = tuple(r for r in self.rows if r.dest is state)
                problems.append(
                    TableProblem(
                        "unreachable-state",
                        f"state {state.name} cannot be reached from "
                        f"{self.initial.name}"
                        + (
                            f" (rows into it: "
                            f"{', '.join(f'`{r}`' for r in into)})"
                            if into
                            else ""
                        ),
                        into,
                    )
                )
        if not self.terminal:
            # A cyclic table (``terminal=()``): nothing ends, so every
            # state must lead somewhere else.
            for state in self.states:
                out = tuple(r for r in self.rows if r.source is state)
                if all(r.dest is state for r in out):
                    problems.append(
                        TableProblem(
                            "dead-end",
                            f"state {state.name} of a table with no "
                            "terminal state has no row to another state "
                            f"(its rows: "
                            f"{', '.join(f'`{r}`' for r in out) or 'none'})",
                            out,
                        )
                    )
            return problems
        reaches_end = _closure(set(self.terminal), self._predecessors())
        for state in self.states:
            if state not in reaches_end:
                out = tuple(r for r in self.rows if r.source is state)
                problems.append(
                    TableProblem(
                        "no-way-out",
                        f"non-terminal state {state.name} cannot reach a "
                        f"terminal state (its rows: "
                        f"{', '.join(f'`{r}`' for r in out) or 'none'})",
                        out,
                    )
                )
        return problems

    def _successors(self) -> dict[S, set[S]]:
        succ: dict[S, set[S]] = {s: set() for s in self.states}
        for r in self.rows:
            succ[r.source].add(r.dest)
        return succ

    def _predecessors(self) -> dict[S, set[S]]:
        pred: dict[S, set[S]] = {s: set() for s in self.states}
        for r in self.rows:
            pred[r.dest].add(r.source)
        return pred


class Route:
    """A structural guard: passes when the data is None or `dest`."""

    __slots__ = ("__name__", "dest")

    def __init__(self, dest: enum.Enum) -> None:
        self.dest = dest
        self.__name__ = f"to_{dest.name}"

    def __call__(self, _tracker: object, data: object) -> bool:
        """Whether `data` routes the event to this row."""
        return data is None or data is self.dest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Route) and other.dest is self.dest

    def __hash__(self) -> int:
        return hash(("route", self.dest))


def _callback_problem(callback: object) -> str:
    """Why `callback` cannot be called ``(tracker, data)`` (empty: it can)."""
    if not callable(callback):
        return "is not callable"
    try:
        inspect.signature(callback).bind(None, None)
    except TypeError:
        return (
            "cannot be called with (tracker, data): callbacks and guards "
            "take the event's data as a second argument"
        )
    except ValueError:  # no signature to inspect (some builtins): trust it
        return ""
    return ""


def _spell(item: object, spell: Callable[[Any], str]) -> str:
    """An enum member's name (`spell` str) or spelling, else its repr."""
    if isinstance(item, enum.Enum):
        return item.name if spell is str else spell(item)
    return repr(item)


def _by_name(state: enum.Enum) -> str:
    return state.name


def _closure(start: set[S], edges: dict[S, set[S]]) -> set[S]:
    seen = set(start)
    todo = deque(start)
    while todo:
        for nxt in edges.get(todo.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen
