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
or a save is one job over (group, block) pairs (`connector.groups`), a
save's recurrent states those vLLM handed off (`connector.scheduler.states`).

Admission lookups never run on the scheduler thread
(`connector.scheduler.lookup`):
the first `get_num_new_matched_tokens` of a prefix answers None ("cannot
tell yet"; vLLM skips the request this step), the step's lookups go to the
lookup thread as one store call when the step's metadata is built, and a
later call takes the answer through the epoch-fenced ``lookup_done``
event.  A request is held back at most `lookup_timeout_s`, and at most
`max_pending` requests at once; past either bound it is admitted as a
miss (0 external tokens) and computes locally.  An answer already known
is given at once: vLLM's local hit covers every block a load could fill,
or a block up to the first loadable one missed moments ago
(`connector.scheduler.recent`).

Each request's lookup is a tracker of its own table
(`connector.scheduler.admission.LOOKUPS`: asked, in flight, answered,
refreshing, dropped), in a second registry: the lookup's state, its
answer and its epoch live there, nowhere else; the lookup thread's
messages (`connector.scheduler.lookup.PendingLookup`) only carry the
question and the answer.

No vLLM import: vLLM objects are read by attribute (duck typing), so the
half is usable, and testable, without vLLM.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

from connector.groups import KVGroups
from connector.metadata import ConnectorMeta, JobKind, TransferJob
from connector.scheduler.admission import (
    LOOKUPS,
    Known,
    LookupEvent,
    LookupState,
    LookupTracker,
)
from connector.scheduler.failed_keys import FailedKeys
from connector.scheduler.jobs import (
    BlockPool,
    JobTable,
    failed_hashes,
    save_range,
)
from connector.scheduler.lookup import (
    NO_LOOKUP,
    AsyncLookups,
    BatchLookup,
    HitLookup,
    PendingLookup,
    batching,
)
from connector.scheduler.recent import RecentBlocks
from connector.scheduler.requests import (
    REQUESTS,
    Allocated,
    Asked,
    RequestMachine,
    RequestTracker,
    set_tables,
)
from connector.scheduler.states import StateOffers
from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import Event, State

log: Final = logging.getLogger(__name__)

_ABORT_STATUSES: Final = frozenset({"FINISHED_ABORTED", "FINISHED_ERROR"})
# A load is issued even if vLLM finished the request since the allocation
# (DRAINING): vLLM keeps its blocks until the one receive completion.
_LOAD_STATES: Final = frozenset({State.LOADING, State.DRAINING})
# Where a request waits to be admitted (and is looked up).
_WAITING_STATES: Final = frozenset({State.NEW, State.RESET})
# Lookups asked and not answered; lookups with an answer to give.
_BUSY: Final = frozenset(
    {LookupState.ASKED, LookupState.IN_FLIGHT, LookupState.REFRESHING}
)
_ANSWERED: Final = frozenset({LookupState.ANSWERED, LookupState.REFRESHING})
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


# Whether each enum status (vLLM's `RequestStatus` members) is an abort:
# a member's name is a property, too slow to read at every finish.
_ABORT_BY_STATUS: Final[dict[enum.Enum, bool]] = {}


def _processed(request: Any) -> int:
    """Tokens of `request` whose KV is computed (none still in flight).

    Under async scheduling vLLM counts the tokens of a step not run yet.
    """
    in_flight = getattr(request, "num_in_flight_tokens", 0)
    return int(request.num_computed_tokens) - (
        in_flight if isinstance(in_flight, int) else 0
    )


def _sampled(request: Any) -> bool:
    """Whether `request` has an output token (a step of it ran)."""
    tokens = getattr(request, "num_output_tokens", 0)
    return isinstance(tokens, int) and tokens > 0


def _aborted(request: Any) -> bool:
    """Whether vLLM finished `request` with an abort or an error."""
    status = getattr(request, "status", None)
    if isinstance(status, enum.Enum):
        aborted = _ABORT_BY_STATUS.get(status)
        if aborted is None:
            aborted = status.name in _ABORT_STATUSES
            _ABORT_BY_STATUS[status] = aborted
        return aborted
    return str(getattr(status, "name", status)) in _ABORT_STATUSES


class SchedulerSide:
    """The connector's scheduler-role logic.

    Args:
        block_size: vLLM's KV block size in tokens.
        role: Who saves.
        lookup: How to ask the store for a prefix (`hit_blocks`, and
            `hit_blocks_many` to answer a step's lookups in one call).
            Only the lookup thread calls it.
        world_size: Ranks that must report a job before it is settled.
        machine: The lifecycle machine (strict in tests).  The default
            takes no lock: every event of the half comes from vLLM's
            scheduler thread.
        lookup_timeout_s: Longest a request is held back for its lookup.
        max_pending: Most requests held back for lookups at once.
        threaded_lookups: Run lookups on a thread (False: only when
            `lookups.run_pending()` is called, for deterministic tests).
        failed_keys: Memory of blocks whose load failed (peer death):
            lookups stop short of them until the master forgets them.
        groups: The model's KV cache groups (default: one full-attention
            group of `block_size`).
        save_decode: Also save generated tokens' blocks as they fill
            (``save_decode_cache``); a consumer then saves those only.
        clock: Monotonic seconds for the lookups' deadlines and refreshes
            and the memory of recent misses (tests pass a fake).
        layerwise_max_blocks: A store hit of at most this many blocks
            loads layer-wise: vLLM schedules it in the step it is admitted
            (``load_async`` False) and the forward waits for each layer's
            KV, bounded by the load deadline.  Longer hits, and every hit
            of a hybrid model, load asynchronously.  0: every load is
            asynchronous (see `loads_layerwise`).
        recent: Memory of recent misses and own saves (default: a fresh
            `RecentBlocks` on `clock`).
        lookup_wait_s: Scheduler-thread seconds per step spent waiting
            for lookups sent at once (``lookup_wait_ms``): a request
            answered within it is admitted in the step it arrives.  0:
            lookups go out with the step's batch and answer a step later.
    """

    def __init__(
        self,
        *,
        block_size: int,
        role: Role,
        lookup: HitLookup,
        world_size: int = 1,
        machine: RequestMachine | None = None,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        max_pending: int = MAX_PENDING_LOOKUPS,
        threaded_lookups: bool = True,
        failed_keys: FailedKeys | None = None,
        groups: KVGroups | None = None,
        save_decode: bool = False,
        clock: Callable[[], float] = time.monotonic,
        recent: RecentBlocks | None = None,
        layerwise_max_blocks: int = 0,
        lookup_wait_s: float = 0.0,
    ) -> None:
        if block_size <= 0:
            msg = f"block_size must be positive, got {block_size}"
            raise ValueError(msg)
        if layerwise_max_blocks < 0:
            msg = (
                "layerwise_max_blocks must be >= 0, got "
                f"{layerwise_max_blocks}"
            )
            raise ValueError(msg)
        if lookup_wait_s < 0:
            msg = f"lookup_wait_s must be >= 0, got {lookup_wait_s}"
            raise ValueError(msg)
        self.lookup_wait_s = lookup_wait_s
        self._wait_left = lookup_wait_s  # this step's
        self.block_size = block_size
        self.role = role
        self.save_decode = save_decode
        self.world_size = world_size
        self.groups = groups or KVGroups.single(block_size)
        self._layerwise_tokens = 0
        self.layerwise_max_blocks = layerwise_max_blocks
        # The lookup thread only fills in its messages' answers.
        self.machine: RequestMachine = machine or LifecycleMachine(
            REQUESTS, thread_safe=False
        )
        lookup_row = self.machine.table.get(State.NEW, Event.LOOKUP)
        if lookup_row is None or not lookup_row.after:
            msg = (
                "the scheduler half's machine must run "
                "connector.scheduler.requests.REQUESTS (the KV table with "
                "the half's callbacks)"
            )
            raise ValueError(msg)
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
            clock=clock,
        )
        # A scheduler half dropped without `close()` stops its thread.
        weakref.finalize(self, self.lookups.close, 0.0)
        self.max_pending = max_pending
        #: Each waiting request's admission lookup (`LOOKUPS`).
        self.lookup_machine: LifecycleMachine[
            LookupState, LookupEvent, LookupTracker, Any
        ] = LifecycleMachine(
            LOOKUPS, strict=self.machine.strict, thread_safe=False
        )
        # A late answer reaches its lookup through the message's tracker,
        # never by request id: a reused id's lookup needs no epoch floor.
        self.lookup_registry = Registry(
            self.lookup_machine, LookupTracker, continue_epochs=False
        )
        self._busy = 0  # lookups asked and not yet answered or dropped
        # Answered requests whose answer is short, oldest first: the
        # order refreshes are due in.  Each entry is checked against its
        # tracker's state when it comes up.
        self._refresh_queue: dict[str, LookupTracker] = {}
        self.lookup_counts: collections.Counter[str] = collections.Counter()
        self.failed_keys = FailedKeys() if failed_keys is None else failed_keys
        self.recent = RecentBlocks(clock=clock) if recent is None else recent
        # A hybrid model's hit is not downward-closed per block (a
        # sliding window may serve a longer prefix than a shorter one),
        # so its first miss says nothing of other prefixes.
        self._remember_misses = not self.groups.hybrid
        self._open = self.jobs = JobTable(world_size)
        self._step = 0
        self._loads_to_issue: list[RequestTracker] = []
        # An index, not state: the trackers scheduled since they last had
        # nothing left to save (prompt-only saves), so a steady decode
        # step visits only them, not every running request.
        self._saving: dict[str, RequestTracker] = {}
        # Pinned saves issued by `request_finished` (a request that ended
        # in its layer-wise load's step), sent with the next step's jobs.
        self._saves_after_finish: list[TransferJob] = []
        self.unexpected_reports = 0
        self.state_offers = StateOffers(self.groups, saves=role.saves)
        #: The weights generation of the jobs issued now (None: the
        #: configured one, before any `reset_generation`).
        self.generation: str | None = None

    # -- wiring -------------------------------------------------------------

    def bind_block_pool(self, pool: BlockPool) -> None:
        """Let saves pin their blocks (vLLM >= 0.22)."""
        self._open.pool = pool

    def reset_generation(self, generation: str, lookup: HitLookup) -> None:
        """Move to a new weights generation: KV stored before never hits.

        Later lookups ask `lookup` (the new generation's keys) and later
        jobs are keyed under `generation` (`ConnectorMeta.generation`).
        Lookups in flight and cached answers are dropped, so a waiting
        request is looked up again; a request past admission saves no
        more blocks, since its KV may come from the old weights.  Jobs
        already issued keep the generation they were issued under.
        """
        self._lookup = lookup
        self.generation = generation
        for lookup_tracker in list(self.lookup_registry):
            self._end_lookup(lookup_tracker.req_id, "reset")
        self.recent.clear()  # misses and saves of the old generation's keys
        # Requests past admission keep the generation they were looked up
        # under, so `_stopped` ends their saves; waiting ones are asked
        # again (``lookup`` records the new generation).

    # -- hooks ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM accepted a request: track it from NEW, before any lookup.

        Its fields are written by the ``lookup`` row (`take_request`),
        which runs before anything reads them.  With a lookup wait
        (``lookup_wait_s``) its store lookup is sent now
        (`_ask_on_arrival`): a burst's lookups then reach the store
        together, and one wait in the first hook that asks covers them.
        """
        tracker = self.registry.get_or_create(request.request_id)
        if self.lookup_wait_s > 0:
            self._ask_on_arrival(tracker, request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens loadable beyond vLLM's local hit; load async?

        Block-aligned; a full hit leaves the last block to recompute.
        None while the store lookup runs (vLLM asks again next step).
        The flag is False for a hit that loads layer-wise
        (`loads_layerwise`): vLLM schedules it in this step.
        Idempotent: vLLM repeats the call every step the request waits.
        Never calls the store.
        """
        tracker = self.registry.get_or_create(request.request_id)
        asked = Asked(request, num_computed_tokens, self.generation)
        if not self.registry.fire_on(tracker, Event.LOOKUP, data=asked):
            return 0, False
        hit = self._hit_tokens(tracker, tracker.num_tokens)
        if hit is None:
            return None, False
        external = hit - num_computed_tokens
        if external <= 0:
            return 0, False
        # Block-aligned: `loads_layerwise` as one comparison (a hot path).
        return external, external > self._layerwise_tokens

    @property
    def layerwise_max_blocks(self) -> int:
        """Most blocks of a layer-wise load (0: none)."""
        return self._layerwise_tokens // self.block_size

    @layerwise_max_blocks.setter
    def layerwise_max_blocks(self, blocks: int) -> None:
        # Hybrid models never load layer-wise: recurrent state is not
        # read by layer and their failures go per request.
        hybrid = self.groups.hybrid
        self._layerwise_tokens = 0 if hybrid else blocks * self.block_size

    def loads_layerwise(self, external_tokens: int) -> bool:
        """Whether a hit of `external_tokens` loads layer-wise.

        The rule: a hit of 1 to `layerwise_max_blocks` blocks, on a model
        with one full-attention group (0 turns layer-wise loads off).  A
        larger load could not hide behind one forward pass, so it loads
        asynchronously while vLLM runs other requests.  A pure function
        of the count: `get_num_new_matched_tokens` and the load job
        decide alike.  A request that ends in its load's step (one token,
        EOS) saves what it computed from `request_finished`.
        `get_num_new_matched_tokens` inlines this rule (a hot path).
        """
        blocks = external_tokens // self.block_size
        return 0 < blocks <= self._layerwise_tokens // self.block_size

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Blocks are allocated; `num_external_tokens > 0` means load them."""
        tracker = self.registry.get(request.request_id)
        if tracker is None:
            self.machine.unknown(request.request_id, Event.ALLOC_LOCAL)
            return
        if num_external_tokens <= 0:
            self.registry.fire_on(tracker, Event.ALLOC_LOCAL)
        else:
            allocated = Allocated(
                blocks.get_block_ids(),
                num_external_tokens,
                self.loads_layerwise(num_external_tokens),
            )
            if self.registry.fire_on(
                tracker, Event.ALLOC_EXTERNAL, data=allocated
            ):
                self._loads_to_issue.append(tracker)
        self._admitted(tracker)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        """Fold one scheduling step into lifecycle events and transfer jobs."""
        self._step += 1
        self._wait_left = self.lookup_wait_s
        so = scheduler_output
        jobs: list[TransferJob] = []
        preempted = self._preempt(so.preempted_req_ids or ())
        if self.lookups.completed:
            self._take_lookups()
        self._refresh_due()
        self.lookups.dispatch()
        jobs.extend(
            self._issue_load(t)
            for t in self._loads_to_issue
            if t.state in _LOAD_STATES and t.load_job < 0
        )
        self._loads_to_issue.clear()
        if self._saves_after_finish:
            jobs.extend(self._saves_after_finish)
            self._saves_after_finish.clear()
        self.state_offers.take(so)
        scheduled = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            found = self.registry.get(new.req_id)
            if found is None:
                continue
            tracker = found
            if tracker.state is State.RESET:
                # Model runner v2 sends a resumed request as a new one.
                self.registry.fire_on(tracker, Event.RESUME)
            set_tables(tracker, new.block_ids)
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._maybe_save(tracker, done, jobs)
            if self._prompt_save_left(tracker):
                self._saving[new.req_id] = tracker
        cached = so.scheduled_cached_reqs
        if self.save_decode:
            self._cached_reqs(cached, scheduled, jobs)
        elif self._saving or cached.resumed_req_ids:
            self._saving_reqs(cached, scheduled, jobs)
        self.state_offers.end_step()
        return ConnectorMeta(
            step=self._step,
            jobs=tuple(jobs),
            preempted=tuple(preempted),
            finished=frozenset(so.finished_req_ids),
            generation=self.generation,
        )

    def _cached_reqs(
        self, cached: Any, scheduled: Any, jobs: list[TransferJob]
    ) -> None:
        """Block table updates, resumes and saves of running requests.

        With decode saves (`save_decode_cache`): every running request
        may have a save to issue, so each is visited (one dict lookup and
        a few slot reads).  A request looked up before a cache reset (its
        generation is not ours) saves nothing more.
        """
        resumed = cached.resumed_req_ids
        generation, get = self.generation, self.registry.get
        for req_id, new_ids, computed in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            strict=True,
        ):
            tracker = get(req_id)
            if tracker is None:
                continue
            if new_ids or (resumed and req_id in resumed):
                self._new_blocks(tracker, new_ids, resumed)
            if tracker.generation == generation:
                done = computed + scheduled.get(req_id, 0)
                self._maybe_save(tracker, done, jobs)

    def _new_blocks(
        self, tracker: RequestTracker, new_ids: Any, resumed: Any
    ) -> None:
        """Append a scheduled request's new blocks to its tables.

        A resume (`tracker.req_id` in `resumed`) replaces the tables
        instead (vLLM #46595).
        """
        if tracker.req_id in resumed:
            if tracker.state is not State.LOADING:  # a layer-wise load
                self.registry.fire_on(tracker, Event.RESUME)
            set_tables(tracker, new_ids or ())
        elif new_ids:
            tracker.block_ids.extend(new_ids[0])
            for table, ids in zip(
                tracker.group_block_ids, new_ids[1:], strict=False
            ):
                table.extend(ids)

    def _saving_reqs(
        self, cached: Any, scheduled: Any, jobs: list[TransferJob]
    ) -> None:
        """`_cached_reqs` for prompt-only saves, visiting fewer requests.

        Only resumed requests and those with a save left (`_saving`) are
        visited.  A request whose prompt is saved, or whose generation is
        not ours, has nothing left to issue until a resume replaces its
        table (or vLLM sends it as new): it leaves the index, as does an
        ended request (no longer, or no longer the same, tracker).
        """
        saving = self._saving
        for req_id in cached.resumed_req_ids:
            tracker = self.registry.get(req_id)
            if tracker is not None:
                saving[req_id] = tracker
        if not saving:
            return
        ids = cached.req_ids
        where = dict(zip(ids, range(len(ids)), strict=True))
        get = self.registry.get
        for req_id, tracker in list(saving.items()):
            if get(req_id) is not tracker or not self._visit(
                tracker, where.get(req_id), cached, scheduled, jobs
            ):
                del saving[req_id]

    def _visit(
        self,
        tracker: RequestTracker,
        at: int | None,
        cached: Any,
        scheduled: Any,
        jobs: list[TransferJob],
    ) -> bool:
        """Update one `_saving` request's table, then issue its save.

        `at` is its place in `cached` (None: not scheduled this step).
        False: nothing is left to save.
        """
        if at is not None:
            new_ids = cached.new_block_ids[at]
            self._new_blocks(tracker, new_ids, cached.resumed_req_ids)
        if not self._prompt_save_left(tracker):
            return False
        if at is not None:
            done = cached.num_computed_tokens[at]
            self._maybe_save(
                tracker, done + scheduled.get(tracker.req_id, 0), jobs
            )
        return True

    def _prompt_save_left(self, tracker: RequestTracker) -> bool:
        """Whether a prompt block of `tracker` is still to be saved.

        Not after a cache reset since its lookup (its generation is not
        ours): its KV may come from the old weights.
        """
        return (
            tracker.generation == self.generation
            and tracker.num_saved_tokens + self.block_size
            <= tracker.num_prompt_tokens
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished the request, in whatever state; never delays freeing.

        Saves in flight hold their own block references, so the blocks can
        be freed now; a request still loading asynchronously is kept by
        vLLM itself until its single receive completion (DRAINING); one
        loading layer-wise ends now (vLLM frees its blocks at once).  One
        that finished normally in its layer-wise load's step (one token,
        EOS) had its load in: vLLM handles the step's load
        errors before any finish, and a request with one would not have
        finished.  Its computed blocks are saved by a pinned job in the
        next step's metadata (`_saves_after_finish`).
        """
        del block_ids  # empty after preemption; saves pinned their own
        abort = _aborted(request)
        req_id = request.request_id
        if req_id in self.lookup_registry:  # admitted ones have none
            self._end_lookup(req_id, "ended")
        else:
            self._refresh_queue.pop(req_id, None)
        tracker = self.registry.get(req_id)
        if (
            tracker is not None
            and tracker.state is State.LOADING
            and tracker.layerwise_load
        ):
            # A layer-wise load's request runs: vLLM frees its blocks now
            # and awaits no completion, so the load ends with it (its
            # report, if one comes, finds no tracker).
            if abort:
                self.registry.fire_on(
                    tracker, Event.LOAD_FAILED, data=tracker.load_job
                )
            elif (
                self.registry.fire_on(
                    tracker, Event.LOAD_DONE, data=tracker.load_job
                )
                and self._open.pool is not None  # saves must pin
                and _sampled(request)  # its step ran: computed KV
            ):
                self._maybe_save(
                    tracker,
                    _processed(request),
                    self._saves_after_finish,
                    finished=True,
                )
        self.registry.fire(req_id, Event.ABORT if abort else Event.FINISH)
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
            tracker = self.registry.get(req_id)
            log.warning(
                "dropping unexpected receive completion for %s (%s; "
                "reports this step: %s)",
                req_id,
                "untracked"
                if tracker is None
                else f"{tracker.state.name}, epoch {tracker.epoch}, "
                f"load job {tracker.load_job}",
                [r.job_id for r in results],
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
        """Lookups asked and not yet answered (refreshes included)."""
        return self._busy

    # -- the admission lookup's lifecycle ----------------------------------

    def _fire_lookup(
        self,
        lookup: LookupTracker,
        event: LookupEvent,
        *,
        data: Any = None,
        epoch: int | None = None,
    ) -> bool:
        """Fire `event` on `lookup`; keep the count of busy lookups."""
        was = lookup.state in _BUSY
        fired = self.lookup_registry.fire_on(
            lookup, event, data=data, epoch=epoch
        )
        self._busy += (lookup.state in _BUSY) - was
        return fired

    def _hit_tokens(
        self, tracker: RequestTracker, num_tokens: int
    ) -> int | None:
        """Stored prefix tokens; None while the lookup is in flight."""
        if tracker.load_failures:
            return 0
        bs = self.block_size
        asked = self._asked_blocks(tracker.block_hashes, num_tokens)
        local = tracker.num_local_tokens // bs
        key = (tracker.epoch, asked)
        lookup = self.lookup_registry.get(tracker.req_id)
        if lookup is not None and lookup.request is not tracker:
            self._end_lookup(tracker.req_id, "ended")  # a reused id
            lookup = None
        if local >= asked:
            return self._local_hit(tracker, lookup, key)
        if lookup is not None and lookup.key == key:
            if lookup.state not in _ANSWERED:
                found = self._await(lookup)
                if lookup.state is LookupState.DROPPED:  # refused: a miss
                    return 0
                if lookup.state not in _ANSWERED:
                    return found  # None while in flight
            if (
                lookup.state is LookupState.REFRESHING
                or lookup.hit_tokens < asked * bs  # short: kept fresh
            ):
                self._refresh(lookup)
            return lookup.hit_tokens
        return self._ask(tracker, lookup, key, local)

    def _asked_blocks(self, hashes: Sequence[Any], num_tokens: int) -> int:
        """Blocks a lookup asks for: every full block before the last token.

        The one rule both `_hit_tokens` and `_ask_on_arrival` key their
        lookup on, so an arrival lookup is the one vLLM's question finds.
        """
        return min(len(hashes), max(num_tokens - 1, 0) // self.block_size)

    def _new_lookup(self, tracker: RequestTracker) -> LookupTracker:
        """A lookup tracker for `tracker`'s request, in the initial ASKED."""
        lookup = self.lookup_registry.get_or_create(tracker.req_id)
        lookup.request = tracker
        self._busy += 1
        return lookup

    def _answer_now(
        self,
        tracker: RequestTracker,
        lookup: LookupTracker | None,
        key: tuple[int, int],
        tokens: int,
    ) -> LookupTracker:
        """An answer known without asking: cache it."""
        if lookup is None:
            lookup = self._new_lookup(tracker)
        self._fire_lookup(
            lookup,
            LookupEvent.KNOW,
            data=Known(key, self.lookups.clock(), tokens),
        )
        return lookup

    def _send(
        self,
        lookup: LookupTracker,
        event: LookupEvent,
        key: tuple[int, int],
        hashes: Any,
    ) -> PendingLookup | None:
        """Ask the store about `hashes` for `lookup` (``ask``/``refresh``).

        The message carries the epoch the event moves the tracker to; it
        is queued for the lookup thread (and returned) only if the event
        applied.
        """
        pending = self.lookups.message(
            lookup.req_id, lookup, lookup.epoch + 1, hashes, key
        )
        was = lookup.state in _BUSY  # `_fire_lookup`, inline (every ask)
        if self.lookup_registry.fire_on(lookup, event, data=pending):
            self._busy += (lookup.state in _BUSY) - was
            self.lookups.queue(pending)
            return pending
        return None

    def _local_hit(
        self,
        tracker: RequestTracker,
        lookup: LookupTracker | None,
        key: tuple[int, int],
    ) -> int:
        """vLLM's local hit covers every block a load could fill: 0 now.

        No lookup could add a token, so none is asked (one asked while
        the local hit was shorter is superseded); the answer is cached
        like a looked-up miss.  Blocks this instance saved recently are
        marked saved, so the request does not save them again.
        """
        self.lookup_counts["local"] += 1
        if lookup is not None and lookup.key == key:
            if lookup.state in _ANSWERED:
                return 0
            self.lookup_counts["superseded"] += 1
        asked = key[1]
        saved = self.recent.saved_prefix(tracker.block_hashes[:asked])
        tracker.num_saved_tokens = max(
            tracker.num_saved_tokens, saved * self.block_size
        )
        self._answer_now(tracker, lookup, key, 0)
        return 0

    def _ask(
        self,
        tracker: RequestTracker,
        lookup: LookupTracker | None,
        key: tuple[int, int],
        local: int,
    ) -> int | None:
        """Ask the store for `key`, or answer a miss already known."""
        if lookup is not None and lookup.state in _BUSY:
            self.lookup_counts["superseded"] += 1
        if self.recent.cuts(tracker.block_hashes[: local + 1]):
            # A block up to the first loadable one missed moments ago:
            # answer the miss now (refreshed in the background while the
            # request waits).
            self.lookup_counts["known_miss"] += 1
            known = self._answer_now(tracker, lookup, key, 0)
            self._refresh_queue[tracker.req_id] = known
            return 0
        busy = lookup is not None and lookup.state in _BUSY
        if self._busy - busy >= self.max_pending:
            self.lookup_counts["over_limit"] += 1
            self._answer_now(tracker, lookup, key, 0)
            return 0
        if lookup is None:
            lookup = self._new_lookup(tracker)
        pending = self._send(
            lookup, LookupEvent.ASK, key, tracker.block_hashes[: key[1]]
        )
        self.lookup_counts["started"] += 1
        if pending is not None and self._wait_left > 0:
            return self._wait_now(lookup, pending)
        return None

    def _ask_on_arrival(self, tracker: RequestTracker, request: Any) -> None:
        """Send a new request's lookup as it arrives, before vLLM asks.

        The lookup asks what `_hit_tokens` will ask for (every block up
        to the last full one before the last token, under the request's
        epoch), so vLLM's first question finds it answered or in flight.
        vLLM's local hit is not known yet: a request whose last such
        block vLLM holds (``get_cached_block`` of the bound block pool)
        is not asked, nor one whose first block missed moments ago, nor
        any past `max_pending`; those are asked, or answered, when vLLM
        asks.  The lookup is handed to the lookup thread at once.
        """
        if self.lookup_registry.get(tracker.req_id) is not None:
            return
        hashes = request.block_hashes
        asked = self._asked_blocks(hashes, request.num_tokens)
        if (
            asked == 0
            or self._busy >= self.max_pending
            or self.recent.cuts(hashes[:1])
            or self._held_locally(hashes[asked - 1])
        ):
            return
        lookup = self._new_lookup(tracker)
        key = (tracker.epoch, asked)
        pending = self._send(lookup, LookupEvent.ASK, key, hashes[:asked])
        if pending is not None:
            self.lookup_counts["started"] += 1
            self.lookup_counts["on_arrival"] += 1
            self.lookups.dispatch()

    def _held_locally(self, block_hash: Any) -> bool:
        """Whether vLLM's prefix cache holds `block_hash`.

        A guess: False when no block pool that can tell is bound, or the
        model has several KV cache groups.
        """
        pool = self._open.pool
        cached = getattr(pool, "get_cached_block", None)
        if cached is None or len(self.groups.groups) != 1:
            return False
        return cached(block_hash, [0]) is not None

    def _wait_for(self, pending: PendingLookup) -> bool:
        """Send `pending` now and wait, within the step's budget: done?

        No wait while the lookup thread's store call is stalled (the
        master hangs): the answer could not come within the budget.
        """
        if self.lookups.stalled:
            self.lookups.dispatch()
            self.lookup_counts["wait_skipped"] += 1
            return pending.done
        began = time.perf_counter()
        done = self.lookups.wait(pending, self._wait_left)
        self._wait_left -= time.perf_counter() - began
        self.lookup_counts["waited" if done else "wait_missed"] += 1
        return done

    def _wait_now(
        self, lookup: LookupTracker, pending: PendingLookup
    ) -> int | None:
        """Send `pending` now and wait, within the step's budget.

        The answer, or None (in flight: vLLM asks again next step).
        """
        if not self._wait_for(pending):
            return None
        return self._take_answer(lookup, pending)

    def _await(self, lookup: LookupTracker) -> int | None:
        """The answer to the lookup asked for the current key.

        Waited for while the step's budget lasts (`_wait_for`; sent on
        arrival or in an earlier step), else the lookup thread is given
        the GIL once.  0 past its deadline (a miss), None while it is in
        flight.
        """
        pending: PendingLookup = lookup.pending
        if self._wait_left > 0:
            done = self._wait_for(pending)
        else:
            done = self.lookups.handoff(pending)
        if done:
            return self._take_answer(lookup, pending)
        if self.lookups.clock() < pending.deadline:
            return None
        self.lookup_counts["timed_out"] += 1
        self._fire_lookup(lookup, LookupEvent.TIME_OUT)
        return lookup.hit_tokens

    def _take_answer(
        self, lookup: LookupTracker, pending: PendingLookup
    ) -> int | None:
        """Take `pending`'s (finished) answer: the hit, None if deferred."""
        self._take(pending)
        return lookup.hit_tokens if lookup.state in _ANSWERED else None

    def _refresh_due(self) -> None:
        """Refresh the oldest short answers of waiting requests.

        Runs once per step, before the step's lookups are sent; stops at
        the first answer younger than `LOOKUP_REFRESH_S`, so it costs the
        refreshes it starts plus one.
        """
        due = self._refresh_queue
        if not due:
            return
        now = self.lookups.clock()
        started = 0
        for req_id, lookup in list(due.items()):
            if not self._short(lookup):
                del due[req_id]
                continue
            if now - lookup.at < LOOKUP_REFRESH_S:
                break
            if started >= REFRESH_PER_STEP or self._busy >= self.max_pending:
                break
            del due[req_id]
            if lookup.state is LookupState.ANSWERED:
                self._start_refresh(lookup)
                started += 1

    def _short(self, lookup: LookupTracker) -> bool:
        """Whether `lookup` holds a short answer its request still waits on."""
        request: RequestTracker = lookup.request
        return (
            self.lookup_registry.get(lookup.req_id) is lookup
            and lookup.state in _ANSWERED
            and lookup.hit_tokens < lookup.key[1] * self.block_size
            and request.state in _WAITING_STATES
            and lookup.key[0] == request.epoch
        )

    def _start_refresh(self, lookup: LookupTracker) -> None:
        request: RequestTracker = lookup.request
        key = lookup.key
        self._send(
            lookup, LookupEvent.REFRESH, key, request.block_hashes[: key[1]]
        )
        self.lookup_counts["refreshed"] += 1

    def _refresh(self, lookup: LookupTracker) -> None:
        """Keep a waiting request's short cached answer fresh.

        The cached answer stays in force (the request is not held back);
        a refresh that came back replaces it, and one older than
        `LOOKUP_REFRESH_S` is started in the background.  Full hits are
        never refreshed.
        """
        if lookup.state is LookupState.REFRESHING:
            pending = lookup.pending
            if pending is not None and pending.done:
                self._take(pending)
            return
        if (
            lookup.hit_tokens < lookup.key[1] * self.block_size
            and self.lookups.clock() - lookup.at >= LOOKUP_REFRESH_S
            and self._busy < self.max_pending
        ):
            self._start_refresh(lookup)

    def _admitted(self, tracker: RequestTracker) -> None:
        """vLLM allocated the request's blocks: its lookup needs no refresh.

        Once the request left the waiting states, its lookup is over
        (``admit``): vLLM asks about it again only after a preemption,
        under a new epoch, with a new lookup.  A preempted request
        allocated on its local hit waits (RESET) until it resumes, and
        vLLM may ask again meanwhile: its answer stays (``allocate``).
        Either way a lookup in flight or refreshing is dropped (its late
        answer is stale).
        """
        req_id = tracker.req_id
        self._refresh_queue.pop(req_id, None)
        lookup = self.lookup_registry.get(req_id)
        if lookup is None:
            return
        if lookup.state in _BUSY:
            self.lookup_counts["superseded"] += 1
        waiting = tracker.state in _WAITING_STATES
        self._fire_lookup(
            lookup, LookupEvent.ALLOCATE if waiting else LookupEvent.ADMIT
        )

    def _end_lookup(self, req_id: str, why: str) -> None:
        """The request ended (or its id was reused): drop its lookup.

        An answer still in flight is then stale (counted by the lookup
        machine when it comes back), never applied.
        """
        self._refresh_queue.pop(req_id, None)
        lookup = self.lookup_registry.get(req_id)
        if lookup is None:
            return
        if lookup.state in _BUSY:
            self.lookup_counts[why] += 1
        self._fire_lookup(lookup, LookupEvent.DROP)

    def _take_lookups(self) -> None:
        """Take every answer the thread finished (scheduler thread)."""
        for pending in self.lookups.take_completed():
            self._take(pending)

    def _take(self, pending: PendingLookup) -> None:
        """Apply a finished lookup's answer to its tracker, if current.

        A stale answer (its lookup superseded or dropped) is a counted
        no-op of the lookup machine.  A current one fires the request's
        ``lookup_done`` (fenced by the request's epoch: a preemption
        since makes it stale there) and answers the lookup, unless the
        failed-load memory defers it (a block of the hit is being loaded
        for another request: `connector.scheduler.failed_keys`); the
        request is then asked for again.  Taking it again (in the hook
        that waited for it, then from the completed queue) is a no-op.
        """
        if pending.taken:
            return
        pending.taken = True
        if (
            self._remember_misses
            and not pending.expired
            and pending.found < len(pending.hashes)
        ):
            self.recent.missed(pending.hashes[pending.found])
        lookup: LookupTracker = pending.tracker
        if lookup.epoch != pending.epoch:
            self._fire_lookup(lookup, LookupEvent.ANSWER, epoch=pending.epoch)
            return
        if lookup.pending is not pending:
            return  # taken already
        request: RequestTracker = lookup.request
        if pending.expired:
            self.lookup_counts["timed_out"] += 1
        if not self.registry.fire_on(
            request, Event.LOOKUP_DONE, epoch=lookup.key[0]
        ):
            self.lookup_counts["refused"] += 1
            self._fire_lookup(lookup, LookupEvent.DROP)
            return
        found = self.found_blocks(pending)
        if found is None:
            self.lookup_counts["deferred"] += 1
            self._send(lookup, LookupEvent.ASK, lookup.key, pending.hashes)
            return
        self._fire_lookup(
            lookup,
            LookupEvent.ANSWER,
            data=found * self.block_size,
            epoch=pending.epoch,
        )
        self.lookup_counts["answered"] += 1
        self._refresh_queue.pop(lookup.req_id, None)
        if found < len(pending.hashes):  # re-inserted last: oldest first
            self._refresh_queue[lookup.req_id] = lookup

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

    def _preempt(self, req_ids: Any) -> list[tuple[str, int]]:
        preempted = []
        for req_id in sorted(req_ids):
            tracker = self.registry.get(req_id)
            if tracker is None:
                self.machine.unknown(req_id, Event.PREEMPT)
                continue
            if tracker.state is State.LOADING and tracker.layerwise_load:
                # vLLM ran the layer-wise load's step: over for this epoch
                # (its report, when it comes, is stale).
                self.registry.fire_on(
                    tracker, Event.LOAD_DONE, data=tracker.load_job
                )
            if self.registry.fire_on(tracker, Event.PREEMPT):
                self.registry.fire_on(tracker, Event.RESET)
                preempted.append((req_id, tracker.epoch))
        return preempted

    def _new_job(
        self,
        kind: JobKind,
        tracker: RequestTracker,
        first: int,
        last: int,
        *,
        layerwise: bool = False,
        finished: bool = False,
    ) -> TransferJob:
        """A job over every group's blocks of ``[first, last)``.

        `finished`: vLLM finished the request already (so it is when the
        tracker is DRAINING).
        """
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
            finished=finished or tracker.state is State.DRAINING,
            states=self.state_offers.for_job(kind, tracker, first, last),
            token_ids=tracker.token_ids,
            layerwise=layerwise,
        )
        tracker.pending_jobs.add(job.job_id)
        return job

    def _issue_load(self, tracker: RequestTracker) -> TransferJob:
        bs = self.block_size
        first = tracker.num_local_tokens // bs
        last = first + tracker.num_external_tokens // bs
        job = self._new_job(
            JobKind.LOAD,
            tracker,
            first,
            last,
            layerwise=tracker.layerwise_load,
        )
        tracker.load_job = job.job_id
        self.failed_keys.loading(job.block_hashes)
        return job

    def _maybe_save(
        self,
        tracker: RequestTracker,
        computed: int,
        jobs: list[TransferJob],
        *,
        finished: bool = False,
    ) -> None:
        if tracker.state is not State.SAVING:
            return
        bs, decode = self.block_size, self.save_decode
        first, last = save_range(
            tracker,
            computed,
            bs,
            prompt=self.role.saves,
            decode=decode,
            stopped=tracker.generation != self.generation,
        )
        if last <= first or last > len(tracker.block_ids):
            return
        if not self.registry.fire_on(
            tracker, Event.SAVE_ISSUED, data=last * bs
        ):
            return
        job = self._new_job(
            JobKind.SAVE, tracker, first, last, finished=finished
        )
        self.recent.saving(job.block_hashes)
        jobs.append(job)

    def _finish_job(self, settled: tuple[TransferJob, bool]) -> bool:
        """Fire the job's completion; True if it settles a receive."""
        job, ok = settled
        if ok:
            self.recent.saved(job.block_hashes)
        tracker = self.registry.get(job.req_id)
        if tracker is not None and tracker.epoch == job.epoch:
            tracker.pending_jobs.discard(job.job_id)
        if job.kind is JobKind.SAVE:
            event = Event.SAVE_DONE if ok else Event.SAVE_FAILED
            self.registry.fire_if_tracked(job.req_id, event, epoch=job.epoch)
            return False
        if job.layerwise:
            # vLLM ran the request in the load's step and recomputes its
            # failed blocks in place (or fails it, policy ``fail``): the
            # request runs on either way, and is owed no completion.
            self.registry.fire_if_tracked(
                job.req_id, Event.LOAD_DONE, epoch=job.epoch, data=job.job_id
            )
            return False
        event = Event.LOAD_DONE if ok else Event.LOAD_FAILED
        return self.registry.fire_if_tracked(
            job.req_id, event, epoch=job.epoch, data=job.job_id
        )
