"""Transition-table tests generated from `lifecycle.kv.TABLE`."""

from __future__ import annotations

import pytest

from lifecycle import LifecycleMachine
from lifecycle.kv import TABLE, TERMINAL, Event, KVTracker, State
from lifecycle.testing import (
    Case,
    check_case,
    machine_mismatches,
    matrix,
    pytest_cases,
    shortest_paths,
    tracker_in,
)


@pytest.mark.parametrize("case", pytest_cases(TABLE))
def test_every_state_event_pair(case: Case) -> None:
    """Legal: target. Illegal: unchanged, counted, logged; strict raises."""
    check_case(case, TABLE, KVTracker)


def test_matrix_is_the_full_product() -> None:
    cases = matrix(TABLE)
    assert len(cases) == len(TABLE.states) * len(Event)
    assert sum(c.legal for c in cases) == len(TABLE.rows)


def test_machine_agrees_with_table_edge_for_edge() -> None:
    assert machine_mismatches(LifecycleMachine(TABLE)) == []


def test_shortest_paths_reach_every_state() -> None:
    paths = shortest_paths(TABLE)
    assert set(paths) == set(TABLE.states)
    machine = LifecycleMachine(TABLE, strict=True)
    for state in TABLE.states:
        assert tracker_in(state, machine, KVTracker).state is state


def test_finish_and_abort_accepted_from_every_non_terminal_state() -> None:
    for state in TABLE.states:
        accepted = TABLE.events_from(state)
        if state in TERMINAL:
            assert accepted == ()
        else:
            assert Event.FINISH in accepted
            assert Event.ABORT in accepted


def test_no_save_while_loading() -> None:
    """A load and a save are never co-queued (vLLM #43371)."""
    assert TABLE.dest(State.LOADING, Event.SAVE_ISSUED) is None
    assert TABLE.dest(State.DRAINING, Event.SAVE_ISSUED) is None


def test_preempt_bumps_epoch_and_releases_blocks() -> None:
    machine = LifecycleMachine(TABLE, strict=True)
    tracker = tracker_in(State.SAVING, machine, KVTracker)
    tracker.block_ids.extend([3, 4])
    tracker.pending_jobs.add(7)
    assert machine.fire(tracker, Event.PREEMPT)
    assert (tracker.epoch, tracker.block_ids) == (1, [])
    assert tracker.pending_jobs == set()
