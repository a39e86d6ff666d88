"""The state layer of a CPU-offloading connector: two lifecycles composed.

In the style of vLLM's ``OffloadingConnector``: full KV blocks are stored
to a CPU cache keyed by block hash, and a request whose prefix is cached
loads those blocks back instead of recomputing them.  Two lifecycles:

- `REQUEST`: one tracker per request id, ending at FINISHED.  A load in
  flight is fenced by the request's epoch: a preemption starts a new one,
  so the old load's completion is stale.
- `BLOCK`: one tracker per block hash (int keys), *cyclic* (``terminal=()``:
  a cache slot is stored, read, evicted and stored again forever).  Readers
  are reference-counted: ``unpin`` chooses its next state from the count
  (guarded alternatives), and a block is evicted only without readers
  (``evict`` has no row from PINNED).  A store has the block's epoch: a
  cancelled store's late completion is stale, and its ``always`` callback
  still settles the store's in-flight count, whatever the block's state.

The pattern for work that spans two trackers
--------------------------------------------
Callbacks never fire events, so cross-lifecycle work lives in the hook,
in this order: (1) claim the dependent resources (pin the blocks), (2) fire
the owning lifecycle's event, (3) undo the claims if it was refused.  The
job record (`LoadJob`) owns the claims, not the tracker: whatever happens
to the request (preempted, finished), the claims are released exactly once,
when the job completes, stale or not.  Every decision is a `fire`: the
hook never checks a state and then acts on it.

It uses only the public API of `lifecycle`; the data path is left out (the
connector's transfers are the caller's `LoadJob` / `StoreJob` completions).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from typing import Final

import attrs

from lifecycle import (
    LifecycleMachine,
    Registry,
    Row,
    Table,
    Tracker,
    define_tracker,
)

__all__ = [
    "BLOCK",
    "REQUEST",
    "BlockEvent",
    "BlockState",
    "BlockTracker",
    "LoadJob",
    "OffloadingState",
    "RequestEvent",
    "RequestState",
    "RequestTracker",
    "StoreJob",
]


# -- the request lifecycle -------------------------------------------------


class RequestState(enum.Enum):
    """Where a request stands."""

    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    DRAINING = "draining"
    FINISHED = "finished"


class RequestEvent(enum.Enum):
    """What the scheduler hooks and load completions report."""

    LOOKUP = "lookup"
    LOAD = "load"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    RUN = "run"
    PREEMPT = "preempt"
    FINISH = "finish"


@attrs.frozen
class LoadJob:
    """A load of cached blocks into a request: it owns the blocks' pins."""

    job_id: int
    req_id: str
    epoch: int
    hashes: tuple[int, ...]


@define_tracker
class RequestTracker(Tracker[RequestState]):
    """A request: its cache hits and its load in flight."""

    state: RequestState = RequestState.WAITING
    hits: int = 0
    load_job: int = -1


def record_hits(request: RequestTracker, hits: int | LoadJob | None) -> None:
    """``lookup`` carries the number of cached blocks found."""
    if isinstance(hits, int):
        request.hits = hits


def start_load(request: RequestTracker, job: int | LoadJob | None) -> None:
    """``load`` carries its job."""
    if isinstance(job, LoadJob):
        request.load_job = job.job_id


def settle_load(request: RequestTracker, _data: object = None) -> None:
    """The load is over (its pins are the job's to release)."""
    request.load_job = -1


def new_epoch(request: RequestTracker, _data: object = None) -> None:
    """A preemption: the load in flight is now stale."""
    request.epoch += 1
    request.load_job = -1


RS, RE = RequestState, RequestEvent

