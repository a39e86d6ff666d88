"""Test generators for any transition table, for connector authors.

Everything is derived from a `Table` and a tracker factory:

* `matrix` - the full states x events product with the expected outcome;
* `shortest_paths` - the shortest event path from the initial state to
  every state (XState's ``getShortestPaths`` idea);
* `check_case` - asserts one (state, event) pair end to end on a fresh
  machine: a legal event reaches its target; an illegal one leaves the
  tracker unchanged, bumps the (state, event) counter and logs one record;
  strict mode raises `IllegalTransition`;
* `machine_mismatches` - cross-checks the machine's `transitions` machine
  against the table, edge for edge;
* `pytest_cases` and `event_sequences` - pytest parameters and a
  hypothesis strategy (pytest and hypothesis are imported lazily);
* `table_tests` - all of the above as one pytest test class.

The whole generated suite for your table, in a test module::

    from lifecycle.testing import table_tests
    from mypkg.lifecycle import TABLE, MyTracker

    TestMyLifecycle = table_tests(TABLE, MyTracker)
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs

from lifecycle.errors import IllegalTransition
from lifecycle.machine import LifecycleMachine
from lifecycle.registry import Registry
from lifecycle.table import Table, event_name
from lifecycle.tracker import Tracker

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T", bound=Tracker[Any])

Factory = Callable[[str], Tracker[Any]]
"""Builds a tracker in the table's initial state from a request id."""


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


def matrix(table: Table[S, E]) -> list[Case[S, E]]:
    """Every (state, event) pair, in table-state then event order."""
    return [
        Case(state, event, table.dest(state, event))
        for state in table.states
        for event in table.events
    ]


def shortest_paths(table: Table[S, E]) -> dict[S, tuple[E, ...]]:
    """The shortest event path from the initial state to every state.

    Ties are broken by table row order, so the result is deterministic.
    Guards are not consulted.
    """
    paths: dict[S, tuple[E, ...]] = {table.initial: ()}
    todo = deque([table.initial])
    while todo:
        state = todo.popleft()
        for row in table.rows:
            if row.source is state and row.dest not in paths:
                paths[row.dest] = (*paths[state], row.event)
                todo.append(row.dest)
    return paths


def tracker_in(
    state: S,
    machine: LifecycleMachine[S, E, Any],
    factory: Callable[[str], T],
    *,
    req_id: str = "req-under-test",
) -> T:
    """A fresh tracker from `factory` driven to `state` by its shortest path.

    Raises:
        AssertionError: an event on the path was refused.
    """
    tracker = factory(req_id)
    for event in shortest_paths(machine.table)[state]:
        if not machine.fire(tracker, event):
            msg = f"could not drive {req_id} to {state.name} at {event}"
            raise AssertionError(msg)
    return tracker


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_case(case: Case[S, E], table: Table[S, E], factory: Factory) -> None:
    """Assert the table's promise for one pair on fresh machines.

    Raises:
        AssertionError: naming the pair and what went wrong.
    """
    logger = logging.getLogger(f"lifecycle.testing.{table.name}.{case.id}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = _Records()
    logger.addHandler(handler)
    try:
        machine: LifecycleMachine[S, E] = LifecycleMachine(
            table, logger=logger
        )
        tracker = tracker_in(case.state, machine, factory)
        handler.records.clear()
        before = attrs.asdict(tracker, recurse=False)
        applied = machine.fire(tracker, case.event)
        if case.expected is not None:
            row = table.get(case.state, case.event)
            if row is not None and row.guard is not None and not applied:
                return  # the guard said no for a fresh tracker: allowed
            _expect(applied, case, "legal event was refused")
            _expect(tracker.state is case.expected, case, "wrong target")
            _expect(not machine.illegal_counts, case, "counted illegal")
        else:
            _expect(not applied, case, "illegal event applied")
            after = attrs.asdict(tracker, recurse=False)
            _expect(before == after, case, "tracker changed")
            _expect(
                machine.illegal_counts[(case.state, case.event)] == 1,
                case,
                "illegal counter not incremented",
            )
            fields = [getattr(r, "lifecycle", None) for r in handler.records]
            _expect(
                len(fields) == 1
                and fields[0] is not None
                and fields[0]["req_id"] == tracker.req_id
                and fields[0]["state"] == case.state.name
                and fields[0]["event"] == event_name(case.event)
                and fields[0]["epoch"] == tracker.epoch,
                case,
                f"expected one structured log record, got {fields}",
            )
            _check_strict(case, table, factory)
    finally:
        logger.removeHandler(handler)


def _check_strict(
    case: Case[S, E], table: Table[S, E], factory: Factory
) -> None:
    strict: LifecycleMachine[S, E] = LifecycleMachine(table, strict=True)
    tracker = tracker_in(case.state, strict, factory)
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
    machine: LifecycleMachine[S, E, Any], table: Table[S, E] | None = None
) -> list[str]:
    """Differences between the machine's `transitions` machine and a table.

    Compares states, and for every event every (source, dest) edge that
    transitions registered with the table's rows (default: the machine's
    own table).  Empty when they agree.
    """
    table = machine.table if table is None else table
    tx_states, tx_edges = machine.stock_graph()
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


