"""Test generators for any transition table, for connector authors.

Everything is derived from a `Table` and a tracker factory:

* `matrix` - the full states x events product with the expected outcome;
* `shortest_paths` - the shortest event path from the initial state to
  every state (XState's ``getShortestPaths`` idea);
* `check_case` - asserts one (state, event) pair end to end on a fresh
  machine: a legal event reaches its target; an illegal one leaves the
  tracker unchanged, bumps the (state, event) counter once and reaches
  the reject observers once (never the log: ``logging.disable()`` cannot
  change the result); strict mode raises `IllegalTransition`;
* `check_row` - drives a tracker to a guarded row's source, runs the
  author's set-up for it and asserts that exactly that row applies; a row
  no set-up can reach fails, naming the row;
* `machine_mismatches` - cross-checks the machine's `transitions` machine
  against the table, edge for edge;
* `fire_stock`, `stock_trigger`, `stock_graph` - transitions' own stock
  trigger path of a machine: the oracle the fast path is checked against;
* `pytest_cases`, `event_sequences` and `event_data_sequences` - pytest
  parameters and hypothesis strategies (pytest and hypothesis are
  imported lazily);
* `table_tests` - all of the above as one pytest test class.

The whole generated suite for your table, in a test module::

    from lifecycle.testing import table_tests
    from mypkg.lifecycle import TABLE, MyTracker

    TestMyLifecycle = table_tests(TABLE, MyTracker)

A table with guarded rows needs set-ups that make each guard pass: a
mapping from a row (or a state, for every guarded row leaving it) to a
callable ``(tracker, row) -> data`` that prepares the tracker and returns
the event's data::

    TestBlocks = table_tests(
        BLOCK_TABLE,
        BlockTracker,
        setups={BlockState.PINNED: pin_readers},
    )
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs

from lifecycle.errors import IllegalTransition
from lifecycle.machine import ILLEGAL, LifecycleMachine
from lifecycle.registry import Registry
from lifecycle.table import Row, Table, event_name
from lifecycle.tracker import Tracker

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T", bound=Tracker[Any, Any])

Factory = Callable[..., Tracker[Any, Any]]
"""Builds a tracker in the table's initial state from its key (of any
type): a tracker class, the base `Tracker` class or a function."""

SetUp = Callable[[Any, Row[Any, Any, Any, Any]], object]
"""Prepares a tracker for a guarded row: ``(tracker, row) -> data``.

Called with the tracker in the row's source state; returns the data to
fire the row's event with (None for none).
"""

SetUps = Mapping[Any, SetUp]
"""Set-ups by row, or by state (every guarded row leaving that state)."""


def fire_stock(
    machine: LifecycleMachine[S, E, Any, Any],
    tracker: Any,
    event: E,
    data: object = None,
) -> bool:
    """Apply `event` through transitions' stock trigger path.

    Same table, same callbacks, same result as `LifecycleMachine.fire` for
    callbacks that do not raise (a differential test checks it); 10-20
    times slower.  No counters, no policy: an illegal event returns False.
    The test oracle.
    """
    with machine._lock:  # noqa: SLF001 - the oracle of this package
        trigger = machine._tx.events[event_name(event)].trigger  # noqa: SLF001
        return bool(trigger(tracker, data=data))


def stock_trigger(
    machine: LifecycleMachine[S, E, Any, Any], event: E
) -> Callable[..., bool]:
    """transitions' own trigger for `event`, unlocked (benchmarks).

    ``stock(tracker)``, or ``stock(tracker, data)`` for events whose
    guards choose the alternative by the event's data.
    """
    trigger = machine._tx.events[event_name(event)].trigger  # noqa: SLF001

    def stock(tracker: Any, *data: object) -> bool:
        if data:
            return bool(trigger(tracker, data=data[0]))
        return bool(trigger(tracker))

    return stock


def stock_graph(
    machine: LifecycleMachine[S, E, Any, Any],
) -> tuple[frozenset[str], frozenset[tuple[S, E, S]]]:
    """The `transitions` machine's state names and (src, event, dst)."""
    table = machine.table
    tx = machine._tx  # noqa: SLF001 - the oracle of this package
    edges = frozenset(
        (
            table.state_named(src),
            table.event_named(name),
            table.state_named(str(t.dest)),
        )
        for name, ev in tx.events.items()
        for src, trans in ev.transitions.items()
        for t in trans
    )
    return frozenset(tx.states), edges