# Design: a load in flight is the only thing that outlives the scheduler's
# view of a request (DRAINING waits for its one completion); a preemption
# fences it by epoch instead of waiting.  FINISH is accepted everywhere.
REQUEST: Final[
    Table[RequestState, RequestEvent, int | LoadJob | None, RequestTracker]
] = Table(
    [
        Row(RS.WAITING, RE.LOOKUP, RS.WAITING, after=(record_hits,)),
        Row(RS.WAITING, RE.LOAD, RS.LOADING, after=(start_load,)),
        Row(RS.WAITING, RE.RUN, RS.RUNNING),
        Row(RS.WAITING, RE.FINISH, RS.FINISHED),
        Row(RS.LOADING, RE.LOAD_DONE, RS.RUNNING, after=(settle_load,)),
        Row(RS.LOADING, RE.LOAD_FAILED, RS.WAITING, after=(settle_load,)),
        Row(RS.LOADING, RE.PREEMPT, RS.WAITING, after=(new_epoch,)),
        Row(RS.LOADING, RE.FINISH, RS.DRAINING),
        Row(RS.RUNNING, RE.PREEMPT, RS.WAITING, after=(new_epoch,)),
        Row(RS.RUNNING, RE.FINISH, RS.FINISHED),
        Row(RS.DRAINING, RE.LOAD_DONE, RS.FINISHED, after=(settle_load,)),
        Row(RS.DRAINING, RE.LOAD_FAILED, RS.FINISHED, after=(settle_load,)),
        Row(RS.DRAINING, RE.FINISH, RS.DRAINING),
    ],
    initial=RS.WAITING,
    terminal={RS.FINISHED},
    total_events={RE.FINISH},
    name="offload_request",
    title="Offloading: request",
)


# -- the block lifecycle ---------------------------------------------------


class BlockState(enum.Enum):
    """Where one CPU cache slot stands."""

    EMPTY = "empty"
    STORING = "storing"
    STORED = "stored"
    PINNED = "pinned"


class BlockEvent(enum.Enum):
    """What stores, loads and the eviction policy report."""

    STORE = "store"
    STORE_DONE = "store_done"
    STORE_FAILED = "store_failed"
    CANCEL = "cancel"
    PIN = "pin"
    UNPIN = "unpin"
    EVICT = "evict"


@define_tracker
class BlockTracker(Tracker[BlockState, int]):
    """A cached block: its readers and its stores in flight."""

    state: BlockState = BlockState.EMPTY
    readers: int = 0
    storing: int = 0


def add_reader(block: BlockTracker, _data: object = None) -> None:
    """A load will read the block."""
    block.readers += 1


def drop_reader(block: BlockTracker, _data: object = None) -> None:
    """A load finished reading the block."""
    block.readers -= 1


def others_remain(block: BlockTracker, _data: object = None) -> bool:
    """Guard: readers remain after this one."""
    return block.readers > 1


def last_reader(block: BlockTracker, _data: object = None) -> bool:
    """Guard: this is the last reader."""
    return block.readers == 1


def issue_store(block: BlockTracker, _data: object = None) -> None:
    """A store is in flight."""
    block.storing += 1


def settle_store(block: BlockTracker, _data: object = None) -> None:
    """A store completed (in any epoch): it is no longer in flight."""
    block.storing -= 1


def drop_copy(block: BlockTracker, _data: object = None) -> None:
    """The CPU copy is gone: stores in flight become stale."""
    block.epoch += 1


BS, BE = BlockState, BlockEvent

# Design: readers only exist in PINNED, and PINNED has no `evict` row, so
# eviction with readers is an illegal ordering by construction.  `unpin`
# has two guarded rows: the count decides.  A cancelled store's completion
# arrives stale; its `always` callback settles `storing` in whatever state
# the block is then (EMPTY, STORING again, STORED by a newer store...).
BLOCK: Final[Table[BlockState, BlockEvent, None, BlockTracker]] = Table(
    [
        Row(BS.EMPTY, BE.STORE, BS.STORING, after=(issue_store,)),
        Row(BS.STORING, BE.STORE_DONE, BS.STORED, always=(settle_store,)),
        Row(BS.STORING, BE.STORE_FAILED, BS.EMPTY, always=(settle_store,)),
        Row(BS.STORING, BE.CANCEL, BS.EMPTY, after=(drop_copy,)),
        Row(BS.STORED, BE.PIN, BS.PINNED, after=(add_reader,)),
        Row(BS.STORED, BE.EVICT, BS.EMPTY, after=(drop_copy,)),
        Row(BS.PINNED, BE.PIN, BS.PINNED, after=(add_reader,)),
        Row(
            BS.PINNED,
            BE.UNPIN,
            BS.PINNED,
            after=(drop_reader,),
            guard=others_remain,
        ),
        Row(
            BS.PINNED,
            BE.UNPIN,
            BS.STORED,
            after=(drop_reader,),
            guard=last_reader,
        ),
    ],
    initial=BS.EMPTY,
    terminal=(),
    name="offload_block",
    title="Offloading: CPU block",
)


@attrs.frozen
class StoreJob:
    """A store of one block, issued in the block's epoch."""

    job_id: int
    block: int
    epoch: int


