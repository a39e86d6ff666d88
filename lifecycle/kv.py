"""The KV request lifecycle: one instance of the generic library.

This module is the single source of truth of the KV connector's lifecycle:
its states and events, its tracker, its callbacks and `TABLE`.  The
machine, the typed event API, the diagrams in ``diagrams/`` and the
generated transition-table tests are all derived from `TABLE`; nothing
about the lifecycle may be written anywhere else.  A transition
coded by hand outside the table is invisible to the diagrams, the tests and
the illegal-ordering policy, which is how the bugs this project exists for
were born.

Rules
-----
* One row per (state, event).  An event with no row for the tracker's
  current state is an *illegal ordering*: the tracker is left unchanged, the
  fire returns False, a counter keyed by (state, event) is incremented and
  one rate-limited structured record is logged.  Strict mode (tests) raises
  `IllegalTransition` instead.  Never an assert, never a crash.
* `finish` and `abort` are accepted from every non-terminal state: vLLM may
  end a request at any point, including before it was ever looked up, while
  its KV is arriving and after it was preempted with no blocks
  (vLLM #43281, #56780, vllm-ascend#3721).
* Terminal states (FINISHED, ABORTED) have no exits; the registry drops a
  tracker the moment it reaches one.
* Transfer and lookup completions carry the epoch they were issued in.  A
  completion from an older epoch is stale: it is counted and never reaches
  the table (vLLM #51637: request ids are reused after preemption).
* Callbacks are held by the row and run after the state change, in order;
  they may only touch the tracker and must not fire events.

Theory of operation
-------------------
NEW       The request is known (looked up, maybe repeatedly: vLLM calls
          `get_num_new_matched_tokens` every step while it waits for space).
          A store lookup runs off the scheduler thread; its answer arrives
          as `lookup_done`, fenced by the epoch it was started in, so a
          lookup that returns after a preemption is stale.  Accepted only
          where a request waits to be admitted (NEW, RESET).
LOADING   Blocks are allocated and external KV is being received into them
          (vLLM: WAITING_FOR_REMOTE_KVS).  Saves are illegal here, so a load
          and a save are never co-queued for one request (vLLM #43371).
SAVING    The request is running: its KV is computed on the device and full
          blocks are saved to the store.  (For a consumer the saves are
          skipped, but the state is the same: KV is being produced.)
PREEMPTED vLLM preempted the request and has already freed its blocks,
          possibly to another request in the same step.  The epoch is bumped
          at once, so no in-flight job of the old epoch can touch the new
          lifecycle; in-flight saves pin their own blocks (vLLM #52360).
RESET     The connector has cleared the tracker for re-admission: after a
          preemption, or after a failed load (vLLM keeps the valid prefix
          or frees everything and looks the request up again).  Lookups
          and allocations accumulate until vLLM schedules it again, and a
          resume *replaces* the block table (vLLM #46595, LMCache#2069).
DRAINING  Exactly one receive completion per load (vLLM #50984, #43226,
          local-inference-lab/vllm#191): vLLM finished a request while its
          KV was still arriving; it keeps the blocks until exactly one
          receive completion is reported, even on failure, so the tracker
          must outlive the finish until that completion.  It ends ABORTED:
          a request finished before its KV arrived never ran.
FINISHED  Ended normally (stop, length).  Terminal.
ABORTED   Ended by an abort or an error.  Terminal.

Invariants this table enforces by construction
----------------------------------------------
* finish/abort from anywhere non-terminal (validated when built).
* Every non-terminal state can reach a terminal one; nothing is unreachable;
  terminal states have no exits (validated when built).
* No save while loading; no resume unless running or reset.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from lifecycle.machine import LifecycleMachine
from lifecycle.table import Row, Table
from lifecycle.tracker import Tracker, check_count, define_tracker


class State(enum.Enum):
    """Where one request's KV lifecycle stands."""

    NEW = "new"
    LOADING = "loading"
    SAVING = "saving"
    PREEMPTED = "preempted"
    RESET = "reset"
    DRAINING = "draining"
    FINISHED = "finished"
    ABORTED = "aborted"

    # Members are singletons compared by identity, so identity hashing is
    # consistent with equality; it makes the dispatch lookup a C call
    # instead of `Enum.__hash__` in Python.
    __hash__ = object.__hash__


