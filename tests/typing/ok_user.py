"""Must pass `mypy --strict`: a user's lifecycle, no cast, no ignore."""

from __future__ import annotations

from lifecycle import LifecycleMachine, Registry, render
from lifecycle.testing import table_tests, tracker_in
from tests.user_lifecycle import TABLE, JobEvent, JobState, JobTracker

machine = LifecycleMachine(TABLE, strict=True)
registry = Registry(machine, JobTracker)
tracker: JobTracker = registry.get_or_create("r")
attempts: int = tracker.attempts
applied: bool = registry.fire("r", JobEvent.ALLOC)
machine.fire(tracker, JobEvent.RECEIVED, epoch=tracker.epoch, data=64)
state: JobState = tracker.state
illegal: int = machine.illegal_counts[(JobState.WAITING, JobEvent.RETRY)]
typed: LifecycleMachine[JobState, JobEvent, JobTracker] = LifecycleMachine(
    TABLE
)
driven: JobTracker = tracker_in(JobState.RUNNING, typed, JobTracker)
dot: str = render.to_dot(TABLE)
TestIt = table_tests(TABLE, JobTracker)
# The base class works over a table whose callbacks take any tracker of
# its states (tests/typing/docpath_ok.py); not over this one (bad_user.py).
