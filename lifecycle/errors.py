"""Exceptions raised by `lifecycle`.

Every exception carries the data that explains it as attributes, so callers
and tests never parse messages.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lifecycle.table import Row


def _spelled(event: enum.Enum) -> str:
    value = event.value
    return value if isinstance(value, str) else event.name


class LifecycleError(Exception):
    """Base class of every error raised by `lifecycle`."""


class IllegalTransition(LifecycleError):  # noqa: N818 - the spec's name
    """An event has no row for the tracker's current state (strict mode).

    Attributes:
        state: The tracker's state when the event arrived (unchanged).
        event: The event that was refused.
        req_id: The request the tracker belongs to, or None when unknown.
        epoch: The tracker's epoch, or None when the request is unknown.
    """

    def __init__(
        self,
        state: enum.Enum | None,
        event: enum.Enum,
        req_id: str | None,
        epoch: int | None = None,
    ) -> None:
        self.state = state
        self.event = event
        self.req_id = req_id
        self.epoch = epoch
        where = state.name if state is not None else "an unknown request"
        msg = (
            f"`{_spelled(event)}` is not allowed in {where} (request {req_id})"
        )
        super().__init__(msg)


class UnknownRequest(IllegalTransition):
    """An event names a request id that the registry does not track."""

    def __init__(self, event: enum.Enum, req_id: str) -> None:
        super().__init__(None, event, req_id)


class TableProblem:
    """One defect found while validating a transition table.

    Attributes:
        kind: A short machine-readable tag, e.g. ``"duplicate-row"``.
        detail: A human-readable sentence naming the offending rows.
        rows: The offending rows, if the defect is about rows.
    """

    __slots__ = ("detail", "kind", "rows")

    def __init__(
        self, kind: str, detail: str, rows: tuple[Row[Any, Any], ...] = ()
    ) -> None:
        self.kind = kind
        self.detail = detail
        self.rows = rows

    def __repr__(self) -> str:
        return f"TableProblem({self.kind!r}, {self.detail!r})"


class InvalidTable(LifecycleError):  # noqa: N818 - reads as a verdict
    """A transition table failed validation when it was built.

    Attributes:
        problems: Every defect found, not only the first.
    """

    def __init__(self, problems: tuple[TableProblem, ...]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - [{p.kind}] {p.detail}" for p in problems)
        msg = f"invalid transition table ({len(problems)} problems):\n{lines}"
        super().__init__(msg)

    @property
    def kinds(self) -> frozenset[str]:
        """The distinct problem kinds, for tests and callers."""
        return frozenset(p.kind for p in self.problems)
