"""Admission lookups off the scheduler thread (pure unit tests).

`SchedulerSide` with a fake batch lookup, lookups run by hand
(``threaded_lookups=False``) and a fake clock: None while in flight, one
store call per step, bounded hold-back (time and count), and completions
that race an abort or a preemption.  The real-store and real-scheduler
paths are covered by `test_scheduler_guard.py`, the fuzzer and the
real-scheduler scenarios.
"""

from __future__ import annotations

import threading
import time

import pytest

from connector.scheduler.admission import LookupEvent, LookupState
from connector.scheduler.lookup import CHUNK, AsyncLookups, leading_hits
from connector.scheduler.requests import REQUESTS
from connector.scheduler.side import Role, SchedulerSide
from lifecycle import LifecycleMachine
from lifecycle.kv import Event, State

BS = 16


class FakeLookup:
    """Every prefix is stored for `stored` blocks; records each call."""

    def __init__(self, stored: int = 2) -> None:
        self.stored = stored
        self.calls: list[int] = []

    def hit_blocks_many(self, prefixes):
        self.calls.append(len(prefixes))
        return [min(self.stored, len(p)) for p in prefixes]


class Req:
    def __init__(self, req_id: str, blocks: int = 4) -> None:
        self.request_id = req_id
        self.block_hashes = [bytes([i + 1]) * 8 for i in range(blocks)]
        self.num_prompt_tokens = blocks * BS + 1
        self.num_tokens = self.num_prompt_tokens
        self.status = "WAITING"


class Cached:
    req_ids: tuple[str, ...] = ()
    new_block_ids: tuple[object, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    resumed_req_ids: frozenset[str] = frozenset()


class Step:
    def __init__(self, preempted=()) -> None:
        self.preempted_req_ids = set(preempted)
        self.scheduled_new_reqs = ()
        self.num_scheduled_tokens = {}
        self.scheduled_cached_reqs = Cached()
        self.finished_req_ids = set()


@pytest.fixture
def clock():
    return [0.0]


def make(clock, **kwargs) -> tuple[SchedulerSide, FakeLookup]:
    lookup = FakeLookup()
    side = SchedulerSide(
        block_size=BS,
        role=Role.BOTH,
        lookup=lookup,
        machine=LifecycleMachine(REQUESTS, strict=True),
        threaded_lookups=False,
        **kwargs,
    )
    side.lookups.clock = lambda: clock[0]
    return side, lookup


def test_none_until_the_lookup_returns_then_the_hit(clock):
    side, lookup = make(clock)
    a, b = Req("a"), Req("b")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    assert lookup.calls == []  # nothing sent from the hook
    side.build_connector_meta(Step())
    assert lookup.calls == []  # dispatched, not yet run
    side.lookups.run_pending()
    assert lookup.calls == [2]  # one store call for the step's lookups
    assert side.get_num_new_matched_tokens(a, 0) == (32, True)
    assert side.get_num_new_matched_tokens(b, 16) == (16, True)
    assert side.get_num_new_matched_tokens(a, 0) == (32, True)  # cached
    assert lookup.calls == [2]
    assert side.pending_lookups == 0
    assert side.lookup_counts["answered"] == 2


def test_held_back_at_most_the_timeout_then_a_miss(clock):
    side, _ = make(clock, lookup_timeout_s=0.05)
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    clock[0] = 0.049
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    clock[0] = 0.051  # the store never answered: compute locally
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    assert side.lookup_counts["timed_out"] == 1
    side.lookups.run_pending()  # the late answer is dropped
    side.build_connector_meta(Step())
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    assert side.pending_lookups == 0
    assert side.lookups.completed == 0


def test_at_most_max_pending_held_back(clock):
    side, _ = make(clock, max_pending=2)
    answers = [
        side.get_num_new_matched_tokens(Req(f"r{i}"), 0) for i in range(3)
    ]
    assert answers == [(None, False), (None, False), (0, False)]
    assert side.pending_lookups == 2
    assert side.lookup_counts["over_limit"] == 1


def test_a_lookup_returning_after_an_abort_is_dropped(clock):
    side, _ = make(clock)
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    a.status = "FINISHED_ABORTED"
    side.request_finished(a, [])
    assert "a" not in side.registry
    side.lookups.run_pending()
    side.build_connector_meta(Step())  # takes the completion
    assert side.lookup_counts["ended"] == 1
    assert side.pending_lookups == 0
    # The id is reused by a new request: it gets its own lookup.
    again = Req("a", blocks=3)
    assert side.get_num_new_matched_tokens(again, 0) == (None, False)


def test_a_lookup_from_before_a_preemption_is_stale(clock):
    side, _ = make(clock)
    a = Req("a")
    tracker = side.registry.get_or_create("a")
    side.registry.fire_on(tracker, Event.ALLOC_LOCAL)  # running
    # A lookup of epoch 0 in flight (vLLM asked while it waited).
    lookup = side._new_lookup(tracker)
    side._send(lookup, LookupEvent.ASK, (0, 1), [b"x" * 8])
    side.build_connector_meta(Step(preempted=["a"]))  # epoch 1, RESET
    assert tracker.state is State.RESET
    side.lookups.run_pending()
    side.build_connector_meta(Step())
    assert side.machine.stale_counts[(State.RESET, Event.LOOKUP_DONE)] == 1
    assert side.lookup_counts["refused"] == 1
    assert "a" not in side.lookup_registry  # nothing cached from epoch 0
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)


