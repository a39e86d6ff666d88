"""Exceptions raised by `lifecycle`.

Every exception carries the data that explains it as attrs fields, so
callers and tests never parse messages, and pickles by them for free
(errors cross process boundaries, vLLM's engine core among them).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from lifecycle.table import Row


def _spelled(event: enum.Enum) -> str:
    value = event.value
    return value if isinstance(value, str) else event.name


def _in(table: str | None) -> str:
    return "" if table is None else f"table {table}: "


class LifecycleError(Exception):
    """Base class of every error raised by `lifecycle`."""


@attrs.define(auto_exc=True, slots=False)
class IllegalTransition(LifecycleError):
    """An event has no row for the tracker's current state (strict mode).

    Attributes:
        state: The tracker's state when the event arrived (unchanged).
        event: The event that was refused.
        req_id: The request the tracker belongs to, or None when unknown.
        epoch: The tracker's epoch, or None when the request is unknown.
        table: The name of the table whose machine refused the event.
    """

    state: enum.Enum | None
    event: enum.Enum
    req_id: object
    epoch: int | None = None
    table: str | None = None

    def __str__(self) -> str:
        state = self.state
        where = state.name if state is not None else "an unknown request"
        return (
            f"{_in(self.table)}`{_spelled(self.event)}` is not allowed in "
            f"{where} (request {self.req_id})"
        )


@attrs.define(auto_exc=True, slots=False)
class UnknownRequest(IllegalTransition):
    """An event names a request id that the registry does not track.

    Built from the event and the id alone; `state` and `epoch` are None.
    """

    state: enum.Enum | None = attrs.field(default=None, init=False)
    epoch: int | None = attrs.field(default=None, init=False)


@attrs.define(auto_exc=True, slots=False)
class GuardRefused(LifecycleError):
    """Every guard of the rows for (state, event) said no (strict mode).

    Attributes:
        state: The tracker's state (unchanged).
        event: The event.
        req_id: The request the tracker belongs to.
        epoch: The tracker's epoch.
        rows: The guarded rows that were tried, in order.
        table: The name of the table.
    """

    state: enum.Enum
    event: enum.Enum
    req_id: object
    epoch: int
    rows: tuple[Row[Any, Any, Any, Any], ...] = ()
    table: str | None = None

    def __str__(self) -> str:
        tried = ", ".join(f"`{r}`" for r in self.rows)
        return (
            f"{_in(self.table)}every guard refused "
            f"`{_spelled(self.event)}` in {self.state.name} (request "
            f"{self.req_id}; rows tried: {tried or 'none'})"
        )


@attrs.define(auto_exc=True, slots=False)
class ReentrantFire(LifecycleError):
    """A callback, guard or observer fired an event during a transition.

    Callbacks and observers run inside the machine's transition (under its
    lock); an event fired from one would deadlock or interleave.  Return
    what must happen next and fire it after the first `fire` returned.

    Attributes:
        event: The event fired from inside.
        req_id: Its request.
        table: The name of the table.
    """

    event: enum.Enum
    req_id: object
    table: str | None = None

    def __str__(self) -> str:
        return (
            f"{_in(self.table)}`{_spelled(self.event)}` for request "
            f"{self.req_id} was fired from inside a transition: callbacks, "
            "guards and observers must not fire events (fire it after "
            "`fire` returns)"
        )


@attrs.frozen
class TableProblem:
    """One defect found while validating a transition table.

    Attributes:
        kind: A short machine-readable tag, e.g. ``"duplicate-row"``.
        detail: A human-readable sentence naming the offending rows.
        rows: The offending rows, if the defect is about rows.
    """

    kind: str
    detail: str
    rows: tuple[Row[Any, Any, Any, Any], ...] = ()

    def __repr__(self) -> str:
        return f"TableProblem({self.kind!r}, {self.detail!r})"


@attrs.define(auto_exc=True, slots=False)
class InvalidTable(LifecycleError):
    """A transition table failed validation when it was built.

    Attributes:
        problems: Every defect found, not only the first.
    """

    problems: tuple[TableProblem, ...]

    def __str__(self) -> str:
        lines = "\n".join(f"  - [{p.kind}] {p.detail}" for p in self.problems)
        return (
            f"invalid transition table ({len(self.problems)} problems):"
            f"\n{lines}"
        )

    @property
    def kinds(self) -> frozenset[str]:
        """The distinct problem kinds, for tests and callers."""
        return frozenset(p.kind for p in self.problems)
