"""The worker half of the connector: moves whole KV blocks, never tokens.

The worker keeps its own lifecycle: a `Registry` of trackers over a
thread-safe `LifecycleMachine` driven by the same table as the scheduler
half (not a second, per-job table: a job's fate is the fate of its
request's epoch, which is exactly what the request table already encodes,
and one table keeps one set of diagrams, tests and illegal-ordering
policy).  The scheduler half stays authoritative for what vLLM sees; the
worker's lifecycle decides what the worker reports.

Events, by where they come from:

* Metadata notices: a preemption (``preempt`` + ``reset``: the epoch is
  bumped) and a finish (``finish``; a request still loading drains).
* Jobs: a load fires ``alloc_external``; a save, queued after the forward
  in `wait_for_save`, fires ``save_issued`` (after ``alloc_local`` or
  ``resume`` when the worker sees the request run for the first time in
  this epoch).  A worker that learns of a newer epoch from a job catches
  up through the table's own preempt/reset rows.
* Transfer threads: ``load_done`` / ``load_failed`` / ``save_done`` /
  ``save_failed`` with the job's epoch, so a completion from before a
  preemption (same request id, older epoch) is a counted no-op
  (`machine.stale_counts`): it is never reported as received, as a load
  error or as a success.

What the worker reports is what those events decided: a receive
completion (`get_finished`) and load errors only for loads whose
completion the lifecycle applied, never for a stale one or one whose
request is gone (its blocks may already belong to another request).
Every job still gets exactly one `JobResult`, because the scheduler
unpins the job's blocks on it; a stale one reads failed and stale.
Besides the trackers, the only state is per job (the queues and the
completion outbox) or per step (the last metadata step applied), never
per request.

Thread rule: the model runner's thread (the hooks) and the two transfer
threads (completions) all fire events, so the registry and its trackers
are read and changed only while holding the side's lock (`WorkerSide`
keeps it in `_lock`); the queues and the completion outbox are
thread-safe on their own.  The threads are started through an injectable
`Spawn` (default `daemon_thread`), so a test or an embedding can run them
its own way.

Transfers run on two background threads (loads, saves) through a
`connector.worker.transfer.Transfer`: zero copy for host KV caches, pinned
staging with CUDA events for device ones.  Blocks are copied whole, every
layer, so the connector never depends on how a backend orders tokens inside
a block.  No vLLM import.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from connector.metadata import (
    ConnectorMeta,
    JobKind,
    JobResult,
    TransferJob,
    WorkerReport,
)
from connector.worker.deadline import Deadline, Runners
from connector.worker.lanes import Lane, move_blocks
from connector.worker.pieces import (
    BatchOutcome,
    BlockStore,
    CopyWaits,
    HostMemory,
    Register,
)
from connector.worker.transfer import (
    DEFAULT_STAGING_BLOCKS,
    Direct,
    KVLayout,
    Segment,
    Transfer,
    open_transfer,
)
from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import TABLE, Event, KVMachine, KVTracker, State

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchOutcome",
    "BlockStore",
    "Joinable",
    "KVLayout",
    "KeyMaker",
    "Segment",
    "Spawn",
    "Verdict",
    "WorkerSide",
    "daemon_thread",
]

log: Final = logging.getLogger(__name__)

_DONE: Final = {
    JobKind.LOAD: (Event.LOAD_DONE, Event.LOAD_FAILED),
    JobKind.SAVE: (Event.SAVE_DONE, Event.SAVE_FAILED),
}


_Queued = tuple[TransferJob, CopyWaits, tuple[Lane, ...], Deadline | None]
"""A queued job: its save fence, its generation's lanes, its load deadline."""


@attrs.define(eq=False)
class _LayerLoad:
    """A layer-wise load of this step: started, then waited for once."""

    job: TransferJob
    lanes: tuple[Lane, ...]
    deadline: Deadline | None = None
    ended: threading.Event = attrs.field(factory=threading.Event)