def test_leading_hits_needs_every_shard():
    # Two prefixes (2 and 3 blocks, 5 unique) over two shards.
    prefixes = [[b"a", b"b"], [b"c", b"d", b"e"]]
    unique = [b"a", b"b", b"c", b"d", b"e"]
    shard0 = [1, 1, 1, 0, 1]
    shard1 = [1, 0, 1, 1, 1]
    assert leading_hits(prefixes, unique, shard0 + shard1, 2) == [1, 1]
    assert leading_hits(prefixes, unique, [1] * 5, 1) == [2, 3]
    # An error code (here RPC_FAIL) is not a hit.
    assert leading_hits(prefixes, unique, [1, -900, 1, 1, 1], 1) == [1, 3]


def test_a_short_answer_is_refreshed_while_the_request_waits(clock):
    """A burst is looked up before its prefixes are stored: the cached
    miss is refreshed in the background each step it is older than
    LOOKUP_REFRESH_S, asked or not, and never holds the request back."""
    side, lookup = make(clock)
    lookup.stored = 0
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    lookup.stored = 4  # another request saved the prefix meanwhile
    clock[0] = 0.05  # younger than LOOKUP_REFRESH_S: the cache answers
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    side.build_connector_meta(Step())
    assert side.lookups.run_pending() == 0
    clock[0] = 0.15  # older: refreshed by the step, not by the hook
    side.build_connector_meta(Step())
    assert side.lookup_counts["refreshed"] == 1
    assert side.lookups.run_pending() == 1
    side.build_connector_meta(Step())  # takes the refreshed answer
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    assert lookup.calls == [1, 1]
    clock[0] = 10.0  # a full hit is never refreshed
    side.build_connector_meta(Step())
    assert side.get_num_new_matched_tokens(a, 0) == (64, True)
    assert side.lookups.run_pending() == 0
    assert side.pending_lookups == 0


def test_admission_on_a_cached_answer_drops_its_refresh(clock):
    side, lookup = make(clock)
    lookup.stored = 1
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    clock[0] = 1.0
    assert side.get_num_new_matched_tokens(a, 0) == (16, True)
    assert side.pending_lookups == 1  # the refresh, in flight

    class Blocks:
        @staticmethod
        def get_block_ids():
            return ([7, 8, 9, 10, 11],)

    side.update_state_after_alloc(a, Blocks(), 16)
    assert side.pending_lookups == 0
    assert side.lookup_counts["superseded"] == 1
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    side.build_connector_meta(Step())  # the late answer fires nothing
    assert side.registry.get("a").state is State.LOADING