@attrs.frozen
class Case(Generic[S, E]):
    """One (state, event) pair and what the table says must happen.

    Attributes:
        state: The state the event arrives in.
        event: The event.
        expected: The state after the event, or None if it is illegal.
    """

    state: S
    event: E
    expected: S | None

    @property
    def legal(self) -> bool:
        """Whether the table has a row for this pair."""
        return self.expected is not None

    @property
    def id(self) -> str:
        """A stable test id, e.g. ``SAVING-preempt``."""
        return f"{self.state.name}-{event_name(self.event)}"


def matrix(table: Table[S, E, Any, Any]) -> list[Case[S, E]]:
    """Every (state, event) pair, in table-state then event order."""
    return [
        Case(state, event, table.dest(state, event))
        for state in table.states
        for event in table.events
    ]


def shortest_row_paths(
    table: Table[S, E, Any, Any],
) -> dict[S, tuple[Row[S, E, Any, Any], ...]]:
    """The shortest row path from the initial state to every state.

    Ties are broken by table row order, so the result is deterministic.
    Guards are not consulted here (`tracker_in` runs their set-ups).
    """
    paths: dict[S, tuple[Row[S, E, Any, Any], ...]] = {table.initial: ()}
    todo = deque([table.initial])
    while todo:
        state = todo.popleft()
        for row in table.rows:
            if row.source is state and row.dest not in paths:
                paths[row.dest] = (*paths[state], row)
                todo.append(row.dest)
    return paths


def shortest_paths(table: Table[S, E, Any, Any]) -> dict[S, tuple[E, ...]]:
    """The shortest event path from the initial state to every state."""
    return {
        state: tuple(r.event for r in rows)
        for state, rows in shortest_row_paths(table).items()
    }


def _alternatives(
    table: Table[Any, Any, Any], row: Row[Any, Any, Any, Any]
) -> bool:
    """Whether `row` shares its (source, event) with other rows."""
    return len(table.rows_for(row.source, row.event)) > 1


def _setup_for(
    setups: SetUps | None, row: Row[Any, Any, Any, Any]
) -> SetUp | None:
    """The set-up `row` is fired with, None for none.

    A guarded row takes the set-up given for it or for its source state;
    the unguarded last alternative of guarded rows only one given for the
    row itself (a state's set-up makes some guard pass, the opposite of
    what that row needs).
    """
    if not setups:
        return None
    found = setups.get(row)
    if found is not None or row.guard is None:
        return found
    return setups.get(row.source)


def _unreached(
    row: Row[Any, Any, Any, Any], tracker: Any, why: str, *, hint: bool = True
) -> str:
    kind = (
        "guarded row"
        if row.guard is not None
        else "the unguarded last alternative"
    )
    where = (
        f"<row or {row.source.name}>"
        if row.guard is not None
        else "<this row>"
    )
    need = (
        "makes its guard pass"
        if row.guard is not None
        else "makes every earlier alternative's guard refuse"
    )
    text = (
        f"{kind} `{row}` was not reached ({why}; tracker: "
        f"{attrs.asdict(tracker, recurse=False)})"
    )
    if not hint:
        return text
    return (
        f"{text}: supply a set-up that {need}, table_tests(..., "
        f"setups={{{where}: fn(tracker, row) -> data}})"
    )


