"""Event data: ``fire(..., data=)`` reaches every guard and callback.

And ``Row(always=...)``: callbacks that also run when the event arrives
stale, so a release owed whatever the epoch is never lost.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import pytest

from lifecycle import (
    InvalidTable,
    LifecycleMachine,
    Registry,
    Row,
    Table,
    Tracker,
    define_tracker,
)
from lifecycle.testing import fire_stock
from tests.user_lifecycle import TABLE, JobEvent, JobTracker


class St(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    DONE = "done"


class Ev(enum.Enum):
    START = "start"
    STORED = "stored"
    BUMP = "bump"
    FINISH = "finish"


@define_tracker
class Job(Tracker[St]):
    state: St = St.IDLE
    seen: list[tuple[str, object]] = attrs.field(factory=list)
    held: int = 0


def enter_busy(tracker: Job, data: object) -> None:
    tracker.seen.append(("enter", data))


def note(tracker: Job, data: object) -> None:
    tracker.seen.append(("after", data))


def allowed(tracker: Job, data: object) -> bool:
    tracker.seen.append(("guard", data))
    return data != "refuse"


def hold(tracker: Job, data: object) -> None:
    tracker.held += 1


def release(tracker: Job, data: object) -> None:
    tracker.seen.append(("release", data))
    tracker.held -= 1


def bump(tracker: Job, _data: object) -> None:
    tracker.epoch += 1


JOB_TABLE: Table[St, Ev, Any] = Table(
    [
        Row(St.IDLE, Ev.START, St.BUSY, after=(note, hold), guard=allowed),
        Row(St.IDLE, Ev.FINISH, St.DONE),
        Row(St.BUSY, Ev.BUMP, St.BUSY, after=(bump,)),
        Row(St.BUSY, Ev.STORED, St.IDLE, always=(release,)),
        Row(St.BUSY, Ev.FINISH, St.DONE),
    ],
    initial=St.IDLE,
    terminal={St.DONE},
    total_events={Ev.FINISH},
    on_enter={St.BUSY: (enter_busy,)},
    name="job",
)


class TestEventData:
    def test_data_reaches_guard_enter_hook_and_after(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        assert machine.fire(job, Ev.START, data={"blocks": 3})
        want = {"blocks": 3}
        assert job.seen == [("guard", want), ("enter", want), ("after", want)]

    def test_data_defaults_to_none(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        assert machine.fire(job, Ev.START)
        assert job.seen == [("guard", None), ("enter", None), ("after", None)]

    def test_the_guard_decides_on_the_data(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        assert not machine.fire(job, Ev.START, data="refuse")
        assert job.state is St.IDLE
        assert machine.fire(job, Ev.START, data="ok")
        assert job.state is St.BUSY

    def test_the_registry_passes_data_on_both_paths(self) -> None:
        registry = Registry(LifecycleMachine(JOB_TABLE), Job)
        job = registry.get_or_create("j")
        assert registry.fire("j", Ev.START, data=1)
        assert registry.fire_on(job, Ev.STORED, data=2)
        assert ("after", 1) in job.seen
        assert ("release", 2) in job.seen

    def test_the_stock_path_passes_the_same_data(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        fast, stock = Job("a"), Job("a")
        assert machine.fire(fast, Ev.START, data=7)
        assert fire_stock(machine, stock, Ev.START, data=7)
        assert (
            fast.seen
            == stock.seen
            == [
                ("guard", 7),
                ("enter", 7),
                ("after", 7),
            ]
        )

    def test_a_user_table_gets_typed_data(self) -> None:
        machine = LifecycleMachine(TABLE)
        tracker = JobTracker("r")
        assert machine.fire(tracker, JobEvent.ALLOC)
        assert machine.fire(tracker, JobEvent.RECEIVED, data=128)
        assert tracker.received == 128


class TestAlwaysCallbacks:
    def test_always_runs_when_the_row_applies(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        machine.fire(job, Ev.START)
        assert machine.fire(job, Ev.STORED, epoch=0, data="blk")
        assert (job.state, job.held) == (St.IDLE, 0)
        assert job.seen[-1] == ("release", "blk")

    def test_always_runs_for_a_stale_completion_without_a_move(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        machine.fire(job, Ev.START)
        machine.fire(job, Ev.BUMP)  # a new epoch: the old store is stale
        assert job.epoch == 1
        assert not machine.fire(job, Ev.STORED, epoch=0, data="old")
        assert job.state is St.BUSY  # not applied
        assert machine.stale_counts[(St.BUSY, Ev.STORED)] == 1
        assert job.held == 0  # but what it held is released
        assert job.seen[-1] == ("release", "old")

    def test_always_runs_when_stale_in_a_state_without_that_row(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j")
        machine.fire(job, Ev.START)
        machine.fire(job, Ev.BUMP)
        machine.fire(job, Ev.FINISH)  # DONE has no `stored` row
        assert not machine.fire(job, Ev.STORED, epoch=0, data="late")
        assert job.state is St.DONE
        assert (job.held, job.seen[-1]) == (0, ("release", "late"))

    def test_plain_after_callbacks_do_not_run_when_stale(self) -> None:
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(JOB_TABLE)
        job = Job("j", epoch=1)
        assert not machine.fire(job, Ev.START, epoch=0, data="x")
        assert job.seen == []
        assert job.held == 0

    def test_a_failing_always_callback_is_counted_or_raised(self) -> None:
        def boom(tracker: Job, data: object) -> None:
            raise RuntimeError(data)

        table: Table[St, Ev] = Table(
            [
                Row(St.IDLE, Ev.START, St.BUSY),
                Row(St.IDLE, Ev.FINISH, St.DONE),
                Row(St.BUSY, Ev.STORED, St.IDLE, always=(boom,)),
                Row(St.BUSY, Ev.FINISH, St.DONE),
            ],
            initial=St.IDLE,
            terminal={St.DONE},
            name="boom",
        )
        machine: LifecycleMachine[St, Ev, Job] = LifecycleMachine(table)
        job = Job("j")
        machine.fire(job, Ev.START)
        job.epoch = 1
        assert not machine.fire(job, Ev.STORED, epoch=0)
        assert machine.callback_errors[(St.BUSY, Ev.STORED)] == 1
        assert (job.state, job.epoch) == (St.BUSY, 1)
        strict: LifecycleMachine[St, Ev, Job] = LifecycleMachine(
            table, strict=True
        )
        with pytest.raises(RuntimeError, match="late"):
            strict.fire(job, Ev.STORED, epoch=0, data="late")


class TestCallbackArity:
    def test_a_one_argument_callback_is_refused_when_built(self) -> None:
        def old_style(tracker: Job) -> None:
            pass

        with pytest.raises(InvalidTable) as err:
            Table(
                [
                    Row(St.IDLE, Ev.START, St.BUSY, after=(old_style,)),
                    Row(St.IDLE, Ev.FINISH, St.DONE),
                    Row(St.BUSY, Ev.FINISH, St.DONE),
                ],
                initial=St.IDLE,
                terminal={St.DONE},
            )
        assert err.value.kinds == {"bad-callback"}
        assert "(tracker, data)" in str(err.value)

    def test_a_one_argument_guard_or_enter_hook_is_refused(self) -> None:
        def old_guard(tracker: Job) -> bool:
            return True

        with pytest.raises(InvalidTable) as err:
            Table(
                [
                    Row(St.IDLE, Ev.START, St.BUSY, guard=old_guard),
                    Row(St.IDLE, Ev.FINISH, St.DONE),
                    Row(St.BUSY, Ev.FINISH, St.DONE),
                ],
                initial=St.IDLE,
                terminal={St.DONE},
                on_enter={St.BUSY: (lambda t: None,)},
            )
        assert len(err.value.problems) == 2
        assert err.value.kinds == {"bad-callback"}
