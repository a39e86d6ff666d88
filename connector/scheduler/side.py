"""The scheduler half of the connector.

Each vLLM hook looks up the request's tracker, fires one or a few lifecycle
events, and returns what the events decided.  The registry of trackers is
the only per-request map; the only other table is of open transfer jobs,
keyed by job id (`connector.scheduler.jobs`), which outlive their request on
purpose: a save pins its blocks until every rank has read them (vLLM
#52360).  `request_finished` (vLLM's `request_finished_all_groups` of a
hybrid model lands here too) never delays freeing, so there is never a
send completion to owe: vLLM frees a finished request's blocks at once
unless the connector asks it to wait.

Hybrid models: a tracker holds one block table per KV cache group; a load
or a save is one job over (group, block) pairs (`connector.groups`).

Admission lookups never run on the scheduler thread
(`connector.scheduler.lookup`):
the first `get_num_new_matched_tokens` of a prefix answers None ("cannot
tell yet"; vLLM skips the request this step), the step's lookups go to the
lookup thread as one store call when the step's metadata is built, and a
later call takes the answer through the epoch-fenced ``lookup_done``
event.  A request is held back at most `lookup_timeout_s`, and at most
`max_pending` requests at once; past either bound it is admitted as a
miss (0 external tokens) and computes locally.

No vLLM import: vLLM objects are read by attribute (duck typing), so the
half is usable, and testable, without vLLM.
"""

from __future__ import annotations

import collections
import enum
import logging
import weakref
from typing import Any, Final

import attrs

from connector.groups import KVGroups
from connector.metadata import ConnectorMeta, JobKind, TransferJob
from connector.scheduler.failed_keys import FailedKeys
from connector.scheduler.jobs import BlockPool, JobTable, failed_hashes
from connector.scheduler.lookup import (
    NO_LOOKUP,
    AsyncLookups,
    BatchLookup,
    HitLookup,
    PendingLookup,
    batching,
)
from lifecycle import LifecycleMachine, Registry, define_tracker
from lifecycle.kv import TABLE, Event, KVMachine, KVTracker, State

log: Final = logging.getLogger(__name__)

_ABORT_STATUSES: Final = frozenset({"FINISHED_ABORTED", "FINISHED_ERROR"})
# A load is issued even if vLLM finished the request since the allocation
# (DRAINING): vLLM keeps its blocks until the one receive completion.
_LOAD_STATES: Final = frozenset({State.LOADING, State.DRAINING})
# Where a request waits to be admitted (and is looked up).
_WAITING_STATES: Final = frozenset({State.NEW, State.RESET})
#: Defaults of the admission-lookup bounds (see `SchedulerSide`).
LOOKUP_TIMEOUT_S: Final = 0.05
MAX_PENDING_LOOKUPS: Final = 4096
#: A request still waiting this long after a short answer (a miss or a
#: partial hit) is looked up again in the background: a burst is looked
#: up in its first step, before its own prefixes are stored, and a
#: cached miss would otherwise last until it is scheduled.
LOOKUP_REFRESH_S: Final = 0.1
#: Most background refreshes started in one step.
REFRESH_PER_STEP: Final = 256