def _fire_row(
    machine: LifecycleMachine[Any, Any, Any, Any],
    tracker: Any,
    row: Row[Any, Any, Any, Any],
    setups: SetUps | None,
    *,
    hint: bool = True,
) -> None:
    """Fire `row`'s event so that `row` applies, or fail naming it.

    `hint` adds how to fix it with ``setups=`` (off where the caller
    chooses the data itself, e.g. the reachability test's routes).
    """
    table = machine.table
    chosen = row.guard is not None or _alternatives(table, row)
    setup = _setup_for(setups, row) if chosen else None
    data = setup(tracker, row) if setup is not None else None
    index = next(i for i, r in enumerate(table.rows) if r is row)
    before = machine.row_counts()[index]
    if not machine.fire(tracker, row.event, data=data):
        raise AssertionError(
            _unreached(row, tracker, "the event was refused", hint=hint)
            if chosen
            else f"row `{row}` was refused for {tracker.req_id}"
        )
    if machine.row_counts()[index] != before + 1:
        raise AssertionError(
            _unreached(row, tracker, "another alternative applied", hint=hint)
        )


def tracker_in(
    state: S,
    machine: LifecycleMachine[S, E, Any, Any],
    factory: Callable[..., T],
    *,
    req_id: Any = "req-under-test",
    setups: SetUps | None = None,
    hint: bool = True,
) -> T:
    """A fresh tracker from `factory` driven to `state` by its shortest path.

    Rows on the path that have alternatives run their set-up from
    `setups` first (`hint`: failures say how to fix them with set-ups).

    Raises:
        AssertionError: a row on the path did not apply (naming it).
    """
    tracker = factory(req_id)
    for row in shortest_row_paths(machine.table)[state]:
        _fire_row(machine, tracker, row, setups, hint=hint)
    return tracker


def check_row(
    row: Row[S, E, Any, Any],
    table: Table[S, E, Any, Any],
    factory: Factory,
    setups: SetUps | None = None,
    *,
    key: Any = "req-under-test",
) -> None:
    """Assert that `row` applies when its set-up ran, on a fresh machine.

    The tracker is driven to ``row.source``, the set-up for `row` (or
    for its source state) prepares it and gives the data, then the event
    must apply exactly `row`: its destination, its count.

    Raises:
        AssertionError: naming the row and what went wrong.
    """
    machine: LifecycleMachine[S, E, Any, Any] = LifecycleMachine(table)
    tracker = tracker_in(
        row.source, machine, factory, setups=setups, req_id=key
    )
    _fire_row(machine, tracker, row, setups)
    if tracker.state is not row.dest:
        msg = f"row `{row}`: wrong target {tracker.state.name}"
        raise AssertionError(msg)


def check_case(
    case: Case[S, E],
    table: Table[S, E, Any, Any],
    factory: Factory,
    setups: SetUps | None = None,
    *,
    key: Any = "req-under-test",
) -> None:
    """Assert the table's promise for one pair on fresh machines.

    A pair with guarded rows is checked row by row (`check_row`): each
    must be reached through its set-up.

    Raises:
        AssertionError: naming the pair (or row) and what went wrong.
    """
    rows = table.rows_for(case.state, case.event)
    if any(r.guard is not None for r in rows):
        for row in rows:
            check_row(row, table, factory, setups, key=key)
        return
    machine: LifecycleMachine[S, E, Any, Any] = LifecycleMachine(table)
    tracker = tracker_in(
        case.state, machine, factory, setups=setups, req_id=key
    )
    seen: list[tuple[Any, ...]] = []
    machine.add_reject_observer(lambda *rejected: seen.append(rejected))
    before = attrs.asdict(tracker, recurse=False)
    applied = machine.fire(tracker, case.event)
    if case.expected is not None:
        _expect(applied, case, "legal event was refused")
        _expect(tracker.state is case.expected, case, "wrong target")
        _expect(not machine.illegal_counts, case, "counted illegal")
        return
    _expect(not applied, case, "illegal event applied")
    after = attrs.asdict(tracker, recurse=False)
    _expect(before == after, case, "tracker changed")
    _expect(
        machine.illegal_counts[(case.state, case.event)] == 1
        and sum(machine.illegal_counts.values()) == 1,
        case,
        f"illegal count not 1: {dict(machine.illegal_counts)}",
    )
    expected = (tracker.req_id, tracker.epoch, case.state, case.event)
    _expect(
        [r[:4] + r[5:] for r in seen] == [(*expected, ILLEGAL)],
        case,
        f"expected one illegal rejection {expected}, observed {seen}",
    )
    _check_strict(case, table, factory, setups, key)