def test_a_burst_is_asked_for_in_chunks():
    """Past `CHUNK` lookups a step takes several store calls, each
    answering its own requests and each sent as soon as it is full (the
    store answers while the step is still being scheduled); none is lost
    or asked twice."""
    fake = FakeLookup(stored=3)
    # A still clock: a pause of the process (a collector pass, another
    # test's Mooncake teardown holding the GIL) cannot expire lookups.
    lookups = AsyncLookups(
        lambda: fake, timeout_s=1.0, threaded=False, clock=lambda: 0.0
    )
    n = 2 * CHUNK + 5
    pending = []
    for i in range(n):
        pending.append(
            lookups.start(f"r{i}", None, 0, Req(f"r{i}", 4).block_hashes)
        )
        # A full chunk is sent at once, before the step ends.
        assert lookups.queued == (i + 1) // CHUNK
    assert lookups.dispatch() == 5  # the rest, at the end of the step
    assert lookups.run_pending() == 3
    assert fake.calls == [CHUNK, CHUNK, 5]
    assert [p.found for p in pending] == [3] * n
    assert all(p.done for p in pending)
    assert len(lookups.take_completed()) == n


class Blocks:
    @staticmethod
    def get_block_ids():
        return ([1, 2, 3, 4, 5],)


@pytest.mark.parametrize("answered_first", [True, False])
def test_a_dropped_lookup_is_never_applied(clock, answered_first):
    """vLLM admits a request whose lookup is in flight: the lookup is
    dropped; an answer already back is fenced by the lookup's epoch (a
    counted stale event), one not yet asked is never asked."""
    side, store = make(clock)
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())  # sent
    lookup = side.lookup_registry.get("a")
    assert lookup.state is LookupState.IN_FLIGHT
    if answered_first:
        side.lookups.run_pending()

    side.update_state_after_alloc(a, Blocks(), 0)  # admitted unanswered

    assert lookup.state is LookupState.DROPPED
    assert "a" not in side.lookup_registry
    assert side.pending_lookups == 0
    side.lookups.run_pending()
    side.build_connector_meta(Step())  # takes whatever came back
    stale = side.lookup_machine.stale_counts
    assert stale[(LookupState.DROPPED, LookupEvent.ANSWER)] == answered_first
    assert store.calls == ([1] if answered_first else [])
    assert lookup.hit_tokens == 0  # never applied
    assert side.machine.illegal_counts == {}
    assert side.registry.get("a").state is State.SAVING


def test_an_answer_taken_in_the_hook_is_not_taken_again(clock):
    """vLLM asks again once the answer is back: the hook takes it, and
    the same answer, still in the completed queue, is not taken a second
    time when the step takes the queue (after the admission ended the
    lookup): no stale answer, one ``lookup_done``, one answer."""
    side, _ = make(clock)
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.lookups.completed == 1
    assert side.get_num_new_matched_tokens(a, 0) == (32, True)
    side.update_state_after_alloc(a, Blocks(), 32)
    side.build_connector_meta(Step())  # takes the queue
    assert side.lookups.completed == 0
    assert side.lookup_machine.stale_counts == {}
    assert side.lookup_counts["answered"] == 1
    done = side.machine.transition_counts()
    assert sum(n for r, n in done.items() if r.event is Event.LOOKUP_DONE) == 1


def test_admission_ends_the_lookup_unless_the_request_still_waits(clock):
    """Admitted (the KV lifecycle left NEW): the lookup is over and
    leaves the registry.  A preempted request allocated on its local hit
    still waits (RESET) until it resumes, and vLLM may ask again: its
    answer stays, asked again without a new lookup."""
    side, store = make(clock)
    a, b = Req("a"), Req("b")
    b.block_hashes = [bytes([i + 9]) * 8 for i in range(4)]  # not loading
    for r in (a, b):
        assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(a, 0) == (32, True)
    side.update_state_after_alloc(a, Blocks(), 32)
    assert side.registry.get("a").state is State.LOADING
    assert "a" not in side.lookup_registry  # admitted: over

    # b runs, is preempted, and is allocated again on its local hit.
    side.update_state_after_alloc(b, Blocks(), 0)
    side.build_connector_meta(Step(preempted=["b"]))
    assert side.registry.get("b").state is State.RESET
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(b, 0) == (32, True)
    side.update_state_after_alloc(b, Blocks(), 0)
    assert side.registry.get("b").state is State.RESET  # until it resumes
    lookup = side.lookup_registry.get("b")
    assert lookup.state is LookupState.ANSWERED
    calls = list(store.calls)
    assert side.get_num_new_matched_tokens(b, 0) == (32, True)
    assert store.calls == calls  # no new lookup
    side.request_finished(b, [])
    assert "b" not in side.lookup_registry


