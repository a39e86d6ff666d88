"""Typed request-lifecycle state machines, generic over your own enums.

A declarative `Table` of `Row`s over your state and event enums is the
single source of truth of a lifecycle; a shared `LifecycleMachine` (backed
by `transitions`, with a precompiled dispatch) applies it to `Tracker`
records, and a `Registry` maps keys to trackers and drops them at
terminal states.  An illegal ordering is a counted, logged no-op (strict
mode raises), never a crash.  The KV-cache connector's lifecycle is one
instance: `lifecycle.kv`.

Typical use (fire through the registry: by key, or with the tracker in
hand)::

    machine = LifecycleMachine(TABLE)
    registry = Registry(machine, MyTracker)
    tracker = registry.get_or_create("req-1")
    registry.fire("req-1", MyEvent.START, data=...)
    registry.fire_on(tracker, MyEvent.FINISH)

Test helpers (generated tests, the stock `transitions` oracle) live in
`lifecycle.testing`; traces in `lifecycle.trace`; diagrams in
`lifecycle.render`.
"""

from lifecycle.errors import (
    GuardRefused,
    IllegalTransition,
    InvalidTable,
    LifecycleError,
    ReentrantFire,
    TableProblem,
    UnknownRequest,
)
from lifecycle.machine import (
    LifecycleMachine,
    Observer,
    Outcome,
    RejectObserver,
    atomic,
)
from lifecycle.registry import Registry, TrackerFactory
from lifecycle.table import Row, Table
from lifecycle.tracker import Tracker, define_tracker

__all__ = [
    "GuardRefused",
    "IllegalTransition",
    "InvalidTable",
    "LifecycleError",
    "LifecycleMachine",
    "Observer",
    "Outcome",
    "ReentrantFire",
    "Registry",
    "RejectObserver",
    "Row",
    "Table",
    "TableProblem",
    "Tracker",
    "TrackerFactory",
    "UnknownRequest",
    "atomic",
    "define_tracker",
]