def _check_strict(
    case: Case[S, E],
    table: Table[S, E, Any, Any],
    factory: Factory,
    setups: SetUps | None,
    key: Any,
) -> None:
    strict: LifecycleMachine[S, E, Any, Any] = LifecycleMachine(
        table, strict=True
    )
    tracker = tracker_in(
        case.state, strict, factory, setups=setups, req_id=key
    )
    try:
        strict.fire(tracker, case.event)
    except IllegalTransition as exc:
        _expect(
            (exc.state, exc.event, exc.req_id)
            == (case.state, case.event, tracker.req_id),
            case,
            f"IllegalTransition carries wrong data: {exc!r}",
        )
        _expect(tracker.state is case.state, case, "strict mutated")
    else:
        _expect(False, case, "strict mode did not raise")  # noqa: FBT003


def _expect(ok: bool, case: Case[Any, Any], what: str) -> None:  # noqa: FBT001
    if not ok:
        msg = f"{case.id}: {what}"
        raise AssertionError(msg)


def machine_mismatches(
    machine: LifecycleMachine[S, E, Any, Any],
    table: Table[S, E, Any, Any] | None = None,
) -> list[str]:
    """Differences between the machine's `transitions` machine and a table.

    Compares states, and for every event every (source, dest) edge that
    transitions registered with the table's rows (default: the machine's
    own table).  Empty when they agree.
    """
    table = machine.table if table is None else table
    tx_states, tx_edges = stock_graph(machine)
    table_states = {s.name for s in table.states}
    problems = []
    if tx_states != table_states:
        problems.append(f"states differ: {set(tx_states) ^ table_states}")
    table_edges = {(r.source, r.event, r.dest) for r in table.rows}
    problems.extend(
        f"only in transitions: {e}"
        for e in sorted(tx_edges - table_edges, key=str)
    )
    problems.extend(
        f"only in the table: {e}"
        for e in sorted(table_edges - tx_edges, key=str)
    )
    return problems


def pytest_cases(table: Table[Any, Any, Any, Any]) -> list[Any]:
    """`matrix` as ``pytest.param`` objects with readable ids."""
    import pytest

    return [pytest.param(c, id=c.id) for c in matrix(table)]


def event_sequences(
    table: Table[Any, Any, Any, Any], max_size: int = 40
) -> Any:
    """A hypothesis strategy of event lists (any order, any length)."""
    from hypothesis import strategies as st

    return st.lists(st.sampled_from(list(table.events)), max_size=max_size)


def event_data_sequences(
    table: Table[Any, Any], data: Sequence[object], max_size: int = 40
) -> Any:
    """A hypothesis strategy of (event, data) lists, data from `data`."""
    from hypothesis import strategies as st

    return st.lists(
        st.tuples(st.sampled_from(list(table.events)), st.sampled_from(data)),
        max_size=max_size,
    )


def _route(_tracker: object, row: Row[Any, Any, Any, Any]) -> object:
    """The set-up of a structural table's guarded row: its destination."""
    return row.dest


