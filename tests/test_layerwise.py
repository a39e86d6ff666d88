"""Layer-wise loads: a store hit runs in the step it is admitted.

vLLM 0.33's real scheduler (`harness.Harness`) over a real master: a hit
within ``layerwise_load_max_blocks`` is answered ``load_async`` False, so
vLLM schedules it in the step that allocates it (never
``WAITING_FOR_REMOTE_KVS``); the harness plays the model runner layer by
layer and checks, when each ``wait_for_layer_load`` returns, that the
layer's KV is what recomputation writes (or that the block is reported a
load error this step).  A load past ``transfer_timeout`` is given up in
the layer's wait, its blocks recomputed, and the late transfer never
writes.  Larger hits stay asynchronous.
"""

from __future__ import annotations

import itertools
import time

import pytest

from connector.metadata import JobKind
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    prompt,
    run,
    side,
    store_prefix,
)
from tests.worker_helpers import Gate

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm]

TIMEOUT_S = 0.5
PREFIX = 64  # 4 blocks of 16
LOAD = JobKind.LOAD


@pytest.fixture
def make(extra, harnesses):
    pytest.importorskip("vllm")
    from harness import Harness  # noqa: PLC0415

    def _make(
        *,
        max_blocks=8,
        timeout=TIMEOUT_S,
        save_blocks=0,
        lookup_wait_ms=0,
        segment=None,
        store_tp=None,
        **kw,
    ):
        conf = {
            **extra,
            **({"store_tp_size": store_tp} if store_tp else {}),
            # Another segment size: a store client of its own (a peer).
            **({"global_segment_size": segment} if segment else {}),
            "transfer_timeout": timeout,
            "layerwise_load_max_blocks": max_blocks,
            "layerwise_save_blocks": save_blocks,
            "lookup_wait_ms": lookup_wait_ms,
        }
        h = Harness(CONNECTOR, extra_config=conf, **kw)
        harnesses.append(h)
        return h

    return _make


def _slowest_step(h, limit_s=20):
    """Step `h` until idle (at most `limit_s`); its slowest step's s."""
    slowest = 0.0
    end = time.monotonic() + limit_s
    while not h.is_idle() and time.monotonic() < end:
        started = time.monotonic()
        h.step()
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.005)
    return slowest


def _statuses(h, req_id, steps=60):
    """Step until `req_id` finished; its status after each step."""
    seen = []
    for _ in range(steps):
        if h.is_idle():
            break
        report = h.step()
        request = h.requests.get(req_id)
        if request is not None:
            seen.append((request.status.name, req_id in report.scheduled))
        if not report.scheduled:
            time.sleep(0.005)
    return seen


def test_a_store_hit_runs_in_the_step_it_is_admitted(make):
    store_prefix(make, 3, PREFIX)
    b = make(num_blocks=40, enable_prefix_caching=False)
    b.add_request("b", [*prompt(3, PREFIX), 5], max_tokens=4)
    seen = _statuses(b, "b")
    run(b)
    assert "WAITING_FOR_REMOTE_KVS" not in {s for s, _ in seen}
    # Asked (lookup in flight), then scheduled at once with its hit.
    assert [ran for _, ran in seen[:2]] == [False, True]
    assert b.external_hit_tokens == PREFIX
    w = b.worker_connector.worker_side
    assert w.jobs_done[LOAD] == 1
    assert w.layer_loads_expired == 0
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def _spanned(worker):
    """Loads the worker's staging read in spans of layers (per shard)."""
    transfers = [
        part
        for lane in worker.lanes
        for part in getattr(lane.transfer, "parts", (lane.transfer,))
    ]
    return sum(
        getattr(getattr(t, "loads", None), "spanned", 0) for t in transfers
    )


