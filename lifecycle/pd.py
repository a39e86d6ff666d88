"""Peer-to-peer prefill/decode (P/D) lifecycles: producer and consumer.

A second shipped lifecycle, written with the public API of `lifecycle`
only, as a connector author would write their own.  It models a P/D
connector in the style of vLLM's NIXL connector, where a prefill instance
(the producer) computes a prompt's KV and a decode instance (the consumer)
pulls it:

Producer (`PRODUCER`, trackers `ProducerTracker`)
-------------------------------------------------
RUNNING
    The request runs on the prefill instance.
SENDING
    vLLM finished the request and ``request_finished`` returned delay-free
    (True): vLLM keeps the blocks until the connector reports the request
    in ``finished_sending``, exactly once.  The peer pulls the blocks,
    then confirms; a timeout releases them if it never does.
SENT
    Terminal: the peer confirmed.  Report ``finished_sending``.
EXPIRED
    Terminal: the send timed out.  Report ``finished_sending``.
ABORTED
    Terminal: aborted while running (vLLM frees the blocks itself:
    nothing to report) or while sending (the transfer is cancelled:
    report ``finished_sending`` so vLLM frees the blocks).

A confirmation, timeout or abort that arrives after the tracker reached a
terminal state is for an id the registry no longer tracks, and a second
``finish`` in SENDING has no row: both are counted, logged no-ops, so
``finished_sending`` is never reported twice (vLLM asserts the id is
still held) and never for a request that was not delay-freed.

Consumer (`CONSUMER`, trackers `ConsumerTracker`)
-------------------------------------------------
WAITING
    Known, waiting for blocks (looked up, maybe repeatedly).
RECEIVING
    Blocks allocated, remote KV arriving (vLLM:
    ``WAITING_FOR_REMOTE_KVS``).
RUNNING
    Decoding on local KV (received, or recomputed after a failed receive:
    vLLM recomputes the blocks named as load errors).
DRAINING
    Finished or aborted while receiving: vLLM holds the blocks until
    exactly one receive completion is reported, so the tracker outlives
    the finish until that completion.
FINISHED, ABORTED
    Terminal.

Which events a P/D connector's hooks fire:

============================  =============================================
vLLM hook                     Event
============================  =============================================
``update_state_after_alloc``  consumer ``alloc_remote`` / ``alloc_local``
``request_finished``          ``finish`` (or ``abort`` for an aborted
                              request); the producer returns
                              ``tracker.state is SENDING`` as delay-free
peer confirmation, deadline   producer ``send_done``, ``timeout``, ``abort``
``get_finished``              consumer ``recv_done`` / ``recv_failed``
============================  =============================================
"""

from __future__ import annotations

import enum
from typing import Final

from lifecycle import Row, Table, Tracker, define_tracker

__all__ = [
    "CONSUMER",
    "PRODUCER",
    "ConsumerEvent",
    "ConsumerState",
    "ConsumerTracker",
    "ProducerEvent",
    "ProducerState",
    "ProducerTracker",
]


class ProducerState(enum.Enum):
    """Where a request is on the prefill (producer) side."""

    RUNNING = "running"
    SENDING = "sending"
    SENT = "sent"
    EXPIRED = "expired"
    ABORTED = "aborted"


class ProducerEvent(enum.StrEnum):
    """What happens to a request on the prefill side."""

    FINISH = "finish"
    SEND_DONE = "send_done"
    TIMEOUT = "timeout"
    ABORT = "abort"


@define_tracker
class ProducerTracker(Tracker[ProducerState]):
    """A prefill request's tracker.

    Attributes:
        release: True once the request left SENDING: the connector owes
            vLLM one ``finished_sending`` report for it.
        sends: Times the request entered SENDING (1 at most, by the
            table; a counter makes a violation visible).
        deadline: When the side that waits for the peer gives up and
            fires ``timeout`` (its own clock; 0.0: not sending).
    """

    state: ProducerState = ProducerState.RUNNING
    release: bool = False
    sends: int = 0
    deadline: float = 0.0


def start_send(tracker: ProducerTracker, _data: object = None) -> None:
    """Entering SENDING: the blocks are held for the peer."""
    tracker.sends += 1


def release_blocks(tracker: ProducerTracker, _data: object = None) -> None:
    """Leaving SENDING: vLLM must be told, once, to free the blocks."""
    tracker.release = True