def test_every_lookup_state_is_reached(clock):
    """Asked, in flight, answered, refreshing, dropped: each is a state
    of the lookup table a real sequence of hooks reaches."""
    side, lookup = make(clock)
    lookup.stored = 1
    a = Req("a")
    seen = []
    side.lookup_machine.add_observer(
        lambda _tracker, source, _event, dest: seen.extend((source, dest))
    )
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    clock[0] = 1.0
    assert side.get_num_new_matched_tokens(a, 0) == (16, True)
    side.request_finished(a, [])
    assert set(seen) >= set(LookupState)


def test_the_scheduler_thread_never_sleeps(monkeypatch):
    """A burst sent in chunks and answers handed over: the scheduler
    thread waits only for the lookup thread's signal, never on a timer."""
    main = threading.current_thread()
    slept = []
    real_sleep = time.sleep

    def spy(seconds):
        if threading.current_thread() is main:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", spy)
    fake = FakeLookup(stored=3)
    lookups = AsyncLookups(lambda: fake, timeout_s=5.0)
    try:
        pending = [
            lookups.start(f"r{i}", None, 0, Req(f"r{i}").block_hashes)
            for i in range(2 * CHUNK + 5)
        ]
        lookups.dispatch()
        lookups.handoff(pending[-1])
        assert lookups.wait_idle(5.0)
        assert all(p.done for p in pending)
    finally:
        lookups.close()
    assert slept == []


def test_the_lookups_clock_is_injected():
    """Deadlines, refreshes and the miss memory run on the given clock."""
    now = [50.0]
    side = SchedulerSide(
        block_size=BS,
        role=Role.BOTH,
        lookup=FakeLookup(),
        machine=LifecycleMachine(REQUESTS, strict=True),
        threaded_lookups=False,
        lookup_timeout_s=0.05,
        clock=lambda: now[0],
    )
    a = Req("a")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    now[0] += 0.06  # past the deadline on the injected clock only
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    assert side.lookup_counts["timed_out"] == 1
    assert side.recent.clock() == now[0]


def test_a_reset_drops_lookups_and_asks_the_new_generation(clock):
    """After `reset_generation` a waiting request's answer, cached or in
    flight, is the new lookup's; the step's metadata names the
    generation."""
    side, old = make(clock)
    a, b = Req("a"), Req("b")
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(a, 0) == (32, True)  # cached
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    side.build_connector_meta(Step())  # b's lookup dispatched, not run
    assert side.build_connector_meta(Step()).generation is None
    new = FakeLookup(stored=0)
    side.reset_generation("g1", new)
    assert side.pending_lookups == 0
    assert side.lookup_counts["reset"] == 1
    old_calls = list(old.calls)
    side.lookups.run_pending()  # the old batch's answer is discarded
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)
    meta = side.build_connector_meta(Step())
    assert meta.generation == "g1"
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    assert new.calls == [2]
    assert old.calls[len(old_calls) :] in ([], [1])


def admit_and_schedule(clock, **kwargs):
    """A request with no stored prefix, admitted and scheduled for its
    5-block prompt; returns (side, request, the step to build)."""
    side, lookup = make(clock, **kwargs)
    lookup.stored = 0
    req = Req("run")

    class Blocks:
        @staticmethod
        def get_block_ids():
            return ([1, 2, 3, 4, 5],)

    class New:
        req_id = "run"
        block_ids = ([1, 2, 3, 4, 5],)
        num_computed_tokens = 0

    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(Step())
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, Blocks(), 0)
    step = Step()
    step.scheduled_new_reqs = (New(),)
    step.num_scheduled_tokens = {"run": req.num_prompt_tokens}
    return side, req, step


@pytest.mark.parametrize("reset", [False, True])
def test_a_reset_stops_saves_of_admitted_requests(clock, reset):
    """A request admitted before the reset saves no block computed after
    it (its earlier KV came from the old weights); control: without the
    reset it saves its prompt."""
    side, _, step = admit_and_schedule(clock)
    if reset:
        side.reset_generation("g1", FakeLookup(stored=0))
    saves = side.build_connector_meta(step).jobs
    assert [len(j.block_ids) for j in saves] == ([] if reset else [4])


