"""The private `transitions.Machine` behind every `LifecycleMachine`.

A machine registers its table's rows, guards and enter hooks with one
`transitions.Machine` (``auto_transitions=False``, no model) and compiles
its fast dispatch from that machine's own event objects, so the fast path
and transitions' stock trigger path share one definition.  The stock path
is the test oracle (`lifecycle.testing.fire_stock`): nothing outside
`lifecycle` reaches the `transitions` machine.
"""

from __future__ import annotations

from typing import Any

from transitions import EventData, Machine

from lifecycle.table import Callback, Guard, Table, event_name


class TxCallback:
    """Adapts a ``(tracker, data)`` callback to transitions' calling."""

    __slots__ = ("target",)

    def __init__(self, target: Callback) -> None:
        self.target = target

    def __call__(self, event_data: EventData) -> None:
        self.target(event_data.model, event_data.kwargs.get("data"))


class TxGuard:
    """Adapts a ``(tracker, data)`` guard to a transitions condition."""

    __slots__ = ("target",)

    def __init__(self, target: Guard) -> None:
        self.target = target

    def __call__(self, event_data: EventData) -> bool:
        return bool(
            self.target(event_data.model, event_data.kwargs.get("data"))
        )


def stock_machine(table: Table[Any, Any, Any, Any]) -> Machine:
    """The `transitions.Machine` of `table` (no model).

    Rows sharing a (source, event) are registered in table order:
    transitions tries them in that order and applies the first whose
    guard passes, as the fast path does.
    """
    config = [
        {
            "trigger": event_name(r.event),
            "source": r.source,
            "dest": r.dest,
            "after": [TxCallback(cb) for cb in (*r.after, *r.always)],
            "conditions": [TxGuard(r.guard)] if r.guard is not None else [],
        }
        for r in table.rows
    ]
    machine = Machine(
        model=None,
        states=list(table.states),
        transitions=config,
        initial=table.initial,
        auto_transitions=False,
        ignore_invalid_triggers=True,
        send_event=True,
        name=table.name,
    )
    for state, hooks in table.on_enter.items():
        tx_state = machine.get_state(state.name)
        for hook in hooks:
            tx_state.add_callback("enter", TxCallback(hook))
    return machine