def pytest_cases(table: Table[Any, Any]) -> list[Any]:
    """`matrix` as ``pytest.param`` objects with readable ids."""
    import pytest

    return [pytest.param(c, id=c.id) for c in matrix(table)]


def event_sequences(table: Table[Any, Any], max_size: int = 40) -> Any:
    """A hypothesis strategy of event lists (any order, any length)."""
    from hypothesis import strategies as st

    return st.lists(st.sampled_from(list(table.events)), max_size=max_size)


def table_tests(  # noqa: C901 - one class of small tests
    table: Table[Any, Any],
    factory: Factory,
    *,
    examples: int = 200,
) -> type:
    """A pytest test class holding the generated tests of `table`.

    Assign it to a module-level name starting with ``Test``::

        TestMyLifecycle = table_tests(TABLE, MyTracker)

    Tests: every (state, event) pair (`check_case`); the matrix is the
    full product; the `transitions` machine agrees with the table; every
    state is reachable by its shortest path; total events are accepted
    everywhere non-terminal and terminal states have no exits; the fast
    path matches the stock `transitions` trigger on `examples` random event
    sequences (hypothesis); a registry drops trackers at terminal states.
    """
    import pytest
    from hypothesis import given, settings

    class GeneratedTableTests:
        @pytest.mark.parametrize("case", pytest_cases(table))
        def test_every_state_event_pair(self, case: Case[Any, Any]) -> None:
            check_case(case, table, factory)

        def test_matrix_is_the_full_product(self) -> None:
            cases = matrix(table)
            assert len(cases) == len(table.states) * len(table.events)
            assert sum(c.legal for c in cases) == len(table.rows)

        def test_machine_agrees_with_table(self) -> None:
            assert machine_mismatches(LifecycleMachine(table)) == []

        def test_every_state_is_reachable(self) -> None:
            machine: LifecycleMachine[Any, Any] = LifecycleMachine(
                table.without_callbacks(), strict=True
            )
            assert set(shortest_paths(table)) == set(table.states)
            for state in table.states:
                assert tracker_in(state, machine, factory).state is state

        def test_total_events_and_terminal_states(self) -> None:
            for state in table.states:
                accepted = table.events_from(state)
                if state in table.terminal:
                    assert accepted == ()
                else:
                    assert set(table.total_events) <= set(accepted)

        def test_registry_drops_trackers_at_terminal_states(self) -> None:
            machine: LifecycleMachine[Any, Any] = LifecycleMachine(
                table.without_callbacks()
            )
            for state in table.terminal:
                registry = Registry(machine, factory)
                tracker = registry.get_or_create("r")
                *path, last = shortest_paths(table)[state]
                for event in path:
                    registry.fire_on(tracker, event)
                assert "r" in registry
                assert registry.fire_on(tracker, last)
                assert "r" not in registry

        @settings(max_examples=examples, deadline=None)
        @given(events=event_sequences(table))
        def test_fast_path_matches_stock_transitions(
            self, events: list[Any]
        ) -> None:
            machine: LifecycleMachine[Any, Any] = LifecycleMachine(table)
            fast, stock = factory("r"), factory("r")
            for event in events:
                assert machine.fire(fast, event) == machine.fire_stock(
                    stock, event
                )
                assert attrs.asdict(fast) == attrs.asdict(stock)

    GeneratedTableTests.__name__ = f"Test_{table.name}"
    GeneratedTableTests.__qualname__ = GeneratedTableTests.__name__
    return GeneratedTableTests