class _SlowSpans:
    """The store, each span after a load's first told late (a slow peer).

    With `lag_session`, every span of that get session (0: the first
    to start) is late, its first too.
    """

    def __init__(self, store, pause_s, lag_session=None):
        self.store = store
        self.pause_s = pause_s
        self.lag_session = lag_session
        self.told: list[int] = []
        self._sessions = itertools.count()

    def get_spans(self, keys, ptrs, spans, landed):
        lag = next(self._sessions) == self.lag_session

        def slow(index, ok):
            if index or lag:
                time.sleep(self.pause_s)
            self.told.append(index)
            return landed(index, ok)

        return self.store.get_spans(keys, ptrs, spans, slow)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _peer_segment(seed):
    """A segment size no other harness of the session used: B's store
    client opens after A saved, so no block of A's lies in B's segment
    (clients live as long as the process; a get from one's own segment
    is a memcpy, never read in spans)."""
    return f"{40 + seed}MiB"


def _peer_hit(make, seed, pause_s):
    """A (4 layers) stores a prefix; B, a peer with a store client of its
    own, is asked for it, each span after a load's first told `pause_s`
    late.  Returns (B, its worker, the slow store)."""
    a = make(num_blocks=40, num_layers=4)
    a.add_request("a", prompt(seed, PREFIX), max_tokens=2)
    run(a)
    b = make(
        num_blocks=40,
        num_layers=4,
        segment=_peer_segment(seed),
        enable_prefix_caching=False,
    )
    w = b.worker_connector.worker_side
    slow = _SlowSpans(w._store, pause_s)
    w._store = slow
    b.add_request("b", [*prompt(seed, PREFIX), 5], max_tokens=4)
    return b, w, slow


def test_a_peers_hit_is_waited_for_layer_by_layer(make):
    """B loads A's blocks from A's segment (a store client of its own):
    the load is read in spans of layers (4 layers: 1, 1, 2), each span
    late by 50 ms.  The harness checks each layer's KV when its
    attention runs, so a wait that returned before its layer's span was
    written fails the run; every span lands, nothing expires.
    """
    b, w, slow = _peer_hit(make, 13, 0.05)
    seen = _statuses(b, "b")
    run(b)
    assert "WAITING_FOR_REMOTE_KVS" not in {s for s, _ in seen}
    assert b.external_hit_tokens == PREFIX
    assert _spanned(w) == 1
    assert slow.told == [0, 1, 2]
    assert (w.jobs_done[LOAD], w.jobs_failed[LOAD]) == (1, 0)
    assert w.layer_loads_expired == 0
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def test_a_rank_holding_two_head_shards_waits_for_both_by_layer(make):
    """A at TP=2 stores a prefix head-sharded (``store_tp_size`` 2); B at
    TP=1, a peer, holds both shards of each block and loads them
    layer-wise: both shards are read in spans side by side, each span
    after the first told 50 ms late, and every span of the second shard
    to start.  The harness checks each layer's KV (both head halves)
    when its attention runs, so a layer counted in after one shard (its
    first span in, the other's late) fails the run."""
    a = make(tp_size=2, kv_heads=2, num_blocks=40, num_layers=4, store_tp=2)
    a.add_request("a", prompt(15, PREFIX), max_tokens=2)
    run(a)
    b = make(
        kv_heads=2,
        num_blocks=40,
        num_layers=4,
        store_tp=2,
        segment=_peer_segment(15),
        enable_prefix_caching=False,
    )
    w = b.worker_connector.worker_side
    slow = _SlowSpans(w._store, 0.05, lag_session=1)
    w._store = slow
    b.add_request("b", [*prompt(15, PREFIX), 5], max_tokens=4)
    seen = _statuses(b, "b")
    run(b)
    assert "WAITING_FOR_REMOTE_KVS" not in {s for s, _ in seen}
    assert b.external_hit_tokens == PREFIX
    assert [len(lane.transfer.parts) for lane in w.lanes] == [2]
    assert _spanned(w) == 2  # each shard in spans
    assert sorted(slow.told) == [0, 0, 1, 1, 2, 2]
    assert (w.jobs_done[LOAD], w.jobs_failed[LOAD]) == (1, 0)
    assert w.layer_loads_expired == 0
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(a)
    assert_clean(b)


