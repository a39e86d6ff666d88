"""The scheduler half's request tracker and table (KV rows, own callbacks).

`REQUESTS` is `lifecycle.kv.TABLE` row for row (same states, events,
name and fingerprint: traces of it replay against ``lifecycle.kv:TABLE``)
plus callbacks that write what the scheduler half learns into the
`RequestTracker`, from the event's data, inside the transition.  A field
changes only when its row applies: never on an illegal, stale or refused
event.

==================  =================  ===================================
Event               Data               Fields written
==================  =================  ===================================
``lookup``          `Asked`            prompt, tokens, hashes, token ids,
                                       local hit, weights generation
``alloc_local``     none               saved prefix (the stored hit)
``alloc_external``  `Allocated`        block tables, external tokens,
                                       saved prefix
``reset``           none               no load job
``save_issued``     saved tokens       saved prefix
``load_done``       the job id         no load job
``load_failed``     the job id         no load job; a failure counted
==================  =================  ===================================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from lifecycle import LifecycleMachine, Table, define_tracker
from lifecycle.kv import TABLE, Event, KVTracker, State

__all__ = ["REQUESTS", "Allocated", "Asked", "RequestTracker"]


@define_tracker
class RequestTracker(KVTracker):
    """A request's tracker plus what the scheduler half needs.

    Attributes:
        num_prompt_tokens: Prompt length; saves stop at the last full
            prompt block (unless decode KV is saved).
        num_local_tokens: vLLM's local prefix-cache hit at the lookup.
        block_hashes: vLLM's live list of the request's chained block
            hashes (grows as tokens are added).
        token_ids: vLLM's live list of the request's tokens (for the
            store events of its saves).
        load_job: The open load job, or -1.
        load_failures: Failed loads; after one, the request recomputes
            instead of trusting the store again.
        generation: The weights generation the request was last looked
            up under (`SchedulerSide.generation`).  After a cache reset
            it differs from the scheduler half's: the request's KV may
            come from the old weights, so none of its blocks (prompt or
            decode) is saved again.
        layerwise_load: The latest allocated load is layer-wise
            (`SchedulerSide.loads_layerwise`): vLLM runs the request while
            it is LOADING, so it may finish or be preempted then.
    """

    num_prompt_tokens: int = 0
    num_local_tokens: int = 0
    block_hashes: list[bytes] = attrs.field(factory=list)
    token_ids: Sequence[int] = ()
    load_job: int = -1
    load_failures: int = 0
    generation: str | None = None
    layerwise_load: bool = False


# The event data records below are built at every hook call: plain
# (unfrozen) attrs records, which build 2.5 times faster than frozen ones.
# Callbacks only read them.


@attrs.define
class Asked:
    """The data of ``lookup``: the request, its local hit, its generation."""

    request: Any
    local_tokens: int
    generation: str | None = None


@attrs.define
class Allocated:
    """The data of ``alloc_external``: the block tables and the load."""

    tables: Sequence[Sequence[int]]
    external_tokens: int
    layerwise: bool = False


def set_tables(tracker: RequestTracker, tables: Any) -> None:
    """Replace the tracker's block tables (one per KV cache group)."""
    tracker.block_ids = list(tables[0]) if tables else []
    tracker.group_block_ids = [list(t) for t in tables[1:]]


def take_request(tracker: RequestTracker, asked: Asked) -> None:
    """vLLM asked for the request: its prompt, tokens and local hit."""
    request = asked.request
    tracker.block_hashes = request.block_hashes
    tracker.token_ids = getattr(request, "all_token_ids", ())
    tracker.num_prompt_tokens = request.num_prompt_tokens
    tracker.num_tokens = request.num_tokens
    tracker.num_local_tokens = asked.local_tokens
    tracker.generation = asked.generation


def mark_stored_prefix(tracker: RequestTracker, _data: object = None) -> None:
    """The stored hit needs no save."""
    tracker.num_saved_tokens = max(
        tracker.num_saved_tokens, tracker.num_hit_tokens
    )