# -- the composed state layer ----------------------------------------------


class OffloadingState:
    """The scheduler-side state of an offloading connector.

    Each method is a hook: look up, fire, return.  `loads` and `stores`
    are the jobs in flight (their completions are the caller's).

    Args:
        strict: Raise on an illegal ordering (tests).
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.request_machine: LifecycleMachine[
            RequestState, RequestEvent, RequestTracker, int | LoadJob | None
        ] = LifecycleMachine(REQUEST, strict=strict)
        self.block_machine: LifecycleMachine[
            BlockState, BlockEvent, BlockTracker
        ] = LifecycleMachine(BLOCK, strict=strict)
        self.requests = Registry(self.request_machine, RequestTracker)
        self.blocks = Registry(self.block_machine, BlockTracker)
        self.loads: dict[int, LoadJob] = {}
        self.stores: dict[int, StoreJob] = {}
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------

    def lookup(self, req_id: str, hashes: Iterable[int]) -> int:
        """How many leading blocks of `hashes` are cached (readable)."""
        hits = 0
        for h in hashes:
            block = self.blocks.get(h)
            if block is None or block.state not in {BS.STORED, BS.PINNED}:
                break
            hits += 1
        self.requests.get_or_create(req_id)
        self.requests.fire(req_id, RE.LOOKUP, data=hits)
        return hits

    def start_load(self, req_id: str, hashes: Iterable[int]) -> LoadJob | None:
        """Pin `hashes` and start loading them into `req_id`; None: refused.

        The pins are claimed first; if one fails (evicted meanwhile) or
        the request refuses the load, every pin claimed is released.
        """
        wanted = tuple(hashes)
        pinned: list[int] = []
        for h in wanted:
            if not self.blocks.fire_if_tracked(h, BE.PIN):
                self._unpin(pinned)
                return None
            pinned.append(h)
        request = self.requests.get(req_id)
        epoch = 0 if request is None else request.epoch
        job = LoadJob(next(self._ids), req_id, epoch, wanted)
        if not self.requests.fire(req_id, RE.LOAD, data=job):
            self._unpin(pinned)
            return None
        self.loads[job.job_id] = job
        return job

    def load_complete(self, job_id: int, *, ok: bool) -> bool:
        """A load finished; its pins are released whatever its epoch.

        Returns whether the request applied the completion (False when it
        was stale: the request was preempted meanwhile).
        """
        job = self.loads.pop(job_id, None)
        if job is None:
            return False
        event = RE.LOAD_DONE if ok else RE.LOAD_FAILED
        applied = self.requests.fire_if_tracked(
            job.req_id, event, epoch=job.epoch
        )
        self._unpin(job.hashes)
        return applied

    def run(self, req_id: str) -> bool:
        """The request runs on recomputed KV."""
        return self.requests.fire(req_id, RE.RUN)

    def preempt(self, req_id: str) -> bool:
        """vLLM preempted the request: its load in flight becomes stale."""
        return self.requests.fire(req_id, RE.PREEMPT)

    def finish(self, req_id: str) -> bool:
        """vLLM finished the request (a load in flight is drained)."""
        return self.requests.fire(req_id, RE.FINISH)

    # -- blocks --------------------------------------------------------------

    def start_store(self, block: int) -> StoreJob | None:
        """Store `block` to the CPU cache; None: it is not EMPTY."""
        tracker = self.blocks.get_or_create(block)
        if not self.blocks.fire_on(tracker, BE.STORE):
            return None
        job = StoreJob(next(self._ids), block, tracker.epoch)
        self.stores[job.job_id] = job
        return job

    def store_complete(self, job_id: int, *, ok: bool) -> bool:
        """A store finished: the block is cached, unless it is stale."""
        job = self.stores.pop(job_id, None)
        if job is None:
            return False
        event = BE.STORE_DONE if ok else BE.STORE_FAILED
        return self.blocks.fire_if_tracked(job.block, event, epoch=job.epoch)

    def cancel_store(self, block: int) -> bool:
        """Give up a store in flight: its completion will be stale."""
        return self.blocks.fire_if_tracked(block, BE.CANCEL)

    def evict(self, block: int) -> bool:
        """Drop the CPU copy of `block`; refused while it has readers."""
        return self.blocks.fire_if_tracked(block, BE.EVICT)

    def _unpin(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.blocks.fire(h, BE.UNPIN)