@pytest.mark.parametrize("reset", [False, True])
def test_a_reset_stops_decode_saves_too(clock, reset):
    """With ``save_decode_cache`` a request admitted before a reset saves
    no generated block after it either (its KV came from the old
    weights, and would be keyed under the new generation); control:
    without the reset the block its answer filled is saved."""
    side, req, step = admit_and_schedule(clock, save_decode=True)
    prompt = side.build_connector_meta(step).jobs
    assert [len(j.block_ids) for j in prompt] == [4]
    if reset:
        side.reset_generation("g1", FakeLookup(stored=0))
    req.block_hashes.append(b"\x09" * 8)  # the answer fills block 5

    class Decoding(Cached):
        req_ids = ("run",)
        new_block_ids = (None,)
        num_computed_tokens = (req.num_prompt_tokens,)

    step = Step()
    step.scheduled_cached_reqs = Decoding()
    step.num_scheduled_tokens = {"run": 5 * BS - req.num_prompt_tokens}
    saves = side.build_connector_meta(step).jobs
    assert [len(j.block_ids) for j in saves] == ([] if reset else [1])


def test_every_event_of_the_half_is_fired_on_the_scheduler_thread(clock):
    """The half's machines take no lock: every event of both tables
    (requests and lookups) comes from the thread that calls the hooks,
    never from the lookup thread, even with a real lookup thread
    answering a burst sent in chunks."""
    side = SchedulerSide(
        block_size=BS,
        role=Role.BOTH,
        lookup=FakeLookup(stored=2),
        machine=LifecycleMachine(REQUESTS, strict=True, thread_safe=False),
    )
    assert not side.machine.thread_safe
    assert not side.lookup_machine.thread_safe
    threads: set[int] = set()

    def seen(*_args):
        threads.add(threading.get_ident())

    side.machine.add_observer(seen)
    side.lookup_machine.add_observer(seen)
    side.lookup_machine.add_reject_observer(seen)
    try:
        reqs = [Req(f"r{i}") for i in range(2 * CHUNK + 3)]
        for i, r in enumerate(reqs):
            side.on_new_request(r)
            assert side.get_num_new_matched_tokens(r, 0) == (None, False)
            if i + 1 == CHUNK:  # the first chunk is answered meanwhile
                assert side.wait_for_lookups(5.0)
        side.build_connector_meta(Step())
        assert side.wait_for_lookups(5.0)
        for r in reqs[:5]:
            assert side.get_num_new_matched_tokens(r, 0) == (32, True)
            side.update_state_after_alloc(r, Blocks(), 32)
        side.build_connector_meta(Step())
        for r in reqs:
            side.request_finished(r, [])
    finally:
        side.close()
    assert threads == {threading.get_ident()}


# -- lookup_wait_ms: answered in the step a request arrives -----------------


class GatedLookup(FakeLookup):
    """A `FakeLookup` whose calls block until `gate` is set."""

    def __init__(self, stored: int = 2) -> None:
        super().__init__(stored)
        self.gate = threading.Event()

    def hit_blocks_many(self, prefixes):
        self.gate.wait(10.0)
        return super().hit_blocks_many(prefixes)


def threaded(lookup, **kwargs) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        role=Role.BOTH,
        lookup=lookup,
        machine=LifecycleMachine(REQUESTS, strict=True),
        **kwargs,
    )


def test_a_wait_budget_answers_in_the_first_call():
    """With ``lookup_wait_s`` the hook sends the lookup at once and waits
    for it: the hit in the first call, no step spent."""
    lookup = FakeLookup(stored=3)
    side = threaded(lookup, lookup_wait_s=2.0)
    try:
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (48, True)
        assert side.get_num_new_matched_tokens(Req("b", 2), 16) == (16, True)
        assert lookup.calls == [1, 1]  # each sent as it was asked
        assert side.lookup_counts["waited"] == 2
        assert side.lookup_counts["answered"] == 2
        assert side.pending_lookups == 0
    finally:
        side.lookups.close()