class Role(enum.Enum):
    """vLLM's `kv_role`: who saves (every role loads)."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def saves(self) -> bool:
        """Whether this role writes KV to the store."""
        return self is not Role.CONSUMER


@define_tracker
class RequestTracker(KVTracker):
    """A request's tracker plus what the scheduler half needs.

    Attributes:
        num_prompt_tokens: Prompt length; saves stop at the last full
            prompt block (decode KV is not saved).
        num_local_tokens: vLLM's local prefix-cache hit at the lookup.
        block_hashes: vLLM's live list of the request's chained block
            hashes (grows as tokens are added).
        token_ids: vLLM's live list of the request's tokens.
        lookup_key: (epoch, blocks asked) of the cached lookup result, so
            repeated lookups while vLLM waits for space cost nothing.
        lookup_at: When the cached result's lookup was started (the
            lookup clock); a short result is refreshed after
            `LOOKUP_REFRESH_S`.
        load_job: The open load job, or -1.
        load_failures: Failed loads; after one, the request recomputes
            instead of trusting the store again.
    """

    num_prompt_tokens: int = 0
    num_local_tokens: int = 0
    block_hashes: list[bytes] = attrs.field(factory=list)
    token_ids: Any = ()
    lookup_key: tuple[int, int] = (-1, -1)
    lookup_at: float = 0.0
    load_job: int = -1
    load_failures: int = 0


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return str(getattr(status, "name", status))


class SchedulerSide:
    """The connector's scheduler-role logic.

    Args:
        block_size: vLLM's KV block size in tokens.
        role: Who saves.
        lookup: How to ask the store for a prefix (`hit_blocks`, and
            `hit_blocks_many` to answer a step's lookups in one call).
            Only the lookup thread calls it.
        world_size: Ranks that must report a job before it is settled.
        machine: The lifecycle machine (strict in tests).
        lookup_timeout_s: Longest a request is held back for its lookup.
        max_pending: Most requests held back for lookups at once.
        threaded_lookups: Run lookups on a thread (False: only when
            `lookups.run_pending()` is called, for deterministic tests).
        failed_keys: Memory of blocks whose load failed (peer death):
            lookups stop short of them until the master forgets them.
        groups: The model's KV cache groups (default: one full-attention
            group of `block_size`).
    """

    def __init__(
        self,
        *,
        block_size: int,
        role: Role,
        lookup: HitLookup,
        world_size: int = 1,
        machine: KVMachine | None = None,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        max_pending: int = MAX_PENDING_LOOKUPS,
        threaded_lookups: bool = True,
        failed_keys: FailedKeys | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        if block_size <= 0:
            msg = f"block_size must be positive, got {block_size}"
            raise ValueError(msg)
        self.block_size = block_size
        self.role = role
        self.world_size = world_size
        self.groups = groups or KVGroups.single(block_size)
        self.machine: KVMachine = machine or LifecycleMachine(TABLE)
        self.registry = Registry(self.machine, RequestTracker)
        self._lookup = lookup
        side = weakref.ref(self)

        def answering() -> BatchLookup:
            # Read at every batch (tests swap `_lookup`); weakly, so the
            # lookup thread never keeps a dropped scheduler half alive.
            me = side()
            found = me._lookup if me is not None else NO_LOOKUP  # noqa: SLF001
            return batching(found)

        self.lookups = AsyncLookups(
            answering,
            timeout_s=lookup_timeout_s,
            threaded=threaded_lookups,
        )
        # A scheduler half dropped without `close()` stops its thread.
        weakref.finalize(self, self.lookups.close, 0.0)
        self.max_pending = max_pending
        self._pending: dict[str, PendingLookup] = {}
        # Waiting requests whose answer is short (a miss or a partial
        # hit), oldest lookup first: refreshed in the background.
        self._short: dict[str, RequestTracker] = {}
        self.lookup_counts: collections.Counter[str] = collections.Counter()
        self.failed_keys = failed_keys or FailedKeys()
        self._open = self.jobs = JobTable(world_size)
        self._step = 0
        self._loads_to_issue: list[RequestTracker] = []
        self.unexpected_reports = 0

    # -- wiring -------------------------------------------------------------

    def bind_block_pool(self, pool: BlockPool) -> None:
        """Let saves pin their blocks (vLLM >= 0.22)."""
        self._open.pool = pool

    # -- hooks ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM accepted a request: track it from NEW, before any lookup."""
        tracker = self.registry.get_or_create(request.request_id)
        tracker.block_hashes = request.block_hashes
        tracker.token_ids = getattr(request, "all_token_ids", ())
        tracker.num_prompt_tokens = request.num_prompt_tokens

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens loadable beyond vLLM's local hit, loaded async.

        Block-aligned; a full hit leaves the last block to recompute.
        None while the store lookup runs (vLLM asks again next step).
        Idempotent: vLLM repeats the call every step the request waits.
        Never calls the store.
        """
        tracker = self.registry.get_or_create(request.request_id)
        if not self.registry.fire_on(tracker, Event.LOOKUP):
            return 0, False
        tracker.block_hashes = request.block_hashes
        tracker.token_ids = getattr(request, "all_token_ids", ())
        tracker.num_prompt_tokens = request.num_prompt_tokens
        tracker.num_tokens = request.num_tokens
        tracker.num_local_tokens = num_computed_tokens
        hit = self._hit_tokens(tracker, request.num_tokens)
        if hit is None:
            return None, False
        external = max(hit - num_computed_tokens, 0)
        return external, external > 0

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Blocks are allocated; `num_external_tokens > 0` means load them."""
        tracker = self.registry.get(request.request_id)
        if tracker is None:
            self.machine.unknown(request.request_id, Event.ALLOC_LOCAL)
            return
        self._short.pop(tracker.req_id, None)
        refresh = self._pending.get(tracker.req_id)
        if refresh is not None and refresh.refresh:  # admitted on the cache
            self._drop_lookup(refresh, "superseded")
        if num_external_tokens <= 0:
            if self.registry.fire_on(tracker, Event.ALLOC_LOCAL):
                self._mark_stored_prefix(tracker)
            return
        if self.registry.fire_on(tracker, Event.ALLOC_EXTERNAL):
            self._set_tables(tracker, blocks.get_block_ids())
            tracker.num_external_tokens = num_external_tokens
            self._mark_stored_prefix(tracker)
            self._loads_to_issue.append(tracker)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        """Fold one scheduling step into lifecycle events and transfer jobs."""
        self._step += 1
        so = scheduler_output
        jobs: list[TransferJob] = []
        preempted = self._preempt(so.preempted_req_ids or ())
        if self.lookups.completed:
            self._take_lookups()
        self._refresh_short()
        self.lookups.dispatch()
        jobs.extend(
            self._issue_load(t)
            for t in self._loads_to_issue
            if t.state in _LOAD_STATES and t.load_job < 0
        )
        self._loads_to_issue.clear()
        scheduled = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            found = self.registry.get(new.req_id)
            if found is None:
                continue
            tracker = found
            if tracker.state is State.RESET:
                # Model runner v2 sends a resumed request as a new one.
                self.registry.fire_on(tracker, Event.RESUME)
            self._set_tables(tracker, new.block_ids)
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._maybe_save(tracker, done, jobs)
        self._cached_reqs(so.scheduled_cached_reqs, scheduled, jobs)
        return ConnectorMeta(
            step=self._step,
            jobs=tuple(jobs),
            preempted=tuple(preempted),
            finished=frozenset(so.finished_req_ids),
        )

    def _cached_reqs(
        self, cached: Any, scheduled: Any, jobs: list[TransferJob]
    ) -> None:
        """Block table updates, resumes and saves of running requests.

        The hot loop of a steady decode: one dict lookup and a few slot
        reads per request whose prompt is saved.
        """
        resumed = cached.resumed_req_ids
        bs = self.block_size
        get = self.registry.get
        for req_id, new_ids, computed in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            tracker = get(req_id)
            if tracker is None:
                continue
            if resumed and req_id in resumed:
                # A resume replaces the block table (vLLM #46595).
                self.registry.fire_on(tracker, Event.RESUME)
                self._set_tables(tracker, new_ids or ())
            elif tracker.num_saved_tokens + bs > tracker.num_prompt_tokens:
                # Prompt saved (decode): no save is left to issue, so the
                # table is not needed until a resume replaces it.
                continue
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
                for table, ids in zip(
                    tracker.group_block_ids, new_ids[1:], strict=False
                ):
                    table.extend(ids)
            if tracker.num_saved_tokens + bs > tracker.num_prompt_tokens:
                continue  # prompt saved: `_maybe_save` would no-op
            done = computed + scheduled.get(req_id, 0)
            self._maybe_save(tracker, done, jobs)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished the request, in whatever state; never delays freeing.

        Saves in flight hold their own block references, so the blocks can
        be freed now; a request still loading is kept by vLLM itself until
        its single receive completion (DRAINING).
        """
        del block_ids  # empty after preemption; saves pinned their own
        abort = _status_name(request) in _ABORT_STATUSES
        self.registry.fire(
            request.request_id, Event.ABORT if abort else Event.FINISH
        )
        return False, None

    def update_connector_output(self, output: Any) -> None:
        """Settle finished jobs; report only receive completions vLLM expects.

        `output.finished_recving` is replaced by the requests whose load job
        settled here on every rank and whose lifecycle accepted it: never a
        completion for a freed, unknown, or re-admitted request (vLLM
        #43226, #46240, #51637), and exactly one per load: vLLM keeps a
        loading request's blocks until that one completion (vLLM #50984).
        """
        report = getattr(output, "kv_connector_worker_meta", None)
        results = getattr(report, "results", ()) if report else ()
        invalid = frozenset(getattr(output, "invalid_block_ids", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        settled: set[str] = set()
        for result in results:
            open_job = self._open.get(result.job_id)
            if open_job is None:
                self.unexpected_reports += 1
            else:  # ranks may report in different steps
                open_job.invalid |= invalid
                if open_job.job.req_id in failed:  # hybrid: whole load
                    open_job.invalid.update(open_job.job.block_ids)
            job = self._open.settle(result.job_id, result.ok, result.failed)
            if open_job and job and job[0].kind is JobKind.LOAD:
                self.failed_keys.loaded(
                    job[0].block_hashes,
                    failed_hashes(job[0], open_job.invalid),
                )
            if job is not None and self._finish_job(job):
                settled.add(job[0].req_id)
        recving = set(output.finished_recving or ())
        unexpected = recving - settled
        for req_id in sorted(unexpected):
            self.unexpected_reports += 1
            log.warning(
                "dropping unexpected receive completion for %s", req_id
            )
        output.finished_recving = settled or None
        output.finished_sending = None
        if failed:
            output.failed_recving = failed & settled

    def has_pending_push_work(self) -> bool:
        """Whether saves still pin blocks: vLLM keeps stepping until not."""
        return self._open.has_saves()

    def wait_for_lookups(self, timeout_s: float) -> bool:
        """Block until dispatched lookups ran (tests and harnesses only)."""
        return self.lookups.wait_idle(timeout_s)

    def close(self) -> None:
        """Stop the lookup thread (bounded)."""
        self.lookups.close()

    # -- internals ------------------------------------------------------------

    @property
    def open_jobs(self) -> int:
        """Jobs issued and not yet settled on every rank."""
        return len(self._open)

    @property
    def pending_lookups(self) -> int:
        """Requests held back for a lookup right now."""
        return len(self._pending)

    def _hit_tokens(
        self, tracker: RequestTracker, num_tokens: int
    ) -> int | None:
        """Stored prefix tokens; None while the lookup is in flight."""
        if tracker.load_failures:
            return 0
        bs = self.block_size
        asked = min(len(tracker.block_hashes), max(num_tokens - 1, 0) // bs)
        key = (tracker.epoch, asked)
        if tracker.lookup_key != key:
            pending = self._pending.get(tracker.req_id)
            if pending is not None:
                self._take_answer(tracker, key, pending)
        if tracker.lookup_key == key:
            self._refresh(tracker, asked)
            return tracker.num_hit_tokens
        if tracker.req_id in self._pending:
            return None  # still in flight, deadline not reached
        if asked == 0:
            return self._answer(tracker, key, 0)
        if len(self._pending) >= self.max_pending:
            self.lookup_counts["over_limit"] += 1
            return self._answer(tracker, key, 0)
        self._start_lookup(tracker, asked)
        self.lookup_counts["started"] += 1
        return None

    def _start_lookup(
        self, tracker: RequestTracker, asked: int, *, refresh: bool = False
    ) -> None:
        tracker.lookup_at = self.lookups.clock()
        pending = self.lookups.start(
            tracker.req_id,
            tracker,
            tracker.epoch,
            tracker.block_hashes[:asked],
        )
        pending.refresh = refresh
        self._pending[tracker.req_id] = pending

    def _refresh_short(self) -> None:
        """Refresh the oldest short answers of waiting requests.

        Runs once per step, before the step's lookups are sent; stops at
        the first answer younger than `LOOKUP_REFRESH_S`, so it costs the
        refreshes it starts plus one.
        """
        short = self._short
        if not short:
            return
        now = self.lookups.clock()
        started = 0
        for req_id, tracker in list(short.items()):
            if (
                self.registry.get(req_id) is not tracker
                or tracker.state not in _WAITING_STATES
                or tracker.lookup_key[0] != tracker.epoch
            ):
                del short[req_id]
                continue
            if now - tracker.lookup_at < LOOKUP_REFRESH_S:
                break
            if (
                started >= REFRESH_PER_STEP
                or len(self._pending) >= self.max_pending
            ):
                break
            del short[req_id]
            if req_id not in self._pending:
                self._start_lookup(
                    tracker, tracker.lookup_key[1], refresh=True
                )
                self.lookup_counts["refreshed"] += 1
                started += 1

    def _refresh(self, tracker: RequestTracker, asked: int) -> None:
        """Keep a waiting request's short cached answer fresh.

        The cached answer stays in force (the request is not held back);
        a refresh that came back replaces it, and one older than
        `LOOKUP_REFRESH_S` is started in the background.  Full hits are
        never refreshed.
        """
        pending = self._pending.get(tracker.req_id)
        if pending is not None:
            if pending.done:
                self._settle_lookup(pending)
            return
        if (
            tracker.num_hit_tokens < asked * self.block_size
            and self.lookups.clock() - tracker.lookup_at >= LOOKUP_REFRESH_S
            and len(self._pending) < self.max_pending
        ):
            self._start_lookup(tracker, asked, refresh=True)
            self.lookup_counts["refreshed"] += 1

    def _take_answer(
        self,
        tracker: RequestTracker,
        key: tuple[int, int],
        pending: PendingLookup,
    ) -> None:
        """Settle, keep waiting for, or give up on `pending` for `key`.

        Leaves `tracker.lookup_key == key` when `key` is answered (the
        lookup's answer, or 0 past its deadline); leaves `pending` in
        flight only while it is the lookup of `key` and not overdue.
        """
        mine = (pending.epoch, pending.asked) == key
        if pending.tracker is tracker and mine:
            if self.lookups.handoff(pending):
                if not self._settle_lookup(pending):
                    return  # deferred: looked up again by the caller
            elif self.lookups.clock() >= pending.deadline:
                self._drop_lookup(pending, "timed_out")
            else:
                return
            if tracker.lookup_key != key:
                self._answer(tracker, key, 0)
        elif pending.done:  # e.g. started before a preemption: stale
            self._settle_lookup(pending)
        else:
            self._drop_lookup(pending, "superseded")

    @staticmethod
    def _answer(
        tracker: RequestTracker, key: tuple[int, int], tokens: int
    ) -> int:
        tracker.num_hit_tokens = tokens
        tracker.lookup_key = key
        return tokens

    def _take_lookups(self) -> None:
        """Settle every lookup the thread finished (scheduler thread)."""
        for pending in self.lookups.take_completed():
            if not pending.taken:
                self._settle_lookup(pending)

    def _drop_lookup(self, pending: PendingLookup, why: str) -> None:
        """Stop waiting for `pending`; its answer will be discarded."""
        pending.abandoned = pending.taken = True
        if self._pending.get(pending.req_id) is pending:
            del self._pending[pending.req_id]
        self.lookup_counts[why] += 1

    def _settle_lookup(self, pending: PendingLookup) -> bool:
        """Fire `lookup_done` for a finished lookup; cache its answer.

        A lookup whose request ended (finish, abort; its id maybe reused
        by a new request) is counted and dropped; one from an older epoch
        (preemption) is counted stale by the machine.  Returns False when
        the answer is deferred (a block of the hit is being loaded for
        another request: `connector.scheduler.failed_keys`); the request is
        then looked up again, and nothing is cached.
        """
        pending.taken = True
        if self._pending.get(pending.req_id) is pending:
            del self._pending[pending.req_id]
        tracker: RequestTracker = pending.tracker
        if self.registry.get(pending.req_id) is not tracker:
            self.lookup_counts["ended"] += 1
            return True
        if pending.expired:
            self.lookup_counts["timed_out"] += 1
        if not self.registry.fire_on(
            tracker, Event.LOOKUP_DONE, epoch=pending.epoch
        ):
            self.lookup_counts["refused"] += 1
            return True
        found = self.found_blocks(pending)
        if found is None:
            self.lookup_counts["deferred"] += 1
            return False
        self._answer(
            tracker, (pending.epoch, pending.asked), found * self.block_size
        )
        self.lookup_counts["answered"] += 1
        self._short.pop(tracker.req_id, None)
        if found < pending.asked:  # re-inserted last: oldest first
            self._short[tracker.req_id] = tracker
        return True

    def found_blocks(self, pending: PendingLookup) -> int | None:
        """Leading blocks of a finished lookup the request may load.

        The one place a looked-up answer is read.  The failed-load memory
        cuts it before the first block whose load failed (a dead peer's
        key the master still lists), or answers None while a block of it
        is being loaded for another request.
        """
        if pending.expired:
            return 0
        return self.failed_keys.clip(pending.hashes, pending.found)

    def _mark_stored_prefix(self, tracker: RequestTracker) -> None:
        tracker.num_saved_tokens = max(
            tracker.num_saved_tokens, tracker.num_hit_tokens
        )

    def _preempt(self, req_ids: Any) -> list[tuple[str, int]]:
        preempted = []
        for req_id in sorted(req_ids):
            tracker = self.registry.get(req_id)
            if tracker is None:
                self.machine.unknown(req_id, Event.PREEMPT)
                continue
            if self.registry.fire_on(tracker, Event.PREEMPT):
                self.registry.fire_on(tracker, Event.RESET)
                tracker.load_job = -1
                preempted.append((req_id, tracker.epoch))
        return preempted

    def _set_tables(self, tracker: RequestTracker, tables: Any) -> None:
        """Replace the tracker's block tables (one per KV cache group)."""
        tracker.block_ids = list(tables[0]) if tables else []
        tracker.group_block_ids = [list(t) for t in tables[1:]]

    def _new_job(
        self, kind: JobKind, tracker: RequestTracker, first: int, last: int
    ) -> TransferJob:
        """A job over every group's blocks of ``[first, last)``."""
        job = self._open.issue_range(
            kind,
            tracker.req_id,
            tracker.epoch,
            (tracker.block_ids, *tracker.group_block_ids),
            tracker.block_hashes,
            groups=self.groups,
            first=first,
            last=last,
            pin=kind is JobKind.SAVE,
            finished=tracker.state is State.DRAINING,
            token_ids=tracker.token_ids,
        )
        tracker.pending_jobs.add(job.job_id)
        return job

    def _issue_load(self, tracker: RequestTracker) -> TransferJob:
        bs = self.block_size
        first = tracker.num_local_tokens // bs
        last = first + tracker.num_external_tokens // bs
        job = self._new_job(JobKind.LOAD, tracker, first, last)
        tracker.load_job = job.job_id
        self.failed_keys.loading(job.block_hashes)
        return job

    def _maybe_save(
        self, tracker: RequestTracker, computed: int, jobs: list[TransferJob]
    ) -> None:
        if not self.role.saves or tracker.state is not State.SAVING:
            return
        bs = self.block_size
        last = (
            min(
                computed,
                tracker.num_prompt_tokens,
                len(tracker.block_hashes) * bs,
            )
            // bs
        )
        first = tracker.num_saved_tokens // bs
        if last <= first or last > len(tracker.block_ids):
            return
        if not self.registry.fire_on(tracker, Event.SAVE_ISSUED):
            return
        jobs.append(self._new_job(JobKind.SAVE, tracker, first, last))
        tracker.num_saved_tokens = last * bs

    def _finish_job(self, settled: tuple[TransferJob, bool]) -> bool:
        """Fire the job's completion; True if it settles a receive."""
        job, ok = settled
        tracker = self.registry.get(job.req_id)
        if tracker is not None and tracker.epoch == job.epoch:
            tracker.pending_jobs.discard(job.job_id)
        if job.kind is JobKind.SAVE:
            event = Event.SAVE_DONE if ok else Event.SAVE_FAILED
            self.registry.fire(job.req_id, event, epoch=job.epoch, known=False)
            return False
        event = Event.LOAD_DONE if ok else Event.LOAD_FAILED
        if tracker is not None and tracker.load_job == job.job_id:
            tracker.load_job = -1
            tracker.load_failures += not ok
        return self.registry.fire(
            job.req_id, event, epoch=job.epoch, known=False
        )