def test_a_span_past_the_deadline_is_recomputed(make):
    """The second span arrives after `transfer_timeout`: layer 1's wait
    returns at the deadline, the blocks are reported as load errors
    (vLLM recomputes them, the layer already written included), the
    step is no slower than the deadline allows, and the span that
    arrives later is never written (the harness checks every layer).
    """
    b, w, slow = _peer_hit(make, 14, TIMEOUT_S + 0.5)
    slowest = _slowest_step(b)
    assert _spanned(w) == 1
    assert w.jobs_failed[LOAD] == 1
    assert TIMEOUT_S <= slowest < TIMEOUT_S + 1.0
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    time.sleep(0.6)  # the late span told, and refused
    run(b)
    assert slow.told == [0, 1]  # the read stopped after the late span
    assert_clean(b)


def test_a_hit_above_the_bound_stays_asynchronous(make):
    store_prefix(make, 4, PREFIX)
    b = make(max_blocks=2, num_blocks=40, enable_prefix_caching=False)
    b.add_request("b", [*prompt(4, PREFIX), 5], max_tokens=4)
    seen = _statuses(b, "b")
    run(b)
    assert "WAITING_FOR_REMOTE_KVS" in {s for s, _ in seen}
    assert b.external_hit_tokens == PREFIX
    assert b.worker_connector.worker_side.jobs_done[LOAD] == 1
    assert_clean(b)


def test_a_late_layer_load_is_given_up_and_recomputed(make):
    """Every get hangs: the first layer's wait returns at the deadline,
    the blocks are reported as load errors (vLLM recomputes them in
    place), and the late get, released afterwards, writes nowhere the
    harness's every-step KV check would see.
    """
    store_prefix(make, 5, PREFIX)
    b = make(num_blocks=40, enable_prefix_caching=False)
    w = b.worker_connector.worker_side
    gate = Gate(w._store, puts=False)
    w._store = gate
    b.add_request("b", [*prompt(5, PREFIX), 5], max_tokens=4)
    try:
        slowest = _slowest_step(b)
    finally:
        gate.release()
    assert gate.entered.is_set()
    # Given up at the deadline by the staging's own wait or by the
    # layer's (whichever claims the load first), never both.
    assert w.jobs_failed[LOAD] == 1
    assert TIMEOUT_S <= slowest < TIMEOUT_S + 1.0
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert gate.ended.wait(10)
    run(b)
    assert_clean(b)


def test_loads_layerwise_rule():
    from connector.scheduler.lookup import NO_LOOKUP  # noqa: PLC0415
    from connector.scheduler.side import Role, SchedulerSide  # noqa: PLC0415

    s = SchedulerSide(
        block_size=16,
        role=Role.BOTH,
        lookup=NO_LOOKUP,
        threaded_lookups=False,
        layerwise_max_blocks=4,
    )
    try:
        assert [s.loads_layerwise(n * 16) for n in (0, 1, 4, 5)] == [
            False,
            True,
            True,
            False,
        ]
    finally:
        s.close()
    with pytest.raises(ValueError, match="layerwise_max_blocks"):
        SchedulerSide(
            block_size=16,
            role=Role.BOTH,
            lookup=NO_LOOKUP,
            threaded_lookups=False,
            layerwise_max_blocks=-1,
        )


def test_layerwise_key_is_read_and_needs_a_deadline():
    from connector.config import LoadConfig  # noqa: PLC0415
    from connector.errors import ConfigError  # noqa: PLC0415

    on = LoadConfig.from_extra_config({"layerwise_load_max_blocks": 16})
    assert on.layerwise_max_blocks == 16
    off = LoadConfig.from_extra_config(
        {"layerwise_load_max_blocks": 16, "transfer_timeout": 0}
    )
    assert off.layerwise_max_blocks == 0
    assert LoadConfig().layerwise_max_blocks == 0
    with pytest.raises(ConfigError, match="layerwise_load_max_blocks"):
        LoadConfig.from_extra_config({"layerwise_load_max_blocks": -1})


