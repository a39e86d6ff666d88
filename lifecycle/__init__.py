"""Typed request-lifecycle state machines, generic over your own enums.

A declarative `Table` of `Row`s over your state and event enums is the
single source of truth of a lifecycle; a shared `LifecycleMachine` (backed
by `transitions`, with a precompiled dispatch) applies it to `Tracker`
records, and a `Registry` maps request ids to trackers and drops them at
terminal states.  An illegal ordering is a counted, logged no-op (strict
mode raises), never a crash.  The KV-cache connector's lifecycle is one
instance: `lifecycle.kv`.

Typical use::

    machine = LifecycleMachine(TABLE)
    registry = Registry(machine, MyTracker)
    tracker = registry.get_or_create("req-1")
    registry.fire("req-1", MyEvent.START)
"""

from lifecycle.errors import (
    IllegalTransition,
    InvalidTable,
    LifecycleError,
    TableProblem,
    UnknownRequest,
)
from lifecycle.machine import LifecycleMachine, Observer, RejectObserver
from lifecycle.registry import Registry
from lifecycle.table import Row, Table, event_name
from lifecycle.tracker import (
    Tracker,
    check_tracker_class,
    define_tracker,
)

__all__ = [
    "IllegalTransition",
    "InvalidTable",
    "LifecycleError",
    "LifecycleMachine",
    "Observer",
    "Registry",
    "RejectObserver",
    "Row",
    "Table",
    "TableProblem",
    "Tracker",
    "UnknownRequest",
    "check_tracker_class",
    "define_tracker",
    "event_name",
]
