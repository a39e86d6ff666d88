"""Must pass `mypy --strict`: the documented path keeps its types.

The lifecycle of tests/docpath_lifecycle.py is written as README.md and
docs/define-your-own.rst show it, nothing annotated; every
``assert_type`` pins what mypy infers from it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import assert_type

from lifecycle import LifecycleMachine, Registry, Table, Tracker, render
from tests.docpath_lifecycle import (
    PLAIN,
    TABLE,
    TYPED,
    PEvent,
    PState,
    PTracker,
    make,
)

assert_type(TABLE, Table[PState, PEvent, object, PTracker])

machine = LifecycleMachine(TABLE)
assert_type(machine, LifecycleMachine[PState, PEvent, PTracker, object])
registry = Registry(machine, PTracker)
assert_type(registry, Registry[PState, PEvent, PTracker, object])
tracker = registry.get_or_create("req-1")
assert_type(tracker, PTracker)
assert_type(registry.get("req-1"), PTracker | None)
assert_type(registry.fire("req-1", PEvent.FINISH), bool)
assert_type(registry.fire("req-1", PEvent.SENT, data=3), bool)
assert_type(registry.fire_on(tracker, PEvent.ABORT), bool)
assert_type(registry.fire_on(tracker, PEvent.ABORT, data="any"), bool)
assert_type(registry.fire_if_tracked("req-1", PEvent.SENT), bool)
assert_type(registry.fire_if_tracked("req-1", PEvent.SENT, data=[1]), bool)
assert_type(machine.illegal_counts[(None, PEvent.SENT)], int)
assert_type(tracker.state, PState)
strict = LifecycleMachine(TABLE, strict=True)
assert_type(strict.table, Table[PState, PEvent, object, PTracker])
assert_type(render.to_dot(TABLE), str)

assert_type(TYPED, Table[PState, PEvent, int | None, PTracker])
typed = Registry(LifecycleMachine(TYPED), PTracker)
assert_type(typed, Registry[PState, PEvent, PTracker, int | None])
assert_type(typed.fire("r", PEvent.SENT, data=3), bool)
assert_type(typed.fire("r", PEvent.SENT, data=None), bool)
assert_type(typed.fire_on(typed.get_or_create("r"), PEvent.SENT, data=4), bool)
assert_type(typed.fire_if_tracked("r", PEvent.SENT, data=5), bool)

assert_type(
    PLAIN, Table[PState, PEvent, None, Tracker[PState, Hashable]]
)

# Over the base Tracker class: trackers start in the table's initial state.
base = Registry(LifecycleMachine(PLAIN), Tracker)
assert_type(
    base,
    Registry[PState, PEvent, Tracker[PState, Hashable], None, Hashable],
)
assert_type(base.get_or_create("b").state, PState)
assert_type(base.fire("b", PEvent.FINISH), bool)


made = Registry(machine, make)
assert_type(made, Registry[PState, PEvent, PTracker, object])
assert_type(made.get_or_create("m"), PTracker)
assert_type(made.fire("m", PEvent.FINISH, data=1), bool)