class KeyMaker(Protocol):
    """Turns block hashes into store keys."""

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """One key per hash."""


class Joinable(Protocol):
    """What `Spawn` returns: a running job loop that can be waited for."""

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loop to return, at most `timeout` seconds."""

    def is_alive(self) -> bool:
        """Whether the loop is still running."""


#: Starts `target` (a job loop, which returns once its queue says stop)
#: under the name given; returns a handle to wait for it.
Spawn = Callable[[str, Callable[[], None]], Joinable]


def daemon_thread(name: str, target: Callable[[], None]) -> Joinable:
    """The default `Spawn`: a started daemon thread."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class Verdict(enum.Enum):
    """What the worker's lifecycle made of a job's completion."""

    APPLIED = "applied"
    """The request's lifecycle took it."""
    STALE = "stale"
    """From an epoch before a preemption: fenced off, counted."""
    ORPHAN = "orphan"
    """The request is no longer tracked (finished before the job ended)."""
    REFUSED = "refused"
    """Illegal in the request's state: counted by the machine."""
    CANCELLED = "cancelled"
    """Never ran: the worker shut down first."""


@attrs.frozen
class _Done:
    """One ended job, as the completing thread posts it."""

    job: TransferJob
    ok: bool
    failed_blocks: frozenset[int]
    verdict: Verdict


def _refusal(tracker: KVTracker, job: TransferJob) -> Verdict:
    """Why the lifecycle refused `job`'s event: stale epoch or illegal."""
    return Verdict.STALE if tracker.epoch != job.epoch else Verdict.REFUSED