PS = ProducerState
PE = ProducerEvent

PRODUCER: Final[Table[ProducerState, ProducerEvent, None, ProducerTracker]] = (
    Table(
        [
            Row(PS.RUNNING, PE.FINISH, PS.SENDING, after=(start_send,)),
            Row(PS.RUNNING, PE.ABORT, PS.ABORTED),
            Row(PS.SENDING, PE.SEND_DONE, PS.SENT, after=(release_blocks,)),
            Row(PS.SENDING, PE.TIMEOUT, PS.EXPIRED, after=(release_blocks,)),
            Row(PS.SENDING, PE.ABORT, PS.ABORTED, after=(release_blocks,)),
        ],
        initial=PS.RUNNING,
        terminal=(PS.SENT, PS.EXPIRED, PS.ABORTED),
        total_events=(PE.ABORT,),
        name="pd-producer",
        title="P/D producer (prefill side)",
    )
)
"""The producer's lifecycle: delay-free finish, send, release once."""


class ConsumerState(enum.Enum):
    """Where a request is on the decode (consumer) side."""

    WAITING = "waiting"
    RECEIVING = "receiving"
    RUNNING = "running"
    DRAINING = "draining"
    FINISHED = "finished"
    ABORTED = "aborted"


class ConsumerEvent(enum.StrEnum):
    """What happens to a request on the decode side."""

    LOOKUP = "lookup"
    ALLOC_REMOTE = "alloc_remote"
    ALLOC_LOCAL = "alloc_local"
    RECV_DONE = "recv_done"
    RECV_FAILED = "recv_failed"
    FINISH = "finish"
    ABORT = "abort"


@define_tracker
class ConsumerTracker(Tracker[ConsumerState]):
    """A decode request's tracker.

    Attributes:
        receives: Receive completions applied (1 at most per receive).
        recompute: True after a failed receive: the blocks are recomputed.
    """

    state: ConsumerState = ConsumerState.WAITING
    receives: int = 0
    recompute: bool = False


def settle_receive(tracker: ConsumerTracker, _data: object = None) -> None:
    """A receive completion was applied (success or failure)."""
    tracker.receives += 1


def mark_recompute(tracker: ConsumerTracker, _data: object = None) -> None:
    """The received KV is unusable: vLLM recomputes it."""
    tracker.recompute = True


CS = ConsumerState
CE = ConsumerEvent

CONSUMER: Final[Table[ConsumerState, ConsumerEvent, None, ConsumerTracker]] = (
    Table(
        [
            Row(CS.WAITING, CE.LOOKUP, CS.WAITING),
            Row(CS.WAITING, CE.ALLOC_REMOTE, CS.RECEIVING),
            Row(CS.WAITING, CE.ALLOC_LOCAL, CS.RUNNING),
            Row(CS.WAITING, CE.FINISH, CS.FINISHED),
            Row(CS.WAITING, CE.ABORT, CS.ABORTED),
            Row(
                CS.RECEIVING, CE.RECV_DONE, CS.RUNNING, after=(settle_receive,)
            ),
            Row(
                CS.RECEIVING,
                CE.RECV_FAILED,
                CS.RUNNING,
                after=(settle_receive, mark_recompute),
            ),
            Row(CS.RECEIVING, CE.FINISH, CS.DRAINING),
            Row(CS.RECEIVING, CE.ABORT, CS.DRAINING),
            Row(CS.RUNNING, CE.FINISH, CS.FINISHED),
            Row(CS.RUNNING, CE.ABORT, CS.ABORTED),
            Row(
                CS.DRAINING, CE.RECV_DONE, CS.ABORTED, after=(settle_receive,)
            ),
            Row(
                CS.DRAINING,
                CE.RECV_FAILED,
                CS.ABORTED,
                after=(settle_receive,),
            ),
            Row(CS.DRAINING, CE.FINISH, CS.DRAINING),
            Row(CS.DRAINING, CE.ABORT, CS.DRAINING),
        ],
        initial=CS.WAITING,
        terminal=(CS.FINISHED, CS.ABORTED),
        total_events=(CE.FINISH, CE.ABORT),
        name="pd-consumer",
        title="P/D consumer (decode side)",
    )
)
"""The consumer's lifecycle: receive, run, or drain a finished receive."""
