"""Test generators for transition tables, reusable by connector authors.

Everything is derived from a `Table`:

* `matrix` - the full states x events product with the expected outcome;
* `shortest_paths` - the shortest event path from the initial state to
  every state (XState's ``getShortestPaths`` idea);
* `check_case` - asserts one (state, event) pair end to end on a fresh
  machine: a legal event reaches its target; an illegal one leaves the
  state unchanged, bumps the (state, event) counter and logs one record;
  strict mode raises `IllegalTransition`;
* `machine_mismatches` - cross-checks a `transitions` machine against the
  table, edge for edge;
* `pytest_cases` and `event_sequences` - pytest parameters and a
  hypothesis strategy (pytest and hypothesis are imported lazily).

Example::

    @pytest.mark.parametrize("case", pytest_cases())
    def test_every_pair(case):
        check_case(case)
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import attrs

from lifecycle.errors import IllegalTransition
from lifecycle.machine import LifecycleMachine
from lifecycle.states import Event, State
from lifecycle.table import TABLE, Table
from lifecycle.tracker import Tracker

if TYPE_CHECKING:
    from collections.abc import Callable


@attrs.frozen
class Case:
    """One (state, event) pair and what the table says must happen.

    Attributes:
        state: The state the event arrives in.
        event: The event.
        expected: The state after the event, or None if it is illegal.
    """

    state: State
    event: Event
    expected: State | None

    @property
    def legal(self) -> bool:
        """Whether the table has a row for this pair."""
        return self.expected is not None

    @property
    def id(self) -> str:
        """A stable test id, e.g. ``SAVING-preempt``."""
        return f"{self.state.name}-{self.event.value}"


def matrix(table: Table = TABLE) -> list[Case]:
    """Every (state, event) pair, in table-state then event order."""
    return [
        Case(state, event, table.dest(state, event))
        for state in table.states
        for event in Event
    ]


def shortest_paths(table: Table = TABLE) -> dict[State, tuple[Event, ...]]:
    """The shortest event path from the initial state to every state.

    Ties are broken by table row order, so the result is deterministic.
    """
    paths: dict[State, tuple[Event, ...]] = {table.initial: ()}
    todo = deque([table.initial])
    while todo:
        state = todo.popleft()
        for row in table.rows:
            if row.source is state and row.dest not in paths:
                paths[row.dest] = (*paths[state], row.event)
                todo.append(row.dest)
    return paths


def tracker_in(
    state: State,
    machine: LifecycleMachine,
    *,
    req_id: str = "req-under-test",
    factory: Callable[[str], Tracker] = Tracker,
) -> Tracker:
    """A fresh tracker driven to `state` along its shortest path."""
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


def check_case(case: Case, table: Table = TABLE) -> None:
    """Assert the table's promise for one pair on fresh machines.

    Raises:
        AssertionError: naming the pair and what went wrong.
    """
    logger = logging.getLogger(f"lifecycle.testing.{case.id}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = _Records()
    logger.addHandler(handler)
    try:
        machine = LifecycleMachine(table, logger=logger)
        tracker = tracker_in(case.state, machine)
        handler.records.clear()
        before = attrs.asdict(tracker, recurse=False)
        applied = machine.fire(tracker, case.event)
        if case.expected is not None:
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
                and fields[0]["event"] == case.event.value
                and fields[0]["epoch"] == tracker.epoch,
                case,
                f"expected one structured log record, got {fields}",
            )
            _check_strict(case, table)
    finally:
        logger.removeHandler(handler)


def _check_strict(case: Case, table: Table) -> None:
    strict = LifecycleMachine(table, strict=True)
    tracker = tracker_in(case.state, strict)
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


def _expect(ok: bool, case: Case, what: str) -> None:  # noqa: FBT001
    if not ok:
        msg = f"{case.id}: {what}"
        raise AssertionError(msg)


def machine_mismatches(
    machine: LifecycleMachine, table: Table = TABLE
) -> list[str]:
    """Differences between the `transitions` machine and the table.

    Compares states, and for every event every (source, dest) edge that
    transitions registered with the table's rows.  Empty when they agree.
    """
    problems = []
    tx_states = set(machine.states)
    table_states = {s.name for s in table.states}
    if tx_states != table_states:
        problems.append(f"states differ: {tx_states ^ table_states}")
    tx_edges = {
        (State[src], Event(name), State[str(t.dest)])
        for name, ev in machine.events.items()
        for src, trans in ev.transitions.items()
        for t in trans
    }
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


def pytest_cases(table: Table = TABLE) -> list[Any]:
    """`matrix` as ``pytest.param`` objects with readable ids."""
    import pytest  # noqa: PLC0415 - test-time dependency only

    return [pytest.param(c, id=c.id) for c in matrix(table)]


def event_sequences(max_size: int = 40) -> Any:
    """A hypothesis strategy of event lists (any order, any length)."""
    from hypothesis import strategies as st  # noqa: PLC0415

    return st.lists(st.sampled_from(list(Event)), max_size=max_size)