class WorkerSide:
    """The connector's worker-role logic.

    Args:
        store: The store client (shared by both transfer threads).
        keys: Turns block hashes into keys.
        layout: The registered KV layout.
        regions: Builds a store batch from (ptr lists, size lists).
        transfer: How blocks move (default: zero copy over `layout`).
        machine: The worker's lifecycle machine (strict in tests).
        lanes: Per KV cache group, how its blocks move (hybrid models;
            default: one group, `keys` over `transfer`).
        spawn: Starts the load and save loops (default: a daemon thread
            each).
        load_timeout_s: Each load's deadline, from when the worker takes
            it; its blocks not in by then fail (vLLM recomputes them) and
            are never written later.  None: unbounded.  The transfer must
            honour it (`open_transfer(deadlines=True)`, or staging).
    """

    def __init__(
        self,
        store: BlockStore,
        keys: KeyMaker,
        layout: KVLayout,
        regions: Any,
        *,
        transfer: Transfer | None = None,
        machine: KVMachine | None = None,
        lanes: Sequence[Lane] = (),
        spawn: Spawn = daemon_thread,
        load_timeout_s: float | None = None,
        layerwise_saves: bool = False,
    ) -> None:
        self._store = store
        self.layerwise_saves = layerwise_saves
        #: Runs a layer-wise save's groups side by side (`move_blocks`).
        self._lane_runners = Runners("kv-lifecycle-lanes")
        # Save jobs queued early this step by `save_kv_layer` (forward
        # thread); `wait_for_save` queues the rest.
        self._early_saves: set[int] = set()
        self._early_step = -1
        self.load_timeout_s = load_timeout_s
        self._keys = keys
        self.layout = layout
        self.transfer: Transfer = transfer or Direct(layout, regions)
        self.lanes = tuple(lanes) or (
            Lane(keys, self.transfer, layout.block_bytes),
        )
        #: Blocks and bytes moved, by (kind, group), since `take_moved`.
        self.moved: Counter[tuple[str, int, str]] = Counter()
        self._moved_lock = threading.Lock()
        self.machine: KVMachine = machine or LifecycleMachine(TABLE)
        # Epochs come from the scheduler's jobs (`_catch_up`): a reused id
        # restarts at 0 here and catches up to the scheduler's epoch.
        self.registry = Registry(
            self.machine, KVTracker, continue_epochs=False
        )
        # Held whenever the registry or a tracker is read or changed.
        self._lock = threading.RLock()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._queues: dict[JobKind, queue.SimpleQueue[_Queued | None]] = {
            k: queue.SimpleQueue() for k in JobKind
        }
        # The lanes of the latest weights generation a step named.
        self._generation: tuple[str | None, tuple[Lane, ...]] = (
            None,
            self.lanes,
        )
        self._threads = [
            spawn(f"kv-lifecycle-{kind.value}", self._loop(kind))
            for kind in JobKind
        ]
        self._load_errors: set[int] = set()
        self._spawn = spawn
        # Layer-wise loads (forward thread): accepted and not started yet,
        # then started and not yet waited for; their own loop, started at
        # the first one, so an asynchronous load never delays them.
        self._layer_jobs: list[_LayerLoad] = []
        self._layer_open: list[_LayerLoad] = []
        self._layer_queue: queue.SimpleQueue[_LayerLoad | None] = (
            queue.SimpleQueue()
        )
        self._layer_thread: Joinable | None = None
        #: Layer-wise loads given up at their deadline by a layer's wait.
        self.layer_loads_expired = 0
        # Loads with a deadline not yet drained, by job id (forward thread).
        self._deadlines: dict[int, tuple[TransferJob, Deadline]] = {}
        #: Loads the watchdog reported failed at their deadline.
        self.loads_expired = 0
        #: Requests whose reported load had a failed block (hybrid models
        #: report these, not block ids: `take_failed_loads`).
        self._failed_loads: set[str] = set()
        self._step_results: list[JobResult] = []
        self._meta_step = -1  # last metadata whose notices and loads ran
        self._save_step = -1  # last metadata whose saves were queued
        self._closed = False
        # Jobs handed to the loops and not yet ended (`drain`, `suspend`).
        self._queued = 0
        self._idle = threading.Condition(threading.Lock())
        # Asleep (`suspend`): a job the loops take now is cancelled, not run.
        self._suspended = False
        self.jobs_done = {JobKind.LOAD: 0, JobKind.SAVE: 0}
        self.jobs_failed = {JobKind.LOAD: 0, JobKind.SAVE: 0}
        self.jobs_cancelled = 0
        self.verdicts: Counter[Verdict] = Counter()

    @classmethod
    def for_kv_caches(
        cls,
        store: BlockStore,
        keys: KeyMaker,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        regions: Any,
        *,
        register: Register,
        staging_blocks: int | None = None,
        machine: KVMachine | None = None,
        spawn: Spawn = daemon_thread,
        load_timeout_s: float | None = None,
        layerwise_save_blocks: int = 0,
        memory: HostMemory | None = None,
    ) -> WorkerSide:
        """A worker over vLLM's KV tensors, their memory registered once.

        CUDA caches go through pinned staging (see
        `connector.worker.transfer`); host caches are zero copy unless
        `staging_blocks` is given; with `load_timeout_s`, loads go
        through staging so a late one never writes into the cache.  With
        `layerwise_save_blocks`, saves are layer-wise and the staging
        (host caches too) holds at least that many blocks.  With
        `memory` (a dummy client's), every block is staged in it.

        Raises:
            ValueError: the KV tensors fit no known layout.
        """
        if layerwise_save_blocks:
            staging_blocks = max(
                staging_blocks or DEFAULT_STAGING_BLOCKS, layerwise_save_blocks
            )
        transfer = open_transfer(
            kv_caches,
            num_blocks,
            regions,
            register=register,
            staging_blocks=staging_blocks,
            deadlines=load_timeout_s is not None,
            memory=memory,
        )
        layout = KVLayout.from_tensors(kv_caches, num_blocks)
        return cls(
            store,
            keys,
            layout,
            regions,
            transfer=transfer,
            machine=machine,
            spawn=spawn,
            load_timeout_s=load_timeout_s,
            layerwise_saves=layerwise_save_blocks > 0,
        )

    @property
    def registered(self) -> tuple[int, ...]:
        """Addresses registered with the store for this worker."""
        return tuple(
            a for lane in self.lanes for a in lane.transfer.registered
        )

    # -- hooks ----------------------------------------------------------------

    def handle_preemptions(self, meta: ConnectorMeta | None) -> None:
        """Apply the step's notices before its forward may reuse blocks."""
        self._accept_meta(meta)

    def start_load_kv(self, meta: ConnectorMeta | None) -> None:
        """Apply the step's notices; queue or start its loads.

        Asynchronous loads go to the load loop; layer-wise ones start on
        their own loop now.
        """
        self._accept_meta(meta)
        if self._layer_jobs:
            self._start_layer_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer's KV of the step's loads is in.

        Or once a load was given up.  Bounded by each load's deadline: a
        load not in by then is reported failed now (its blocks go to
        `get_block_ids_with_load_errors`, vLLM recomputes them) and
        nothing of it is written later.  A load read in spans of layers
        (`LoadStaging`, remote keys) lets this layer's attention run once
        its span is written; one moved whole (keys in this process's own
        segment, a store without get sessions) is waited for at the
        first layer.
        """
        if self._layer_jobs:
            self._start_layer_loads()
        if self._layer_open:
            self._settle_layer_loads(layer_name)

    def save_kv_layer(
        self, layer_name: str, meta: ConnectorMeta | None = None
    ) -> None:
        """The forward wrote this layer: saves copy it only after now.

        With `layerwise_saves`, the first layer of a step with pinned
        saves queues them now, each lane's fence filled layer by layer
        (`LayerWise.layer_waits`), so their gathers follow the forward.
        """
        if self.layerwise_saves and meta is not None:
            self._queue_saves_early(meta)
        for lane in self.lanes:
            lane.transfer.layer_written(layer_name)

    def _queue_saves_early(self, meta: ConnectorMeta) -> None:
        """Queue `meta`'s pinned saves with per-layer fences, once.

        Only when every lane that writes can save layer by layer
        (`Transfer.waits_by_layer`: staged, head shards included); a
        replica's lane puts nothing, so it never holds the step back.
        """
        if self._closed or meta.step <= self._early_step:
            return  # this step's layers after its first
        self._early_step = meta.step
        if meta.step <= self._save_step:
            return
        if not all(
            ln.transfer.waits_by_layer for ln in self.lanes if ln.writes
        ):
            return  # zero copy: nothing to stage before the forward ends
        jobs = [j for j in meta.jobs if j.kind is JobKind.SAVE and j.pinned]
        if not jobs:
            return
        self._accept_meta(meta)
        self._save_step = meta.step
        lanes = self._lanes_for(meta)
        # A replica's lane reads no KV on a save: no fence to fill.
        fence = tuple(
            lane.transfer.layer_waits() if lane.writes else ()
            for lane in lanes
        )
        for job in jobs:
            self._early_saves.add(job.job_id)
            if self._accept(job):
                self._enqueue(JobKind.SAVE, (job, fence, lanes, None))

    def wait_for_save(self, meta: ConnectorMeta | None) -> None:
        """Queue this step's saves, now that the forward pass wrote them.

        A pinned save reads its blocks later, on the save thread: the
        scheduler holds them until the job reports.  An unpinned one
        (vLLM without a bindable block pool) is done before returning.
        """
        fence = tuple(lane.transfer.fence() for lane in self.lanes)
        if self._layer_jobs:  # a forward that waited for no layer
            self._start_layer_loads()
        if self._layer_open:
            self._settle_layer_loads()
        if meta is None or self._closed:
            return
        self._accept_meta(meta)
        if meta.step < self._save_step or (
            meta.step == self._save_step and not self._early_saves
        ):
            return
        self._save_step = meta.step
        early, self._early_saves = self._early_saves, set()
        for job in meta.jobs:
            if job.kind is not JobKind.SAVE or job.job_id in early:
                continue
            if not self._accept(job):
                continue
            lanes = self._lanes_for(meta)
            if job.pinned:
                self._enqueue(JobKind.SAVE, (job, fence, lanes, None))
            else:
                self._run(job, fence, lanes)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Drain ended jobs: (done sending, done receiving).

        Sending is always None: saves never delay freeing.  A load is
        reported as received once, failed or not, when the lifecycle took
        its completion (its failed blocks go to
        `get_block_ids_with_load_errors`); never when stale or orphaned.
        """
        recving: set[str] = set()
        if self._layer_jobs:
            self._start_layer_loads()
        if self._layer_open:
            self._settle_layer_loads()
        if self._deadlines:
            self._expire_loads()
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            self.verdicts[done.verdict] += 1
            job = done.job
            self._deadlines.pop(job.job_id, None)
            kept = done.verdict in {Verdict.APPLIED, Verdict.ORPHAN}
            good = done.ok and kept
            self._step_results.append(
                JobResult(
                    job.job_id,
                    ok=int(good),
                    failed=int(not good),
                    stale=int(done.verdict is Verdict.STALE),
                )
            )
            if job.kind is JobKind.LOAD and done.verdict in {
                Verdict.APPLIED,
                Verdict.REFUSED,
            }:
                if not job.layerwise:  # vLLM runs it: no completion owed
                    recving.add(job.req_id)
                self._load_errors |= done.failed_blocks
                if done.failed_blocks:
                    self._failed_loads.add(job.req_id)
        return None, recving or None

    def _expire_loads(self) -> None:
        """The watchdog: a load past its deadline is reported failed now.

        Whatever its transfer is doing (queued behind another, or in a
        get that never returns): the deadline's claim keeps the loading
        thread from writing or reporting it afterwards.
        """
        now = time.monotonic()
        with self._lock:
            for job_id, (job, deadline) in list(self._deadlines.items()):
                if deadline.at > now or not deadline.expire():
                    continue
                del self._deadlines[job_id]
                self.loads_expired += 1
                self.jobs_failed[JobKind.LOAD] += 1
                log.warning(
                    "load job %d for %s passed its %.3g s deadline; its "
                    "blocks are recomputed",
                    job_id,
                    job.req_id,
                    self.load_timeout_s,
                )
                self._post(job, self._complete(job, ok=False))

    def _start_layer_loads(self) -> None:
        """Hand the step's accepted layer-wise loads to their loop."""
        jobs, self._layer_jobs = self._layer_jobs, []
        if self._layer_thread is None:
            self._layer_thread = self._spawn(
                "kv-lifecycle-layers", self._serve_layers
            )
        timeout = self.load_timeout_s
        for load in jobs:
            if timeout is not None:
                load.deadline = Deadline.after(timeout, by_layer=True)
            self._layer_open.append(load)
            self._layer_queue.put(load)

    def _serve_layers(self) -> None:
        while (load := self._layer_queue.get()) is not None:
            try:
                self._run(load.job, (), load.lanes, load.deadline)
            finally:
                load.ended.set()
                if load.deadline is not None:
                    load.deadline.finish()

    def _settle_layer_loads(self, layer: str | None = None) -> None:
        """Wait for the started layer-wise loads, each to its deadline.

        With `layer`, a load whose span holding it is written stays open
        for the later layers' waits.  One past its deadline is taken
        from its transfer (`Deadline.expire`) and reported failed at
        once, so the forward goes on.
        """
        loads, self._layer_open = self._layer_open, []
        for load in loads:
            deadline = load.deadline
            if deadline is None:
                load.ended.wait()
                continue
            if layer is not None and deadline.wait_for_layer(
                layer, deadline.left()
            ):
                if not load.ended.is_set():
                    self._layer_open.append(load)
                continue
            if load.ended.wait(max(deadline.left(), 0.0)):
                continue
            with self._lock:
                if not deadline.expire():
                    late = False  # claimed: its transfer reports it
                else:
                    late = True
                    self.layer_loads_expired += 1
                    self.jobs_failed[JobKind.LOAD] += 1
                    self._post(load.job, self._complete(load.job, ok=False))
            if late:
                log.warning(
                    "layer-wise load job %d for %s passed its %.3g s "
                    "deadline; its blocks are recomputed",
                    load.job.job_id,
                    load.job.req_id,
                    self.load_timeout_s,
                )
            else:
                load.ended.wait()  # claimed: it is writing, briefly

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests reported received since the last call whose load failed.

        vLLM 0.33 takes load failures of a model with several KV cache
        groups only per request (``failed_recving``): block ids are not
        unique across groups.
        """
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def build_report(self) -> WorkerReport | None:
        """Job results drained by `get_finished` since the last report."""
        if not self._step_results:
            return None
        report = WorkerReport(tuple(self._step_results))
        self._step_results = []
        return report

    @property
    def open_jobs(self) -> int:
        """Jobs accepted by a live tracker and not yet completed."""
        with self._lock:
            return sum(len(t.pending_jobs) for t in self.registry)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Cancel queued jobs, let running ones end; bounded by `timeout`.

        A cancelled job fires its failure event and is reported cancelled.
        A transfer stuck in the store cannot be interrupted: its thread is
        a daemon and is abandoned after `timeout`.  Until this returns
        True the store may still read or write the worker's memory: only
        then may the caller unregister it (the worker holds the KV views
        while it lives; a holder of a worker that did not stop keeps it).

        Returns:
            Whether both transfer threads stopped and no late get (load
            staging) still holds a buffer.
        """
        if not self._closed:
            self._closed = True
            self._cancel_queued()
            self._drop_layer_waits()
            for kind in JobKind:
                self._queues[kind].put(None)
            self._layer_queue.put(None)
        deadline = time.monotonic() + timeout
        threads = list(self._threads)
        if self._layer_thread is not None:
            threads.append(self._layer_thread)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        stopped = not any(t.is_alive() for t in threads)
        stopped = self._late_gets_done(deadline) and stopped
        for staging in self._stagings():
            staging.close()
        self._lane_runners.close()
        for lane in self.lanes:
            close = getattr(lane.transfer, "close", None)
            if close is not None:  # head shards' runner threads
                close()
        if not stopped:
            log.warning(
                "transfer threads still running after %.1f s; abandoned "
                "(their memory stays registered and held)",
                timeout,
            )
        return stopped

    # -- lifecycle ------------------------------------------------------------

    def _accept_meta(self, meta: ConnectorMeta | None) -> None:
        """Fire the notices of `meta` and queue its loads, once per step."""
        if meta is None or self._closed or meta.step <= self._meta_step:
            return
        self._meta_step = meta.step
        timeout = self.load_timeout_s
        with self._lock:
            for req_id, epoch in meta.preempted:
                tracker = self.registry.get(req_id)
                if tracker is not None:
                    self._catch_up(tracker, epoch)
            for req_id in sorted(meta.finished):
                self.registry.fire_if_tracked(req_id, Event.FINISH)
            for job in meta.jobs:
                if job.kind is JobKind.LOAD and self._accept(job):
                    if job.layerwise:  # started in start_load_kv
                        self._layer_jobs.append(
                            _LayerLoad(job, self._lanes_for(meta))
                        )
                        continue
                    deadline = None
                    if timeout is not None:
                        deadline = Deadline.after(timeout)
                        self._deadlines[job.job_id] = (job, deadline)
                    self._enqueue(
                        JobKind.LOAD,
                        (job, (), self._lanes_for(meta), deadline),
                    )

    def _lanes_for(self, meta: ConnectorMeta) -> tuple[Lane, ...]:
        """The lanes keying `meta`'s jobs under its weights generation.

        A job is keyed under the generation of the step that issued it,
        even when it runs after a later step moved on.
        """
        generation = meta.generation
        if generation is None:
            return self.lanes
        if self._generation[0] != generation:
            lanes = tuple(
                attrs.evolve(
                    lane, keys=attrs.evolve(lane.keys, generation=generation)
                )
                for lane in self.lanes
            )
            self._generation = (generation, lanes)
        return self._generation[1]

    def _catch_up(self, tracker: KVTracker, epoch: int) -> None:
        """Replay preemptions the worker learns of late, through the table."""
        fire = self.registry.fire_on
        while tracker.epoch < epoch:
            self._run_in_epoch(tracker)
            if not (
                fire(tracker, Event.PREEMPT) and fire(tracker, Event.RESET)
            ):
                return

    def _accept(self, job: TransferJob) -> bool:
        """Fire the job's issue event; a refused job ends at once."""
        with self._lock:
            tracker = self.registry.get_or_create(job.req_id)
            self._catch_up(tracker, job.epoch)
            fire = self.registry.fire_on
            if job.kind is JobKind.LOAD:
                accepted = fire(tracker, Event.ALLOC_EXTERNAL, epoch=job.epoch)
            else:
                self._run_in_epoch(tracker)
                accepted = fire(tracker, Event.SAVE_ISSUED, epoch=job.epoch)
            if accepted:
                tracker.pending_jobs.add(job.job_id)
                if job.finished:  # its finish notice preceded the job
                    fire(tracker, Event.FINISH)
                return True
            verdict = _refusal(tracker, job)
        self._post(job, verdict)
        return False

    def _run_in_epoch(self, tracker: KVTracker) -> None:
        """The request runs in this epoch: NEW or RESET moves to SAVING."""
        if tracker.state is State.NEW:
            self.registry.fire_on(tracker, Event.ALLOC_LOCAL)
        elif tracker.state is State.RESET:
            self.registry.fire_on(tracker, Event.RESUME)

    def _complete(self, job: TransferJob, *, ok: bool) -> Verdict:
        """Fire the job's completion with its epoch; post the verdict."""
        done_event, failed_event = _DONE[job.kind]
        with self._lock:
            tracker = self.registry.get(job.req_id)
            if tracker is None:
                return Verdict.ORPHAN
            if self.registry.fire_on(
                tracker, done_event if ok else failed_event, epoch=job.epoch
            ):
                tracker.pending_jobs.discard(job.job_id)
                return Verdict.APPLIED
            return _refusal(tracker, job)

    def _cancel(self, job: TransferJob, deadline: Deadline | None) -> None:
        if deadline is not None and not deadline.claim():
            return  # the watchdog reported it already
        self.jobs_cancelled += 1
        self._complete(job, ok=False)
        self._post(job, Verdict.CANCELLED)

    def _post(
        self,
        job: TransferJob,
        verdict: Verdict,
        *,
        ok: bool = False,
        failed: frozenset[int] | None = None,
    ) -> None:
        """Hand an ended job to `get_finished` (all blocks failed: None)."""
        blocks = frozenset(job.block_ids) if failed is None else failed
        self._done.put(_Done(job, ok, blocks, verdict))

    # -- transfers ------------------------------------------------------------

    def _count_moved(self, job: TransferJob, flags: Sequence[bool]) -> None:
        kind = job.kind.value
        with self._moved_lock:
            for group, ok in zip(job.groups(), flags, strict=True):
                lane = self.lanes[group]
                if ok and (lane.writes or job.kind is JobKind.LOAD):
                    size = lane.block_bytes
                    self.moved[(kind, group, "blocks")] += 1
                    self.moved[(kind, group, "bytes")] += size

    def take_moved(self) -> dict[tuple[str, int, str], int]:
        """Blocks and bytes moved by (kind, group) since the last call."""
        with self._moved_lock:
            moved, self.moved = dict(self.moved), Counter()
        return moved

    def _loop(self, kind: JobKind) -> Callable[[], None]:
        """The job loop of `kind`: runs its queue until told to stop."""
        source = self._queues[kind]

        def serve() -> None:
            while (item := source.get()) is not None:
                try:
                    if self._suspended:
                        self._cancel(item[0], item[3])
                    else:
                        self._run(*item)
                finally:
                    self._ended(1)

        return serve

    def _enqueue(self, kind: JobKind, item: _Queued) -> None:
        with self._idle:
            self._queued += 1
        self._queues[kind].put(item)

    def _ended(self, count: int) -> None:
        with self._idle:
            self._queued -= count
            if not self._queued:
                self._idle.notify_all()

    def _cancel_queued(self) -> None:
        """Cancel every job still queued (not the ones running)."""
        for kind in JobKind:
            source = self._queues[kind]
            while True:
                try:
                    item = source.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    source.put(None)  # keep the stop for its loop
                    break
                try:
                    self._cancel(item[0], item[3])
                finally:
                    self._ended(1)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued and running job ended (`timeout` s).

        Returns:
            Whether none is left.
        """
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return self._late_gets_done(deadline)

    def _drop_layer_waits(self) -> None:
        """A save waiting for a layer the forward will not end: it fails."""
        for lane in self.lanes:
            drop = getattr(lane.transfer, "drop_layer_waits", None)
            if drop is not None:
                drop()

    def _late_gets_done(self, deadline: float) -> bool:
        """Wait until no load staging buffer is held by a late get."""
        while True:
            held = sum(staging.held_late for staging in self._stagings())
            if not held:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _stagings(self) -> list[Any]:
        """Every lane's load staging (`LoadStaging`), head shards too."""
        found = []
        for lane in self.lanes:
            parts = getattr(lane.transfer, "parts", (lane.transfer,))
            for part in parts:
                staging = getattr(part, "loads", None)
                if staging is not None:
                    found.append(staging)
        return found

    def suspend(self, timeout: float = 10.0) -> bool:
        """Before the KV memory goes away (sleep mode): drain, then stop.

        Queued and running jobs may end within `timeout`; then jobs
        still queued are cancelled, and until `resume` every job the
        loops take is cancelled, never run.

        Returns:
            Whether no transfer is running (False: one is stuck in the
            store and may still touch the KV memory).
        """
        self._drop_layer_waits()
        idle = self.drain(timeout)
        self._suspended = True
        if not idle:
            self._cancel_queued()
        return idle or self.drain(0.0)

    def resume(self) -> None:
        """After the KV memory is back (wake-up): jobs run again."""
        self._suspended = False

    @property
    def suspended(self) -> bool:
        """Whether `suspend` ran without a `resume` since."""
        return self._suspended

    def _run(
        self,
        job: TransferJob,
        fence: CopyWaits,
        lanes: tuple[Lane, ...] | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        """Run one job and fire its completion; never raises.

        A load the watchdog already reported (its `deadline` expired) is
        neither run nor reported again.
        """
        if deadline is not None and deadline.expired:
            return
        failed: frozenset[int] = frozenset()
        try:
            lanes = self.lanes if lanes is None else lanes
            flags = move_blocks(
                lanes,
                self._store,
                job,
                fence,
                deadline,
                runners=self._lane_runners,
            )
            self._count_moved(job, flags)
            failed = frozenset(
                b for b, ok in zip(job.block_ids, flags, strict=True) if not ok
            )
        except Exception:
            log.exception("%s job %d for %s failed", job.kind.value,
                          job.job_id, job.req_id)  # fmt: skip
            failed = frozenset(job.block_ids)
        if deadline is not None and not deadline.claim():
            return  # the watchdog reported it; nothing was written
        ok = not failed
        counter = self.jobs_done if ok else self.jobs_failed
        counter[job.kind] += 1
        verdict = self._complete(job, ok=ok)
        self._post(job, verdict, ok=ok, failed=failed)