TERMINAL: Final[frozenset[State]] = frozenset({State.FINISHED, State.ABORTED})
"""The KV lifecycle's terminal states (also `TABLE.terminal`)."""


class Event(enum.StrEnum):
    """What a connector hook or a transfer completion reports."""

    LOOKUP = "lookup"
    LOOKUP_DONE = "lookup_done"
    ALLOC_LOCAL = "alloc_local"
    ALLOC_EXTERNAL = "alloc_external"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    SAVE_ISSUED = "save_issued"
    SAVE_DONE = "save_done"
    SAVE_FAILED = "save_failed"
    PREEMPT = "preempt"
    RESET = "reset"
    RESUME = "resume"
    FINISH = "finish"
    ABORT = "abort"


def _check_block_ids(
    _inst: object, _attr: attrs.Attribute[list[int]], v: list[int]
) -> None:
    if not isinstance(v, list) or any(type(b) is not int or b < 0 for b in v):
        msg = f"block_ids must be a list of non-negative ints, got {v!r}"
        raise ValueError(msg)


@define_tracker
class KVTracker(Tracker[State]):
    """One request's KV lifecycle: its state plus the data the hooks need.

    Fields are validated at construction; afterwards only the lifecycle
    machine changes `state` and `epoch` (through the table's callbacks), and
    connector hooks update the counters and block ids.

    Attributes:
        state: The current lifecycle state (starts NEW).
        num_tokens: Tokens of the request known to the connector.
        num_hit_tokens: External tokens found by the latest lookup.
        num_external_tokens: Tokens being loaded from the store.
        num_saved_tokens: Prefix length covered by issued saves.
        block_ids: The request's KV block ids, in order (KV cache group 0).
        group_block_ids: The block ids of each further KV cache group
            (groups 1, 2, ... of a hybrid model), index-aligned with
            `block_ids`.
        pending_jobs: Ids of transfer jobs of this epoch not yet settled.
    """

    state: State = attrs.field(
        default=State.NEW, validator=attrs.validators.instance_of(State)
    )
    num_tokens: int = attrs.field(default=0, validator=check_count)
    num_hit_tokens: int = attrs.field(default=0, validator=check_count)
    num_external_tokens: int = attrs.field(default=0, validator=check_count)
    num_saved_tokens: int = attrs.field(default=0, validator=check_count)
    block_ids: list[int] = attrs.field(
        factory=list, validator=_check_block_ids
    )
    group_block_ids: list[list[int]] = attrs.field(factory=list)
    pending_jobs: set[int] = attrs.field(factory=set)


# Callbacks the rows hold.  Each takes the tracker and returns nothing; they
# run inside the transition, after the state has changed.


def bump_epoch(tracker: KVTracker, _data: object = None) -> None:
    """Start a new epoch: jobs issued before now become stale."""
    tracker.epoch += 1
    tracker.pending_jobs.clear()


def release_blocks(tracker: KVTracker, _data: object = None) -> None:
    """Forget the block tables: vLLM has freed (or will reuse) the blocks."""
    tracker.block_ids.clear()
    for table in tracker.group_block_ids:
        table.clear()


def clear_progress(tracker: KVTracker, _data: object = None) -> None:
    """Forget everything learnt in the previous epoch, ready to re-admit."""
    release_blocks(tracker)
    tracker.num_hit_tokens = 0
    tracker.num_external_tokens = 0
    tracker.num_saved_tokens = 0


