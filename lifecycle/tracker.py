"""The per-request record that the lifecycle machine drives.

A tracker is plain data: it never holds bound methods, a lock or a reference
to the machine, so dropping the last reference frees it at once (no reference
cycles, no reliance on the cycle collector).  Connectors subclass it to add
their own fields; every added field needs a default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from lifecycle.states import State

MAX_REQ_ID_LEN = 1024


def _check_req_id(
    _inst: object, _attr: attrs.Attribute[str], v: object
) -> None:
    if not isinstance(v, str):
        msg = f"req_id must be a str, got {type(v).__name__}"
        raise TypeError(msg)
    if not v or len(v) > MAX_REQ_ID_LEN:
        msg = f"req_id must have 1..{MAX_REQ_ID_LEN} characters, got {len(v)}"
        raise ValueError(msg)


def _check_count(_inst: object, attr: attrs.Attribute[int], v: int) -> None:
    if type(v) is not int or v < 0:
        msg = f"{attr.name} must be a non-negative int, got {v!r}"
        raise ValueError(msg)


def _check_block_ids(
    _inst: object, _attr: attrs.Attribute[list[int]], v: list[int]
) -> None:
    if not isinstance(v, list) or any(type(b) is not int or b < 0 for b in v):
        msg = f"block_ids must be a list of non-negative ints, got {v!r}"
        raise ValueError(msg)


@attrs.define(slots=True, eq=False, on_setattr=attrs.setters.NO_OP)
class Tracker:
    """One request's KV lifecycle: its state plus the data the hooks need.

    Fields are validated at construction; afterwards only the lifecycle
    machine changes `state` and `epoch` (through the table's callbacks), and
    connector hooks update the counters and block ids.

    Attributes:
        req_id: vLLM's request id.  Not an identity across preemptions:
            see `epoch`.
        state: The current lifecycle state.
        epoch: Incremented at every preemption.  Transfer jobs carry the
            epoch they were issued in, so a completion from an older
            lifecycle of a reused request id is recognised as stale.
        num_tokens: Tokens of the request known to the connector.
        num_hit_tokens: External tokens found by the latest lookup.
        num_external_tokens: Tokens being loaded from the store.
        num_saved_tokens: Prefix length covered by issued saves.
        block_ids: The request's KV block ids, in order.
        pending_jobs: Ids of transfer jobs of this epoch not yet settled.
    """

    req_id: str = attrs.field(validator=_check_req_id)
    state: State = attrs.field(
        default=State.NEW, validator=attrs.validators.instance_of(State)
    )
    epoch: int = attrs.field(default=0, validator=_check_count)
    num_tokens: int = attrs.field(default=0, validator=_check_count)
    num_hit_tokens: int = attrs.field(default=0, validator=_check_count)
    num_external_tokens: int = attrs.field(default=0, validator=_check_count)
    num_saved_tokens: int = attrs.field(default=0, validator=_check_count)
    block_ids: list[int] = attrs.field(
        factory=list, validator=_check_block_ids
    )
    pending_jobs: set[int] = attrs.field(factory=set)


# Callbacks that table rows may name.  Each takes the tracker and returns
# nothing; they run inside the transition, after the state has changed.


def bump_epoch(tracker: Tracker) -> None:
    """Start a new epoch: jobs issued before now become stale."""
    tracker.epoch += 1
    tracker.pending_jobs.clear()


def release_blocks(tracker: Tracker) -> None:
    """Forget the block table: vLLM has freed (or will reuse) the blocks."""
    tracker.block_ids.clear()


def clear_progress(tracker: Tracker) -> None:
    """Forget everything learnt in the previous epoch, ready to re-admit."""
    tracker.block_ids.clear()
    tracker.num_hit_tokens = 0
    tracker.num_external_tokens = 0
    tracker.num_saved_tokens = 0


def settle_load(tracker: Tracker) -> None:
    """The load is over, whatever its outcome: nothing is being received."""
    tracker.num_external_tokens = 0


Callback = Callable[[Any], None]

CALLBACKS: dict[str, Callback] = {
    "bump_epoch": bump_epoch,
    "release_blocks": release_blocks,
    "clear_progress": clear_progress,
    "settle_load": settle_load,
}
"""Callbacks a table row may name, by name."""
