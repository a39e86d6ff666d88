"""The admission lookup's own lifecycle: one table, beside the KV lifecycle.

A waiting request is looked up before vLLM admits it.  The scheduler
half keeps, per request, one `LookupTracker` in a registry over the
`LOOKUPS` table; the tracker *is* the lookup's state (no flags, no side
dicts):

ASKED
    A lookup is queued into this step's batch, not yet sent.
IN_FLIGHT
    Sent to the lookup thread; vLLM is answered "cannot tell yet".
ANSWERED
    The answer for `LookupTracker.key` is known (looked up, known
    without asking, or a miss past the deadline): vLLM gets it, as often
    as it asks, also once the request was admitted on it (``admit``).
REFRESHING
    Answered, and a short answer is asked again in the background; the
    request is admitted on the answer it has meanwhile.
DROPPED
    Terminal: the request ended, or was admitted before its lookup was
    answered.  The tracker leaves the registry.

Epochs fence stale answers: every lookup sent (``ask``, ``refresh``)
starts a new epoch, and the lookup thread's answer is fired with the
epoch it was sent in, so an answer to a lookup that was superseded (the
request asked for more blocks, was preempted, or dropped its refresh) is
a counted, logged no-op (`LifecycleMachine.stale_counts`), never cached.

Tracker fields change only in the table's callbacks, from the event's
data: ``ask``/``refresh`` carry an `Ask` (key, when), ``send`` the
message handed to the lookup thread, ``answer`` the answered tokens.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

from lifecycle import Row, Table, Tracker, define_tracker

__all__ = [
    "LOOKUPS",
    "Ask",
    "LookupEvent",
    "LookupState",
    "LookupTracker",
]


class LookupState(enum.Enum):
    """Where a request's admission lookup is."""

    ASKED = "asked"
    IN_FLIGHT = "in_flight"
    ANSWERED = "answered"
    REFRESHING = "refreshing"
    DROPPED = "dropped"

    # Singletons compared by identity: identity hashing is consistent
    # with equality and keeps the machine's dispatch lookups in C.
    __hash__ = object.__hash__


class LookupEvent(enum.StrEnum):
    """What happens to a request's admission lookup."""

    ASK = "ask"
    SEND = "send"
    ANSWER = "answer"
    TIME_OUT = "time_out"
    REFRESH = "refresh"
    ADMIT = "admit"
    DROP = "drop"


@attrs.frozen
class Ask:
    """The data of ``ask`` and ``refresh``: which lookup, and when.

    Attributes:
        key: (request epoch, blocks asked) the lookup answers.
        at: When it started (the lookups' clock).
    """

    key: tuple[int, int]
    at: float


@define_tracker
class LookupTracker(Tracker[LookupState]):
    """One request's admission lookup.

    Attributes:
        request: The request's KV tracker (a reused request id gets a new
            one, so identity fences it).
        key: (request epoch, blocks asked) of the lookup asked, or of the
            answer held once answered.
        at: When the lookup of `key` started (refreshes age from it).
        hit_tokens: Stored prefix tokens (valid once answered).
        pending: The message in flight to the lookup thread
            (`connector.scheduler.lookup.PendingLookup`), once sent.
    """

    state: LookupState = LookupState.ASKED
    request: Any = None
    key: tuple[int, int] = (-1, -1)
    at: float = 0.0
    hit_tokens: int = 0
    pending: Any = None


# The callbacks run inside the transition, after the state changed.


def start_lookup(tracker: LookupTracker, ask: Ask) -> None:
    """A new lookup: a new epoch, so any answer in flight goes stale."""
    tracker.epoch += 1
    tracker.key = ask.key
    tracker.at = ask.at
    tracker.pending = None


def start_refresh(tracker: LookupTracker, ask: Ask) -> None:
    """Ask the answered key again, keeping the answer meanwhile."""
    tracker.epoch += 1
    tracker.at = ask.at
    tracker.pending = None


def sent(tracker: LookupTracker, pending: Any) -> None:
    """The lookup went to the lookup thread as `pending`."""
    tracker.pending = pending


def take_answer(tracker: LookupTracker, tokens: int | None) -> None:
    """The lookup answered `tokens` (None: a miss past its deadline)."""
    tracker.hit_tokens = tokens or 0
    tracker.pending = None
    if tracker.request is not None:
        tracker.request.num_hit_tokens = tracker.hit_tokens


def give_up(tracker: LookupTracker, _data: object = None) -> None:
    """Past the deadline: a miss, and the late answer goes stale."""
    tracker.epoch += 1
    take_answer(tracker, 0)


def keep_answer(tracker: LookupTracker, _data: object = None) -> None:
    """The refresh ran out of time: the old answer stands.

    The late answer goes stale.
    """
    tracker.epoch += 1
    tracker.pending = None


def let_go(tracker: LookupTracker, _data: object = None) -> None:
    """Nothing is waited for any more: a late answer is stale."""
    tracker.epoch += 1
    tracker.pending = None


LS = LookupState
LE = LookupEvent

LOOKUPS: Final[Table[LookupState, LookupEvent, Any]] = Table(
    [
        # A new key (first ask, more blocks, a new request epoch).
        Row(LS.ASKED, LE.ASK, LS.ASKED, after=(start_lookup,)),
        Row(LS.IN_FLIGHT, LE.ASK, LS.ASKED, after=(start_lookup,)),
        Row(LS.ANSWERED, LE.ASK, LS.ASKED, after=(start_lookup,)),
        Row(LS.REFRESHING, LE.ASK, LS.ASKED, after=(start_lookup,)),
        Row(LS.ASKED, LE.SEND, LS.IN_FLIGHT, after=(sent,)),
        Row(LS.REFRESHING, LE.SEND, LS.REFRESHING, after=(sent,)),
        # An answer: looked up, or known without asking (from ASKED).
        Row(LS.ASKED, LE.ANSWER, LS.ANSWERED, after=(take_answer,)),
        Row(LS.IN_FLIGHT, LE.ANSWER, LS.ANSWERED, after=(take_answer,)),
        Row(LS.REFRESHING, LE.ANSWER, LS.ANSWERED, after=(take_answer,)),
        # Past the deadline: a miss; a refresh keeps its answer.
        Row(LS.ASKED, LE.TIME_OUT, LS.ANSWERED, after=(give_up,)),
        Row(LS.IN_FLIGHT, LE.TIME_OUT, LS.ANSWERED, after=(give_up,)),
        Row(LS.REFRESHING, LE.TIME_OUT, LS.ANSWERED, after=(keep_answer,)),
        Row(LS.ANSWERED, LE.REFRESH, LS.REFRESHING, after=(start_refresh,)),
        # vLLM admitted the request: on its answer (a refresh is no
        # longer needed), or before it had one.
        Row(LS.ANSWERED, LE.ADMIT, LS.ANSWERED),
        Row(LS.REFRESHING, LE.ADMIT, LS.ANSWERED, after=(let_go,)),
        Row(LS.ASKED, LE.ADMIT, LS.DROPPED, after=(let_go,)),
        Row(LS.IN_FLIGHT, LE.ADMIT, LS.DROPPED, after=(let_go,)),
        Row(LS.ASKED, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.IN_FLIGHT, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.ANSWERED, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.REFRESHING, LE.DROP, LS.DROPPED, after=(let_go,)),
    ],
    initial=LS.ASKED,
    terminal=(LS.DROPPED,),
    total_events=(LE.DROP, LE.ASK),
    name="admission-lookup",
    title="Admission lookup (scheduler side)",
)
"""A request's admission lookup: asked, in flight, answered, refreshed."""