class _Slow:
    """The real store, each get `delay_s` late (within the deadline)."""

    def __init__(self, store, delay_s):
        self.store, self.delay_s = store, delay_s

    def get(self, keys, regions):
        time.sleep(self.delay_s)
        return self.store.get(keys, regions)

    def put(self, keys, regions):
        return self.store.put(keys, regions)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_sleep_mode_waits_for_a_late_layer_load(make):
    """Sleep mode (``suspend``, before vLLM frees the KV memory) while a
    layer-wise load given up at its deadline is still stuck in the
    store: the late get still holds its staging buffer, so ``suspend``
    reports a transfer running (the memory must stay registered); once
    the get ends, the worker drains.  Layer-wise loads run on their own
    thread, outside the load loop's queue: the staging is what tells.
    """
    store_prefix(make, 7, PREFIX)
    b = make(num_blocks=40, enable_prefix_caching=False)
    w = b.worker_connector.worker_side
    gate = Gate(w._store, puts=False)
    w._store = gate
    b.add_request("b", [*prompt(7, PREFIX), 5], max_tokens=4)
    try:
        end = time.monotonic() + 20
        while not b.is_idle() and time.monotonic() < end:
            b.step()
            time.sleep(0.005)
        assert gate.entered.is_set()
        assert w.jobs_failed[LOAD] == 1  # given up, still in the store
        assert not w.suspend(timeout=0.3)
    finally:
        gate.release()
    assert gate.ended.wait(10)
    assert w.drain(5.0)
    w.resume()
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}


def test_the_first_layer_waits_for_a_slow_load(make):
    """A load slower than the forward pass but within its deadline: the
    first layer's wait holds the forward until the KV is in (the harness
    checks each layer's KV when its attention runs), nothing fails.
    """
    store_prefix(make, 6, PREFIX)
    b = make(timeout=5.0, num_blocks=40, enable_prefix_caching=False)
    w = b.worker_connector.worker_side
    w._store = _Slow(w._store, 0.3)
    b.add_request("b", [*prompt(6, PREFIX), 5], max_tokens=4)
    run(b)
    assert b.external_hit_tokens == PREFIX
    assert (w.jobs_done[LOAD], w.jobs_failed[LOAD]) == (1, 0)
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def test_tp_ranks_finish_their_layer_loads_at_different_times(make):
    """Two ranks, each its own worker: rank 1's gets are slower (within
    the deadline).  Each rank's first layer waits for its own load; vLLM
    aggregates the ranks' reports; every rank's KV is checked when each
    layer's attention runs.
    """
    a = make(tp_size=2, kv_heads=2, num_blocks=40)
    a.add_request("a", prompt(9, PREFIX), max_tokens=2)
    run(a)
    b = make(
        timeout=5.0,
        tp_size=2,
        kv_heads=2,
        num_blocks=40,
        enable_prefix_caching=False,
    )
    slow = b.ranks[1][0].worker_side
    slow._store = _Slow(slow._store, 0.3)
    b.add_request("b", [*prompt(9, PREFIX), 5], max_tokens=4)
    seen = _statuses(b, "b")
    run(b)
    assert "WAITING_FOR_REMOTE_KVS" not in {s for s, _ in seen}
    assert b.external_hit_tokens == PREFIX
    for connector, _ in b.ranks:
        w = connector.worker_side
        assert (w.jobs_done[LOAD], w.jobs_failed[LOAD]) == (1, 0)
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def _saved_layerwise(h):
    """`h` saved through staging, layer by layer, and every save ended."""
    w = h.worker_connector.worker_side
    assert w.layerwise_saves
    assert hasattr(w.transfer, "layer_waits")  # staged, host caches too
    assert w.jobs_done[JobKind.SAVE] >= 1
    assert w.jobs_failed[JobKind.SAVE] == 0


