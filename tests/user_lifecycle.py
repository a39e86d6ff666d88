"""A lifecycle a connector author could write: public `lifecycle` API only.

A consumer that receives remote KV before running.  Its ABORTED state is
*not* terminal (a bounded retry goes back to WAITING), its events are a
plain `enum.Enum`, and its states use `enum.auto()` values: nothing here
resembles the KV lifecycle's enums.
"""

from __future__ import annotations

import enum

import attrs

from lifecycle import Row, Table, Tracker, define_tracker

MAX_ATTEMPTS = 3


class JobState(enum.Enum):
    """Where one consumer request stands."""

    WAITING = enum.auto()
    RECEIVING = enum.auto()
    RUNNING = enum.auto()
    ABORTED = enum.auto()
    DONE = enum.auto()


class JobEvent(enum.Enum):
    """What the consumer's hooks report."""

    ALLOC = "alloc"
    RECEIVED = "received"
    RECV_FAILED = "recv_failed"
    ABORT = "abort"
    RETRY = "retry"
    FINISH = "finish"


@define_tracker
class JobTracker(Tracker[JobState]):
    """A consumer request: its blocks, receive progress and attempts."""

    state: JobState = JobState.WAITING
    blocks: list[int] = attrs.field(factory=list)
    receiving: int = 0
    received: int = 0
    attempts: int = 0
    runs: int = 0


def settle(tracker: JobTracker, received: int | None = None) -> None:
    """Nothing is being received any more; `received` tokens arrived."""
    tracker.receiving = 0
    if received:
        tracker.received += received


def release(tracker: JobTracker, _data: object = None) -> None:
    """Forget the blocks."""
    tracker.blocks.clear()


def count_attempt(tracker: JobTracker, _data: object = None) -> None:
    """One more try."""
    tracker.attempts += 1


def can_retry(tracker: JobTracker, _data: object = None) -> bool:
    """Retry while attempts remain."""
    return tracker.attempts < MAX_ATTEMPTS


def started(tracker: JobTracker, _data: object = None) -> None:
    """Enter hook of RUNNING."""
    tracker.runs += 1


S, E = JobState, JobEvent

TABLE: Table[JobState, JobEvent, int | None, JobTracker] = Table(
    [
        Row(S.WAITING, E.ALLOC, S.RECEIVING),
        Row(S.WAITING, E.ABORT, S.ABORTED),
        Row(S.WAITING, E.FINISH, S.DONE),
        Row(S.RECEIVING, E.RECEIVED, S.RUNNING, after=(settle,)),
        Row(S.RECEIVING, E.RECV_FAILED, S.ABORTED, after=(settle, release)),
        Row(S.RECEIVING, E.ABORT, S.ABORTED, after=(settle, release)),
        Row(S.RECEIVING, E.FINISH, S.DONE, after=(settle, release)),
        Row(S.RUNNING, E.ABORT, S.ABORTED, after=(release,)),
        Row(S.RUNNING, E.FINISH, S.DONE, after=(release,)),
        Row(
            S.ABORTED,
            E.RETRY,
            S.WAITING,
            after=(count_attempt,),
            guard=can_retry,
        ),
        Row(S.ABORTED, E.FINISH, S.DONE),
    ],
    initial=S.WAITING,
    terminal={S.DONE},
    total_events=(E.FINISH,),
    on_enter={S.RUNNING: (started,)},
    name="consumer",
    title="Remote-KV consumer",
)