def table_tests(  # noqa: C901 - one class of small tests
    table: Table[Any, Any, Any, Any],
    factory: Factory,
    *,
    examples: int = 200,
    setups: SetUps | None = None,
    key: Any = "req-under-test",
    data: Sequence[object] = (None,),
) -> type:
    """A pytest test class holding the generated tests of `table`.

    Assign it to a module-level name starting with ``Test``::

        TestMyLifecycle = table_tests(TABLE, MyTracker)

    Tests: every (state, event) pair (`check_case`), every guarded row
    reached through `setups` (`check_row`); the matrix is the full
    product; the `transitions` machine agrees with the table; every state
    is reachable by its shortest path; total events are accepted
    everywhere non-terminal and terminal states have no exits; the fast
    path matches the stock `transitions` trigger on `examples` random event
    sequences (hypothesis); a registry drops trackers at terminal states.

    `setups` makes guarded rows reachable (see the module docstring);
    `key` is the tracker key the tests use (a str; pass another for
    trackers keyed otherwise, e.g. ``key=1``); `data` are the values the
    differential test fires events with (default: None only), so that
    alternatives chosen by the event's data are compared with the stock
    trigger too, e.g. ``data=(None, "gpu", "cpu")``.

    Raises:
        TypeError: `factory` does not build trackers of `table` (checked
            once, here, rather than by every generated test).
    """
    import pytest
    from hypothesis import given, settings

    Registry(LifecycleMachine(table), factory).get_or_create(key)
    structure = table.without_callbacks()
    # Every alternative routes by its destination, the unguarded last one
    # too: its data must make the earlier (routed) guards refuse.
    routes = {r: _route for r in structure.rows if _alternatives(structure, r)}
    guarded = [r for r in table.rows if r.guard is not None]

    class GeneratedTableTests:
        @pytest.mark.parametrize("case", pytest_cases(table))
        def test_every_state_event_pair(self, case: Case[Any, Any]) -> None:
            check_case(case, table, factory, setups, key=key)

        @pytest.mark.parametrize(
            "row", [pytest.param(r, id=str(r)) for r in guarded] or [None]
        )
        def test_every_guarded_row_is_reached(
            self, row: Row[Any, Any, Any, Any] | None
        ) -> None:
            if row is None:
                assert not guarded
                return
            check_row(row, table, factory, setups, key=key)

        def test_matrix_is_the_full_product(self) -> None:
            cases = matrix(table)
            assert len(cases) == len(table.states) * len(table.events)
            pairs = {(r.source, r.event) for r in table.rows}
            assert sum(c.legal for c in cases) == len(pairs)

        def test_machine_agrees_with_table(self) -> None:
            assert machine_mismatches(LifecycleMachine(table)) == []

        def test_every_state_is_reachable(self) -> None:
            machine: LifecycleMachine[Any, Any, Any, Any] = LifecycleMachine(
                structure, strict=True
            )
            assert set(shortest_paths(table)) == set(table.states)
            for state in table.states:
                tracker = tracker_in(
                    state,
                    machine,
                    factory,
                    setups=routes,
                    req_id=key,
                    hint=False,
                )
                assert tracker.state is state

        def test_total_events_and_terminal_states(self) -> None:
            for state in table.states:
                accepted = table.events_from(state)
                if state in table.terminal:
                    assert accepted == ()
                else:
                    assert set(table.total_events) <= set(accepted)

        def test_registry_drops_trackers_at_terminal_states(self) -> None:
            machine: LifecycleMachine[Any, Any, Any, Any] = LifecycleMachine(
                structure
            )
            for state in table.terminal:
                registry = Registry(machine, factory)
                tracker = registry.get_or_create(key)
                *path, last = shortest_row_paths(structure)[state]
                for row in path:
                    registry.fire_on(tracker, row.event, data=row.dest)
                assert key in registry
                assert registry.fire_on(tracker, last.event, data=last.dest)
                assert key not in registry

        @settings(max_examples=examples, deadline=None)
        @given(events=event_data_sequences(table, tuple(data)))
        def test_fast_path_matches_stock_transitions(
            self, events: list[tuple[Any, object]]
        ) -> None:
            machine: LifecycleMachine[Any, Any, Any, Any] = LifecycleMachine(
                table
            )
            fast, stock = factory(key), factory(key)
            for event, value in events:
                assert machine.fire(fast, event, data=value) == fire_stock(
                    machine, stock, event, value
                )
                assert attrs.asdict(fast) == attrs.asdict(stock)

    GeneratedTableTests.__name__ = f"Test_{table.name}"
    GeneratedTableTests.__qualname__ = GeneratedTableTests.__name__
    return GeneratedTableTests
