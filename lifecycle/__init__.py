"""Typed KV request lifecycle state machines for LLM KV-cache connectors.

One declarative table (`lifecycle.table.TABLE`) defines the lifecycle; a
shared `transitions` machine with a precompiled dispatch applies it to
`attrs` trackers.  An illegal ordering is a counted, logged no-op (strict
mode raises), never a crash.

Typical use::

    machine = LifecycleMachine()
    registry = Registry(machine, Tracker)
    tracker = registry.get_or_create("req-1")
    registry.fire("req-1", Event.LOOKUP)
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
from lifecycle.states import TERMINAL, Event, State
from lifecycle.table import TABLE, TRANSITIONS, Row, Table
from lifecycle.tracker import CALLBACKS, Tracker

__all__ = [
    "CALLBACKS",
    "TABLE",
    "TERMINAL",
    "TRANSITIONS",
    "Event",
    "IllegalTransition",
    "InvalidTable",
    "LifecycleError",
    "LifecycleMachine",
    "Observer",
    "Registry",
    "RejectObserver",
    "Row",
    "State",
    "Table",
    "TableProblem",
    "Tracker",
    "UnknownRequest",
]