def settle_load(tracker: KVTracker, _data: object = None) -> None:
    """The load is over, whatever its outcome: nothing is being received."""
    tracker.num_external_tokens = 0


S = State
E = Event

TRANSITIONS: Final[tuple[Row[State, Event, object, KVTracker], ...]] = (
    # NEW: known, nothing allocated.  Lookups repeat while vLLM waits.
    Row(S.NEW, E.LOOKUP, S.NEW),
    Row(S.NEW, E.LOOKUP_DONE, S.NEW),
    Row(S.NEW, E.ALLOC_LOCAL, S.SAVING),
    Row(S.NEW, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.NEW, E.FINISH, S.FINISHED),
    Row(S.NEW, E.ABORT, S.ABORTED),
    # LOADING: external KV arriving into allocated blocks.
    Row(S.LOADING, E.ALLOC_LOCAL, S.LOADING),
    Row(S.LOADING, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.LOADING, E.LOAD_DONE, S.SAVING, after=(settle_load,)),
    Row(
        S.LOADING,
        E.LOAD_FAILED,
        S.RESET,
        after=(settle_load, clear_progress),
    ),
    Row(S.LOADING, E.FINISH, S.DRAINING),
    Row(S.LOADING, E.ABORT, S.DRAINING),
    # SAVING: running; full blocks are saved as they fill.
    Row(S.SAVING, E.ALLOC_LOCAL, S.SAVING),
    Row(S.SAVING, E.SAVE_ISSUED, S.SAVING),
    Row(S.SAVING, E.SAVE_DONE, S.SAVING),
    Row(S.SAVING, E.SAVE_FAILED, S.SAVING),
    Row(S.SAVING, E.RESUME, S.SAVING),
    Row(
        S.SAVING,
        E.PREEMPT,
        S.PREEMPTED,
        after=(bump_epoch, release_blocks),
    ),
    Row(S.SAVING, E.FINISH, S.FINISHED, after=(release_blocks,)),
    Row(S.SAVING, E.ABORT, S.ABORTED, after=(release_blocks,)),
    # PREEMPTED: blocks already freed by vLLM; old epoch fenced.
    Row(S.PREEMPTED, E.RESET, S.RESET, after=(clear_progress,)),
    Row(S.PREEMPTED, E.FINISH, S.FINISHED),
    Row(S.PREEMPTED, E.ABORT, S.ABORTED),
    # RESET: cleared, waiting to be re-admitted.
    Row(S.RESET, E.LOOKUP, S.RESET),
    Row(S.RESET, E.LOOKUP_DONE, S.RESET),
    Row(S.RESET, E.ALLOC_LOCAL, S.RESET),
    Row(S.RESET, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.RESET, E.RESUME, S.SAVING),
    Row(S.RESET, E.FINISH, S.FINISHED, after=(release_blocks,)),
    Row(S.RESET, E.ABORT, S.ABORTED, after=(release_blocks,)),
    # DRAINING: finished by vLLM, exactly one receive completion owed.
    Row(S.DRAINING, E.LOAD_DONE, S.ABORTED, after=(settle_load,)),
    Row(S.DRAINING, E.LOAD_FAILED, S.ABORTED, after=(settle_load,)),
    Row(S.DRAINING, E.FINISH, S.DRAINING),
    Row(S.DRAINING, E.ABORT, S.DRAINING),
    # FINISHED and ABORTED: terminal, no rows.
)


TABLE: Final[Table[State, Event, object, KVTracker]] = Table(
    TRANSITIONS,
    initial=State.NEW,
    terminal=TERMINAL,
    total_events=(Event.FINISH, Event.ABORT),
    name="lifecycle",
    title="KV request lifecycle",
)
"""The request KV lifecycle, validated at import."""

KVMachine = LifecycleMachine[State, Event, KVTracker, object]
"""The type of a machine of `TABLE` (``LifecycleMachine(TABLE)``)."""
