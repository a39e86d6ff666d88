"""Must FAIL `mypy --strict`, exactly on the lines marked ``# E:``.

Misuse of the documented path (tables not annotated: see docpath_ok.py).
"""

from __future__ import annotations

from lifecycle import LifecycleMachine, Registry, Tracker
from lifecycle.kv import Event
from tests.docpath_lifecycle import (
    PLAIN,
    TABLE,
    TYPED,
    PEvent,
    PTracker,
    make,
)

registry = Registry(LifecycleMachine(TABLE), PTracker)
tracker = registry.get_or_create("r")
registry.fire("r", "finish")  # E: incompatible type "str"; expected "PEvent"
registry.fire("r", Event.ABORT)  # E: incompatible type "Event"; expected "PEvent"
registry.fire_on(tracker, "abort")  # E: incompatible type "str"; expected "PEvent"
registry.fire_on(tracker, Event.ABORT)  # E: incompatible type "Event"; expected "PEvent"
registry.fire_if_tracked("r", "sent")  # E: incompatible type "str"; expected "PEvent"
registry.fire_if_tracked("r", Event.ABORT)  # E: incompatible type "Event"; expected "PEvent"
registry.fire("r", PEvent.FINSH)  # E: "type[PEvent]" has no attribute "FINSH"

typed = Registry(LifecycleMachine(TYPED), PTracker)
typed.fire("r", PEvent.SENT, data="3")  # E: Argument "data" to "fire" of "Registry" has incompatible type "str"; expected "int | None"
typed.fire_on(tracker, PEvent.SENT, data=b"")  # E: Argument "data" to "fire_on" of "Registry" has incompatible type "bytes"; expected "int | None"
typed.fire_if_tracked("r", PEvent.SENT, data=1.5)  # E: Argument "data" to "fire_if_tracked" of "Registry" has incompatible type "float"; expected "int | None"
typed.fire("r", "sent", data=1)  # E: incompatible type "str"; expected "PEvent"

base = Registry(LifecycleMachine(PLAIN), Tracker)
base.fire("b", "finish")  # E: incompatible type "str"; expected "PEvent"
base.fire("b", Event.ABORT)  # E: incompatible type "Event"; expected "PEvent"
base.fire("b", PEvent.FINISH, data=1)  # E: Argument "data" to "fire" of "Registry" has incompatible type "int"; expected "None"
base.fire_on(base.get_or_create("b"), PEvent.ABORT, data="x")  # E: Argument "data" to "fire_on" of "Registry" has incompatible type "str"; expected "None"

made = Registry(LifecycleMachine(TABLE), make)
made.fire("m", "finish")  # E: incompatible type "str"; expected "PEvent"
made.fire_if_tracked("m", Event.ABORT)  # E: incompatible type "Event"; expected "PEvent"
