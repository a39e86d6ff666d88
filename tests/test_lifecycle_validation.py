"""Planted invalid tables are rejected with messages naming the rows."""

from __future__ import annotations

import pytest

from lifecycle import InvalidTable, Row, Table
from lifecycle.kv import TERMINAL, TRANSITIONS, Event, State

S, E = State, Event
KV = {
    "initial": S.NEW,
    "terminal": TERMINAL,
    "total_events": (E.FINISH, E.ABORT),
}


def _without(*keys: tuple[State, Event]) -> list[Row]:
    return [r for r in TRANSITIONS if (r.source, r.event) not in keys]


def _reject(rows: list[Row], **kw: object) -> InvalidTable:
    with pytest.raises(InvalidTable) as info:
        Table(rows, **(KV | kw))  # type: ignore[arg-type]
    return info.value


def test_the_shipped_table_is_valid() -> None:
    assert len(Table(TRANSITIONS, **KV).rows) == len(TRANSITIONS)


def test_unknown_state_in_a_row() -> None:
    states = [s for s in State if s is not S.DRAINING]
    err = _reject(list(TRANSITIONS), states=states)
    assert "unknown-state" in err.kinds
    assert "LOADING --finish--> DRAINING" in str(err)


def test_duplicate_state_event_rows() -> None:
    extra = Row(S.SAVING, E.PREEMPT, S.RESET)
    err = _reject([*TRANSITIONS, extra])
    assert err.kinds == {"duplicate-row"}
    (problem,) = err.problems
    assert problem.rows[1] == extra
    assert "SAVING --preempt--> PREEMPTED" in problem.detail
    assert "SAVING --preempt--> RESET" in problem.detail


def test_unreachable_state() -> None:
    rows = _without((S.LOADING, E.FINISH), (S.LOADING, E.ABORT))
    rows += [Row(S.LOADING, E.FINISH, S.FINISHED)]
    rows += [Row(S.LOADING, E.ABORT, S.ABORTED)]
    err = _reject(rows)
    assert "unreachable-state" in err.kinds
    assert "DRAINING cannot be reached" in str(err)


def test_non_terminal_state_that_cannot_reach_a_terminal() -> None:
    rows = [
        *_without(
            (S.PREEMPTED, E.FINISH),
            (S.PREEMPTED, E.ABORT),
            (S.PREEMPTED, E.RESET),
        ),
        Row(S.PREEMPTED, E.FINISH, S.PREEMPTED),
        Row(S.PREEMPTED, E.ABORT, S.PREEMPTED),
    ]
    err = _reject(rows)
    assert "no-way-out" in err.kinds
    assert "PREEMPTED cannot reach a terminal state" in str(err)
    assert "PREEMPTED --finish--> PREEMPTED" in str(err)


def test_exit_from_terminal_state() -> None:
    bad = Row(S.FINISHED, E.LOOKUP, S.NEW)
    err = _reject([*TRANSITIONS, bad])
    assert err.kinds == {"terminal-exit"}
    assert err.problems[0].rows == (bad,)
    assert "FINISHED --lookup--> NEW" in str(err)


def test_a_callback_that_is_not_callable() -> None:
    """Rows hold callables; a name (the old API) is rejected."""
    bad = Row(S.NEW, E.RESUME, S.SAVING, after=("no_such_cb",))
    err = _reject([*TRANSITIONS, bad])
    assert err.kinds == {"bad-callback"}
    assert "'no_such_cb'" in str(err)
    assert err.problems[0].rows == (bad,)


def test_finish_missing_from_a_non_terminal_state() -> None:
    rows = _without((S.RESET, E.FINISH))
    err = _reject(rows)
    assert err.kinds == {"missing-total-event"}
    assert "RESET does not accept `finish`" in str(err)


def test_every_problem_is_reported_at_once() -> None:
    rows = [
        *_without((S.RESET, E.ABORT)),
        Row(S.ABORTED, E.LOOKUP, S.NEW),
        Row(S.NEW, E.LOOKUP, S.SAVING),
    ]
    err = _reject(rows)
    assert err.kinds == {
        "missing-total-event",
        "terminal-exit",
        "duplicate-row",
    }
    assert len(err.problems) == 3
    assert "3 problems" in str(err)