def test_without_a_wait_budget_the_first_call_cannot_tell():
    lookup = FakeLookup(stored=3)
    side = threaded(lookup)
    try:
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (None, False)
        assert lookup.calls == []  # sent with the step's batch
        assert side.lookup_counts["waited"] == 0
    finally:
        side.lookups.close()


def test_a_hung_store_costs_at_most_the_budget_per_step():
    """A store that does not answer: the first request waits out the
    step's budget, later ones in the step do not wait at all; the next
    step has a budget again (spent too while the store call is younger
    than `stalled_s`); answers still arrive and are used."""
    lookup = GatedLookup(stored=3)
    side = threaded(lookup, lookup_wait_s=0.05)
    side.lookups.stalled_s = 5.0  # the stall skip has its own test
    try:
        began = time.perf_counter()
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (None, False)
        for i in range(5):
            req = Req(f"b{i}")
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        spent = time.perf_counter() - began
        assert 0.045 <= spent < 0.5
        assert side.lookup_counts["wait_missed"] == 1  # only a waited
        side.build_connector_meta(Step())  # a new step: a new budget
        began = time.perf_counter()
        assert side.get_num_new_matched_tokens(Req("c"), 0) == (None, False)
        assert 0.045 <= time.perf_counter() - began < 0.5
        assert side.lookup_counts["wait_missed"] == 2
        lookup.gate.set()
        assert side.lookups.wait_idle(5.0)
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (48, True)
    finally:
        lookup.gate.set()
        side.lookups.close()


def test_async_lookups_wait_is_bounded_and_sends_a_queued_lookup():
    fake = GatedLookup(stored=1)
    lookups = AsyncLookups(lambda: fake, timeout_s=5.0)
    try:
        pending = lookups.start("r", None, 0, Req("r").block_hashes)
        assert pending.batch >= lookups.batches  # queued, not sent
        began = time.perf_counter()
        assert not lookups.wait(pending, 0.03)
        assert 0.025 <= time.perf_counter() - began < 0.5
        assert lookups.batches == 1  # the wait sent it
        fake.gate.set()
        assert lookups.wait(pending, 5.0)
        assert pending.found == 1
    finally:
        fake.gate.set()
        lookups.close()
    unthreaded = AsyncLookups(lambda: fake, timeout_s=5.0, threaded=False)
    queued = unthreaded.start("r", None, 0, Req("r").block_hashes)
    assert not unthreaded.wait(queued, 1.0)  # nothing could answer it


def test_with_a_wait_budget_a_burst_is_asked_as_it_arrives():
    """With ``lookup_wait_s`` a request's lookup leaves as it arrives
    (``on_new_request``): a burst's lookups merge into a store call or
    two (not one per request, sent as vLLM asks), and every request has
    its hit in vLLM's first question."""
    lookup = GatedLookup(stored=3)  # holds the first call: the rest merge
    side = threaded(lookup, lookup_wait_s=2.0, lookup_timeout_s=10.0)
    reqs = [Req(f"r{i}") for i in range(32)]
    try:
        for req in reqs:
            side.on_new_request(req)
        assert side.lookup_counts["on_arrival"] == 32
        assert side.pending_lookups == 32
        lookup.gate.set()
        for req in reqs:
            assert side.get_num_new_matched_tokens(req, 0) == (48, True)
        assert sum(lookup.calls) == 32
        assert len(lookup.calls) <= 2, lookup.calls
        assert side.lookup_counts["answered"] == 32
        assert side.pending_lookups == 0
    finally:
        lookup.gate.set()
        side.lookups.close()


class HeldPool:
    """vLLM's block pool as the arrival lookup reads it."""

    def __init__(self, held) -> None:
        self.held = set(held)
        self.blocks = []

    def get_cached_block(self, block_hash, group_ids):
        assert group_ids == [0]
        return [object()] if block_hash in self.held else None


