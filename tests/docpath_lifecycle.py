"""A lifecycle written as README.md and docs/define-your-own.rst show it.

Nothing annotated (no ``Table[...]``): mypy infers every type, which
tests/typing/docpath_ok.py pins and tests/typing/docpath_bad.py misuses.
"""

from __future__ import annotations

import enum

import attrs

from lifecycle import (
    Row,
    Table,
    Tracker,
    define_tracker,
)


class PState(enum.Enum):
    WAITING = "waiting"
    SENDING = "sending"
    DONE = "done"
    ABORTED = "aborted"


class PEvent(enum.Enum):
    FINISH = "finish"
    SENT = "sent"
    ABORT = "abort"


@define_tracker
class PTracker(Tracker[PState]):
    state: PState = PState.WAITING
    blocks: list[int] = attrs.field(factory=list)


def release(tracker: PTracker, data: object) -> None:
    tracker.blocks.clear()


def count(tracker: PTracker, sent: int | None) -> None:
    if sent:
        tracker.blocks.append(sent)


# README: callbacks take `data: object`, one row has none.
TABLE = Table(
    [
        Row(PState.WAITING, PEvent.FINISH, PState.SENDING),
        Row(PState.WAITING, PEvent.ABORT, PState.ABORTED, after=(release,)),
        Row(PState.SENDING, PEvent.SENT, PState.DONE, after=(release,)),
        Row(PState.SENDING, PEvent.ABORT, PState.ABORTED, after=(release,)),
    ],
    initial=PState.WAITING,
    terminal={PState.DONE, PState.ABORTED},
    total_events=(PEvent.ABORT,),
    name="producer",
)
# A table whose callbacks type the data: the rows without callbacks do not
# widen it.
TYPED = Table(
    [
        Row(PState.WAITING, PEvent.FINISH, PState.SENDING),
        Row(PState.WAITING, PEvent.ABORT, PState.ABORTED),
        Row(PState.SENDING, PEvent.SENT, PState.DONE, after=(count,)),
        Row(PState.SENDING, PEvent.ABORT, PState.ABORTED),
    ],
    initial=PState.WAITING,
    terminal={PState.DONE, PState.ABORTED},
)
# No callbacks at all: no data but None.
PLAIN = Table(
    [
        Row(PState.WAITING, PEvent.FINISH, PState.DONE),
        Row(PState.WAITING, PEvent.ABORT, PState.ABORTED),
    ],
    initial=PState.WAITING,
    terminal={PState.DONE, PState.ABORTED},
    states=(PState.WAITING, PState.DONE, PState.ABORTED),
)


# Over a custom factory.
def make(req_id: str) -> PTracker:
    return PTracker(req_id)
