"""Must FAIL `mypy --strict`, exactly on the lines marked ``# E:``.

The table of tests/user_lifecycle.py is annotated; misuse of it (in order:
a misspelled event, another machine's event enum, a bare string, another
enum through the registry, a misspelled tracker field, data of the wrong
type, a tracker of another table's states, the same fired directly, the
base class where the callbacks need the table's own tracker class).
"""

from __future__ import annotations

from lifecycle import LifecycleMachine, Registry, Tracker
from lifecycle.kv import Event, KVTracker
from tests.user_lifecycle import TABLE, JobEvent, JobTracker

machine = LifecycleMachine(TABLE)
registry = Registry(machine, JobTracker)
tracker = registry.get_or_create("r")
machine.fire(tracker, JobEvent.FINSH)  # E: "type[JobEvent]" has no attribute "FINSH"
machine.fire(tracker, Event.FINISH)  # E: incompatible type "Event"; expected "JobEvent"
registry.fire("r", "finish")  # E: Argument 2 to "fire" of "Registry" has incompatible type "str"; expected "JobEvent"
registry.fire("r", Event.ABORT)  # E: Argument 2 to "fire" of "Registry" has incompatible type "Event"; expected "JobEvent"
tracker.attemps += 1  # E: "JobTracker" has no attribute "attemps"
machine.fire(tracker, JobEvent.RECEIVED, data="many")  # E: incompatible type "str"; expected "int | None"
Registry(machine, KVTracker)  # E: Cannot infer value of type parameter "T" of "Registry"
machine.fire(KVTracker("k"), JobEvent.ALLOC)  # E: incompatible type "KVTracker"; expected "JobTracker"
Registry(machine, Tracker)  # E: Argument 2 to "Registry" has incompatible type "type[Tracker[S, K]]"; expected "_KeyedFactory[str, JobTracker]"