def test_layerwise_saves_store_the_recomputed_kv(make):
    """A saves with layer-wise saves on (CPU caches staged); B, with no
    local prefix cache, loads it layer-wise: the harness checks each
    layer's KV against the recomputed KV when its attention runs, so
    the bytes A stored are what recomputation writes."""
    a = make(save_blocks=8, num_blocks=40)
    a.add_request("a", prompt(7, PREFIX), max_tokens=2)
    run(a)
    _saved_layerwise(a)
    b = make(num_blocks=40, enable_prefix_caching=False)
    b.add_request("b", [*prompt(7, PREFIX), 5], max_tokens=4)
    run(b)
    assert b.external_hit_tokens == PREFIX
    w = b.worker_connector.worker_side
    assert (w.jobs_done[LOAD], w.layer_loads_expired) == (1, 0)
    assert_clean(a)
    assert_clean(b)


def test_with_a_lookup_wait_a_store_hit_runs_in_the_step_it_arrives(make):
    """``lookup_wait_ms``: the lookup is sent and answered inside the
    first ``get_num_new_matched_tokens``, so with a layer-wise load the
    hit costs no step at all (the asked step is gone too)."""
    store_prefix(make, 12, PREFIX)
    b = make(num_blocks=40, enable_prefix_caching=False, lookup_wait_ms=2000)
    b.add_request("b", [*prompt(12, PREFIX), 5], max_tokens=4)
    seen = _statuses(b, "b")
    run(b)
    assert seen[0] == ("RUNNING", True)  # scheduled in its first step
    assert "WAITING_FOR_REMOTE_KVS" not in {s for s, _ in seen}
    assert b.external_hit_tokens == PREFIX
    assert side(b).lookup_counts["waited"] == 1
    assert_clean(b)


def test_a_request_loading_and_saving_layerwise(make):
    """B loads A's prefix layer-wise and saves its own new blocks
    layer-wise in the same steps; C loads all of B's prompt and checks
    every layer (the whole chain's KV is the recomputed KV)."""
    store_prefix(make, 8, PREFIX)
    b = make(save_blocks=8, num_blocks=40, enable_prefix_caching=False)
    longer = [*prompt(8, PREFIX), *prompt(9, 2 * 16)]
    b.add_request("b", longer, max_tokens=2)
    run(b)
    _saved_layerwise(b)
    assert b.external_hit_tokens == PREFIX
    c = make(max_blocks=16, num_blocks=40, enable_prefix_caching=False)
    c.add_request("c", [*longer, 5], max_tokens=2)
    run(c)
    assert c.external_hit_tokens == len(longer)
    assert c.worker_connector.worker_side.layer_loads_expired == 0
    assert_clean(b)
    assert_clean(c)


@pytest.mark.parametrize("ends", ["max_tokens=1", "stop token", "two tokens"])
def test_a_request_that_ends_in_its_first_step_still_saves(make, ends):
    """B extends A's stored prefix and loads it layer-wise; C then asks
    B's whole prompt and must hit all of it. B ends in the step it is
    first scheduled (one token: a prefill-only or P/D prefill request;
    its first token a stop token: EOS), before its load is known to be
    in through the worker's report: `request_finished` saves what it
    computed, pinned. With two tokens it saves in its second step."""
    from harness.scheduler import first_token  # noqa: PLC0415

    store_prefix(make, 10, PREFIX)
    b = make(num_blocks=40, enable_prefix_caching=False)
    longer = [*prompt(10, PREFIX), *prompt(11, 2 * 16)]
    stop = [first_token(longer)] if ends == "stop token" else []
    max_tokens = 2 if ends == "two tokens" else 1 if stop == [] else 4
    b.add_request("b", longer, max_tokens=max_tokens, stop_token_ids=stop)
    seen = _statuses(b, "b")
    run(b)
    assert b.external_hit_tokens == PREFIX
    assert "WAITING_FOR_REMOTE_KVS" not in {st for st, _ in seen}
    end = "FINISHED_STOPPED" if stop else "FINISHED_LENGTH_CAPPED"
    assert seen[-1][0] == end
    # Scheduled in one step (two for two tokens), from its admission on.
    steps = 2 if ends == "two tokens" else 1
    assert [ran for _, ran in seen[: steps + 1]] == [False] + [True] * steps
    assert sum(ran for _, ran in seen) == steps
    c = make(max_blocks=16, num_blocks=40, enable_prefix_caching=False)
    c.add_request("c", [*longer, 5], max_tokens=2)
    run(c)
    assert c.external_hit_tokens == len(longer)
    assert_clean(b)
    assert_clean(c)