def take_allocation(tracker: RequestTracker, allocated: Allocated) -> None:
    """Blocks allocated for a load: the tables and the tokens loaded."""
    set_tables(tracker, allocated.tables)
    tracker.num_external_tokens = allocated.external_tokens
    tracker.layerwise_load = allocated.layerwise
    mark_stored_prefix(tracker)


def forget_load(tracker: RequestTracker, _data: object = None) -> None:
    """A new epoch: no load of it is open."""
    tracker.load_job = -1


def mark_saved(tracker: RequestTracker, tokens: int) -> None:
    """A save up to `tokens` was issued."""
    tracker.num_saved_tokens = tokens


def close_load(tracker: RequestTracker, job_id: int) -> None:
    """The load job `job_id` succeeded: no load is open."""
    if tracker.load_job == job_id:
        tracker.load_job = -1


def fail_load(tracker: RequestTracker, job_id: int) -> None:
    """The load job `job_id` failed: counted, so the request recomputes."""
    if tracker.load_job == job_id:
        tracker.load_job = -1
        tracker.load_failures += 1


Callback = Callable[[Any, Any], object]

#: The connector's callbacks, by (source state, event) of `TABLE`'s rows.
CALLBACKS: Final[Mapping[tuple[State, Event], tuple[Callback, ...]]] = {
    (State.NEW, Event.LOOKUP): (take_request,),
    (State.RESET, Event.LOOKUP): (take_request,),
    (State.NEW, Event.ALLOC_LOCAL): (mark_stored_prefix,),
    (State.LOADING, Event.ALLOC_LOCAL): (mark_stored_prefix,),
    (State.SAVING, Event.ALLOC_LOCAL): (mark_stored_prefix,),
    (State.RESET, Event.ALLOC_LOCAL): (mark_stored_prefix,),
    (State.NEW, Event.ALLOC_EXTERNAL): (take_allocation,),
    (State.LOADING, Event.ALLOC_EXTERNAL): (take_allocation,),
    (State.RESET, Event.ALLOC_EXTERNAL): (take_allocation,),
    (State.PREEMPTED, Event.RESET): (forget_load,),
    (State.SAVING, Event.SAVE_ISSUED): (mark_saved,),
    (State.LOADING, Event.LOAD_DONE): (close_load,),
    (State.LOADING, Event.LOAD_FAILED): (fail_load,),
    (State.DRAINING, Event.LOAD_DONE): (close_load,),
    (State.DRAINING, Event.LOAD_FAILED): (fail_load,),
}


def with_callbacks(
    table: Table[State, Event, Any, KVTracker],
    callbacks: Mapping[tuple[State, Event], tuple[Callback, ...]],
) -> Table[State, Event, Any, RequestTracker]:
    """`table` with `callbacks` run after each row's own.

    Raises:
        KeyError: a key names no row of `table`.
    """
    missing = set(callbacks) - {(r.source, r.event) for r in table.rows}
    if missing:
        raise KeyError(sorted(f"{s.name}/{e.value}" for s, e in missing))
    rows = [
        attrs.evolve(
            row,
            after=(*row.after, *callbacks.get((row.source, row.event), ())),
        )
        for row in table.rows
    ]
    return Table(
        rows,
        initial=table.initial,
        terminal=table.terminal,
        total_events=table.total_events,
        states=table.states,
        events=table.events,
        on_enter=table.on_enter,
        name=table.name,
        title=table.title,
    )


REQUESTS: Final = with_callbacks(TABLE, CALLBACKS)
"""`lifecycle.kv.TABLE` with the scheduler half's field updates."""

RequestMachine = LifecycleMachine[State, Event, RequestTracker, Any]
"""A machine the scheduler half can drive: its trackers are
`RequestTracker`s (``LifecycleMachine(REQUESTS)``)."""
