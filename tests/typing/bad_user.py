"""Must FAIL `mypy --strict`, with the errors tests/test_typing.py asserts."""

from __future__ import annotations

from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import Event, KVTracker
from tests.user_lifecycle import TABLE, JobEvent, JobTracker

machine = LifecycleMachine(TABLE)
registry = Registry(machine, JobTracker)
tracker = registry.get_or_create("r")
machine.fire(tracker, JobEvent.FINSH)  # misspelled
machine.fire(tracker, Event.FINISH)  # another machine's event enum
registry.fire("r", "finish")  # a bare string
registry.fire("r", Event.ABORT)  # another enum, through the registry
tracker.attemps += 1  # misspelled tracker field
machine.fire(tracker, JobEvent.RECEIVED, data="many")  # wrong data type
Registry(machine, KVTracker)  # a tracker of another table's states
machine.fire(KVTracker("k"), JobEvent.ALLOC)  # the same, fired directly