class _Pool:
    """The part of vLLM's block pool saves pin: counts references."""

    def __init__(self, n: int) -> None:
        self.blocks = list(range(n))
        self.refs = [0] * n

    def touch(self, blocks):
        for b in blocks:
            self.refs[b] += 1

    def free_blocks(self, blocks):
        for b in blocks:
            self.refs[b] -= 1


@pytest.mark.parametrize(
    ("status", "outputs", "saved"),
    [
        ("FINISHED_LENGTH_CAPPED", 1, True),
        ("FINISHED_STOPPED", 1, True),
        ("FINISHED_ABORTED", 1, False),  # an abort: nothing is saved
        ("FINISHED_ERROR", 1, False),  # policy fail: a load error
        ("FINISHED_LENGTH_CAPPED", 0, False),  # its step never ran
    ],
)
def test_a_finish_in_the_load_step_saves_only_what_ran(status, outputs, saved):
    """The scheduler half alone: a request that loaded 2 blocks
    layer-wise and computed 2 more finishes in that step. A normal
    finish after its step issues one pinned save of the 2 computed
    blocks (``finished``, in the next step's jobs); an abort, an error
    or a request with no output (its step never ran) saves nothing."""
    from types import SimpleNamespace  # noqa: PLC0415

    from connector.metadata import JobKind  # noqa: PLC0415
    from connector.scheduler.side import Role, SchedulerSide  # noqa: PLC0415

    class Lookup:
        def hit_blocks_many(self, prefixes):
            return [2 for _ in prefixes]

    s = SchedulerSide(
        block_size=16,
        role=Role.BOTH,
        lookup=Lookup(),
        threaded_lookups=False,
        layerwise_max_blocks=4,
    )
    pool = _Pool(16)
    s.bind_block_pool(pool)
    req = SimpleNamespace(
        request_id="r",
        block_hashes=[bytes([i + 1]) * 8 for i in range(4)],
        num_prompt_tokens=65,
        num_tokens=65,
        prompt_token_ids=list(range(65)),
        all_token_ids=list(range(65)),
        status="WAITING",
        num_computed_tokens=0,
        num_output_tokens=0,
        num_in_flight_tokens=0,
        max_tokens=1,
    )
    empty = SimpleNamespace(
        req_ids=(),
        new_block_ids=(),
        num_computed_tokens=(),
        resumed_req_ids=frozenset(),
    )

    def step(new=(), scheduled=None):
        return SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=new,
            num_scheduled_tokens=scheduled or {},
            scheduled_cached_reqs=empty,
            finished_req_ids=set(),
        )

    try:
        assert s.get_num_new_matched_tokens(req, 0) == (None, False)
        s.build_connector_meta(step())
        s.lookups.run_pending()
        assert s.get_num_new_matched_tokens(req, 0) == (32, False)
        blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
        s.update_state_after_alloc(req, blocks, 32)
        new = SimpleNamespace(
            req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=32
        )
        meta = s.build_connector_meta(step([new], {"r": 33}))
        assert [(j.kind, j.layerwise) for j in meta.jobs] == [
            (JobKind.LOAD, True)
        ]
        req.num_computed_tokens = 65  # the step ran (or was scheduled)
        req.num_output_tokens = outputs
        req.status = status
        assert s.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)
        after = s.build_connector_meta(step())
        saves = [j for j in after.jobs if j.kind is JobKind.SAVE]
        if saved:
            assert [(j.block_ids, j.finished, j.pinned) for j in saves] == [
                ((3, 4), True, True)
            ]
            assert (pool.refs[3], pool.refs[4]) == (1, 1)  # until reported
        else:
            assert saves == []
            assert sum(pool.refs) == 0
        assert len(s.registry) == 0  # the request's tracker ended
    finally:
        s.close()