def test_no_lookup_on_arrival_without_a_budget_or_for_a_held_prefix():
    """No budget: nothing is asked before vLLM asks.  With one, a
    request whose last loadable block vLLM holds, or whose first block
    missed moments ago, is not asked on arrival either."""
    lookup = FakeLookup(stored=3)
    plain = threaded(lookup)
    try:
        plain.on_new_request(Req("a"))
        assert plain.pending_lookups == 0
        assert plain.lookup_counts["on_arrival"] == 0
    finally:
        plain.lookups.close()
    side = threaded(lookup, lookup_wait_s=2.0, lookup_timeout_s=10.0)
    try:
        held = Req("held")
        side.bind_block_pool(HeldPool([held.block_hashes[3]]))
        side.on_new_request(held)
        assert side.pending_lookups == 0
        assert side.get_num_new_matched_tokens(held, 64) == (0, False)
        missed = Req("missed")
        side.recent.missed(missed.block_hashes[0])
        side.on_new_request(missed)
        assert side.lookup_counts["on_arrival"] == 0
        other = Req("other")
        other.block_hashes = [b"other%d" % i for i in range(4)]
        side.on_new_request(other)
        assert side.lookup_counts["on_arrival"] == 1
        assert lookup.calls == []  # never asked about the held prefix
    finally:
        side.lookups.close()


def test_a_lookup_that_missed_its_wait_is_waited_for_in_the_next_step():
    """The budget is per step: a lookup still in flight when a step's
    budget ran out is waited for again out of the next step's, so it is
    admitted in that step, not one later."""
    lookup = GatedLookup(stored=3)
    side = threaded(lookup, lookup_wait_s=0.01, lookup_timeout_s=5.0)
    req = Req("a")
    try:
        side.on_new_request(req)
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert side.lookup_counts["wait_missed"] == 1
        side.lookup_wait_s = 5.0
        side.build_connector_meta(Step())  # the next step's budget
        release = threading.Timer(0.05, lookup.gate.set)
        release.start()
        assert side.get_num_new_matched_tokens(req, 0) == (48, True)
        assert side.lookup_counts["waited"] == 1
        assert lookup.calls == [1]
    finally:
        lookup.gate.set()
        side.lookups.close()


def test_an_arrival_lookup_of_a_request_aborted_before_it_was_asked(clock):
    """A request aborted between its arrival and vLLM's first question:
    its lookup is dropped (the lookup thread skips it: never asked),
    nothing is left, and a reused id asks again."""
    side, lookup = make(clock, lookup_wait_s=0.5)
    a = Req("a")
    side.on_new_request(a)
    assert side.pending_lookups == 1
    a.status = "FINISHED_ABORTED"
    side.request_finished(a, [])
    assert "a" not in side.registry
    assert "a" not in side.lookup_registry
    side.lookups.run_pending()
    side.build_connector_meta(Step())
    assert side.lookup_counts["ended"] == 1
    assert side.pending_lookups == 0
    assert lookup.calls == []
    again = Req("a", blocks=3)
    side.on_new_request(again)
    assert side.lookup_counts["on_arrival"] == 2
    side.lookups.run_pending()
    assert side.get_num_new_matched_tokens(again, 0) == (32, True)
    assert lookup.calls == [1]


def test_no_wait_while_the_lookup_thread_is_stalled_in_the_store():
    """A master that hangs holds the lookup thread's store call: past
    `stalled_s` the hooks stop spending their budget on answers that
    cannot come, and wait again once the call returned."""
    lookup = GatedLookup(stored=3)
    side = threaded(lookup, lookup_wait_s=1.0, lookup_timeout_s=10.0)
    side.lookups.stalled_s = 0.01
    try:
        side.on_new_request(Req("a"))
        end = time.monotonic() + 5.0
        while not side.lookups.stalled and time.monotonic() < end:
            time.sleep(0.005)
        assert side.lookups.stalled
        began = time.perf_counter()
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (None, False)
        other = Req("b")
        other.block_hashes = [b"b%d" % i for i in range(4)]
        assert side.get_num_new_matched_tokens(other, 0) == (None, False)
        assert time.perf_counter() - began < 0.5  # not the 1 s budget
        assert side.lookup_counts["wait_skipped"] == 2
        lookup.gate.set()
        assert side.lookups.wait_idle(5.0)
        assert not side.lookups.stalled
        assert side.get_num_new_matched_tokens(Req("a"), 0) == (48, True)
    finally:
        lookup.gate.set()
        side.lookups.close()
