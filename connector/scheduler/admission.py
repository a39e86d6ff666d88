"""The admission lookup's own lifecycle: one table, beside the KV lifecycle.

A waiting request is looked up before vLLM admits it.  The scheduler
half keeps, per request, one `LookupTracker` in a registry over the
`LOOKUPS` table; the tracker *is* the lookup's state (no flags, no side
dicts):

ASKED
    vLLM asked about the request and nothing is decided yet: the
    initial state, left within the hook that created the tracker.
IN_FLIGHT
    A lookup is asked: queued into this step's batch, which goes to the
    lookup thread at the end of the step (or at once, in a burst's
    chunks); vLLM is answered "cannot tell yet".
ANSWERED
    The answer for `LookupTracker.key` is known (looked up, known
    without asking, or a miss past the deadline): vLLM gets it, as often
    as it asks.
REFRESHING
    Answered, and a short answer is asked again in the background; the
    request is admitted on the answer it has meanwhile.
DROPPED
    Terminal: the request was admitted (on its answer, or before it had
    one), or it ended.  The tracker leaves the registry.  (A preempted
    request allocated on its local hit still waits until it resumes:
    ``allocate`` keeps its answer for vLLM to ask again.)

Epochs fence stale answers: every lookup sent (``ask``, ``refresh``) and
every answer known without asking (``know``) starts a new epoch, and the
lookup thread's answer is fired with the epoch it was sent in, so an
answer to a lookup that was superseded (the request asked for more
blocks, was preempted, or dropped its refresh) is a counted, logged
no-op (`LifecycleMachine.stale_counts`), never cached.

Tracker fields change only in the table's callbacks, from the event's
data: ``ask``/``refresh`` carry the message handed to the lookup thread
(`connector.scheduler.lookup.PendingLookup`: key, when, epoch), ``know``
a `Known` answer, ``answer`` the answered tokens.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

from lifecycle import Row, Table, Tracker, define_tracker

__all__ = [
    "LOOKUPS",
    "Known",
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
    KNOW = "know"
    ANSWER = "answer"
    TIME_OUT = "time_out"
    REFRESH = "refresh"
    ALLOCATE = "allocate"
    ADMIT = "admit"
    DROP = "drop"


@attrs.define
class Known:
    """The data of ``know``: an answer known without asking the store.

    Built at admission (a plain attrs record: a frozen one builds 2.5
    times slower); the callback only reads it.

    Attributes:
        key: (request epoch, blocks asked) it answers.
        at: When it became known (the lookups' clock).
        tokens: Stored prefix tokens.
    """

    key: tuple[int, int]
    at: float
    tokens: int


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
        pending: The message to the lookup thread
            (`connector.scheduler.lookup.PendingLookup`) while a lookup
            is asked (in flight or refreshing).
    """

    state: LookupState = LookupState.ASKED
    request: Any = None
    key: tuple[int, int] = (-1, -1)
    at: float = 0.0
    hit_tokens: int = 0
    pending: Any = None


# The callbacks run inside the transition, after the state changed.


def start_lookup(tracker: LookupTracker, pending: Any) -> None:
    """A new lookup, sent as `pending`: any answer in flight goes stale.

    `pending` (a `PendingLookup`) carries the key, its start and the
    epoch this moves the tracker to.
    """
    tracker.epoch += 1
    tracker.key = pending.key
    tracker.at = pending.at
    tracker.pending = pending


def start_refresh(tracker: LookupTracker, pending: Any) -> None:
    """Ask the answered key again as `pending`, keeping the answer."""
    tracker.epoch += 1
    tracker.at = pending.at
    tracker.pending = pending


def take_answer(tracker: LookupTracker, tokens: int | None) -> None:
    """The lookup answered `tokens` (None: a miss past its deadline)."""
    tracker.hit_tokens = tokens or 0
    tracker.pending = None
    if tracker.request is not None:
        tracker.request.num_hit_tokens = tracker.hit_tokens


def know(tracker: LookupTracker, known: Known) -> None:
    """An answer known without asking: any answer in flight goes stale."""
    tracker.epoch += 1
    tracker.key = known.key
    tracker.at = known.at
    take_answer(tracker, known.tokens)


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

LOOKUPS: Final[Table[LookupState, LookupEvent, Any, LookupTracker]] = Table(
    [
        # A lookup sent for a new key (first ask, more blocks, a new
        # request epoch), or sent again (deferred by a load in flight).
        Row(LS.ASKED, LE.ASK, LS.IN_FLIGHT, after=(start_lookup,)),
        Row(LS.IN_FLIGHT, LE.ASK, LS.IN_FLIGHT, after=(start_lookup,)),
        Row(LS.ANSWERED, LE.ASK, LS.IN_FLIGHT, after=(start_lookup,)),
        Row(LS.REFRESHING, LE.ASK, LS.IN_FLIGHT, after=(start_lookup,)),
        # An answer known without asking (a full local hit, a recent
        # miss, too many lookups in flight).
        Row(LS.ASKED, LE.KNOW, LS.ANSWERED, after=(know,)),
        Row(LS.IN_FLIGHT, LE.KNOW, LS.ANSWERED, after=(know,)),
        Row(LS.ANSWERED, LE.KNOW, LS.ANSWERED, after=(know,)),
        Row(LS.REFRESHING, LE.KNOW, LS.ANSWERED, after=(know,)),
        # The lookup thread's answer.
        Row(LS.IN_FLIGHT, LE.ANSWER, LS.ANSWERED, after=(take_answer,)),
        Row(LS.REFRESHING, LE.ANSWER, LS.ANSWERED, after=(take_answer,)),
        # Past the deadline: a miss; a refresh keeps its answer.
        Row(LS.IN_FLIGHT, LE.TIME_OUT, LS.ANSWERED, after=(give_up,)),
        Row(LS.REFRESHING, LE.TIME_OUT, LS.ANSWERED, after=(keep_answer,)),
        Row(LS.ANSWERED, LE.REFRESH, LS.REFRESHING, after=(start_refresh,)),
        # vLLM allocated a request that still waits (preempted, then
        # allocated on its local hit, until it resumes): vLLM may ask
        # again, so an answer stays; a lookup not answered is dropped.
        Row(LS.ASKED, LE.ALLOCATE, LS.DROPPED, after=(let_go,)),
        Row(LS.IN_FLIGHT, LE.ALLOCATE, LS.DROPPED, after=(let_go,)),
        Row(LS.ANSWERED, LE.ALLOCATE, LS.ANSWERED),
        Row(LS.REFRESHING, LE.ALLOCATE, LS.ANSWERED, after=(let_go,)),
        # vLLM admitted the request, on its answer or before it had one:
        # the lookup is over (a request looked up again after a
        # preemption asks under a new key, with a new tracker).
        Row(LS.ASKED, LE.ADMIT, LS.DROPPED, after=(let_go,)),
        Row(LS.IN_FLIGHT, LE.ADMIT, LS.DROPPED, after=(let_go,)),
        Row(LS.ANSWERED, LE.ADMIT, LS.DROPPED),  # nothing in flight
        Row(LS.REFRESHING, LE.ADMIT, LS.DROPPED, after=(let_go,)),
        Row(LS.ASKED, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.IN_FLIGHT, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.ANSWERED, LE.DROP, LS.DROPPED, after=(let_go,)),
        Row(LS.REFRESHING, LE.DROP, LS.DROPPED, after=(let_go,)),
    ],
    initial=LS.ASKED,
    terminal=(LS.DROPPED,),
    total_events=(LE.DROP, LE.ADMIT, LE.ALLOCATE, LE.ASK, LE.KNOW),
    name="admission-lookup",
    title="Admission lookup (scheduler side)",
)
"""A request's admission lookup: asked, in flight, answered, refreshed,
dropped once the request is admitted or ends."""
