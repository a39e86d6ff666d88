"""`connector.scheduler.failed_keys.FailedKeys`: the failed-load memory.

Unit level.

The memory against a real dead peer is tested in `tests/test_cluster.py`.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from connector.metadata import JobResult
from connector.scheduler.failed_keys import FailedKeys
from connector.scheduler.side import Role, SchedulerSide


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_clip_cuts_before_the_first_remembered_key():
    keys = [b"a", b"b", b"c", b"d"]
    memory = FailedKeys(ttl_s=10, clock=Clock())
    assert memory.clip(keys, 4) == 4
    memory.record([b"c"])
    assert memory.clip(keys, 4) == 2
    assert memory.clip(keys, 1) == 1  # the store's own miss comes first
    stats = memory.stats()
    assert stats.recorded == 1
    assert stats.clipped == 1
    assert stats.blocks_clipped == 2
    assert stats.size == 1


def test_entry_expires_after_ttl():
    clock = Clock()
    memory = FailedKeys(ttl_s=5, clock=clock)
    memory.record([b"a"])
    clock.now += 4.9
    assert memory.clip([b"a"], 1) == 0
    clock.now += 0.2
    assert memory.clip([b"a"], 1) == 1
    assert b"a" not in memory
    assert memory.stats().expired == 1


def test_master_forgetting_the_key_forgets_the_entry():
    """The lookup's first miss is remembered: the master dropped it."""
    memory = FailedKeys(ttl_s=60, clock=Clock())
    memory.record([b"b", b"c"])
    assert memory.clip([b"a", b"b", b"c"], 1) == 1
    assert b"b" not in memory
    assert b"c" in memory  # beyond the miss: unknown, kept
    assert memory.stats().forgotten == 1
    # A fresh save of b is served again.
    assert memory.clip([b"a", b"b"], 2) == 2


def test_record_refreshes_and_capacity_drops_oldest():
    clock = Clock()
    memory = FailedKeys(ttl_s=10, capacity=2, clock=clock)
    memory.record([b"a", b"b"])
    clock.now += 5
    memory.record([b"a"])  # refreshed: now the newest
    memory.record([b"c"])  # over capacity: b (oldest) goes
    assert b"b" not in memory
    assert b"a" in memory
    assert b"c" in memory
    assert memory.stats().evicted == 1
    clock.now += 6  # the first record of a would have expired by now
    assert b"a" in memory


@pytest.mark.parametrize(("ttl", "cap"), [(0, 1), (-1.0, 1), (1, 0)])
def test_bad_bounds_raise(ttl, cap):
    with pytest.raises(ValueError, match="must be positive"):
        FailedKeys(ttl_s=ttl, capacity=cap)


def test_concurrent_record_and_clip():
    memory = FailedKeys(ttl_s=60, capacity=1000)
    keys = [i.to_bytes(4, "big") for i in range(200)]

    def writer(start: int) -> None:
        for i in range(start, 200, 4):
            memory.record([keys[i]])
            memory.clip(keys, 200)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(memory) == 200
    assert memory.clip(keys, 200) == 0


def test_load_in_flight_defers_then_failure_clips():
    """One load per block in flight: others wait, then see the failure."""
    clock = Clock()
    memory = FailedKeys(ttl_s=10, max_wait_s=5, clock=clock)
    keys = [b"a", b"b", b"c"]
    memory.loading(keys[1:])
    assert memory.clip(keys, 3) is None
    assert memory.clip(keys, 1) == 1  # the hit stops before the load
    memory.loaded(keys[1:], failed=[b"c"])
    assert memory.clip(keys, 3) == 2
    assert memory.stats().deferred == 1
    assert memory.stats().in_flight == 0


def test_load_in_flight_success_releases_and_overlapping_loads_count():
    clock = Clock()
    memory = FailedKeys(ttl_s=10, max_wait_s=5, clock=clock)
    memory.loading([b"a"])
    memory.loading([b"a"])
    memory.loaded([b"a"])
    assert memory.clip([b"a"], 1) is None  # the second load still runs
    memory.loaded([b"a"])
    assert memory.clip([b"a"], 1) == 1
    assert b"a" not in memory


def test_a_slow_load_is_suspect_after_max_wait():
    """Past `max_wait_s` the others recompute instead of waiting."""
    clock = Clock()
    memory = FailedKeys(ttl_s=10, max_wait_s=5, clock=clock)
    memory.loading([b"b"])
    clock.now += 4.9
    assert memory.clip([b"a", b"b"], 2) is None
    clock.now += 0.2
    assert memory.clip([b"a", b"b"], 2) == 1
    assert memory.stats().slow == 1
    memory.loaded([b"b"])
    assert memory.clip([b"a", b"b"], 2) == 2


def test_a_load_that_never_ends_is_forgotten_after_ttl():
    clock = Clock()
    memory = FailedKeys(ttl_s=10, max_wait_s=1, clock=clock)
    memory.loading([b"a"])
    clock.now += 10
    assert memory.clip([b"a"], 1) == 1
    assert memory.stats().in_flight == 0


# -- the scheduler half's call sites, with plain objects for vLLM's --------


class Lookup:
    def hit_blocks(self, hashes):
        return len(hashes)


def request(req_id, hashes):
    return SimpleNamespace(
        request_id=req_id,
        block_hashes=list(hashes),
        num_prompt_tokens=4 * len(hashes) + 1,
        num_tokens=4 * len(hashes) + 1,
        status=SimpleNamespace(name="WAITING"),
    )


def step_output():
    cached = SimpleNamespace(
        req_ids=[],
        resumed_req_ids=set(),
        new_block_ids=[],
        num_computed_tokens=[],
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=cached,
        finished_req_ids=set(),
    )


def report(job_id, invalid):
    return SimpleNamespace(
        kv_connector_worker_meta=SimpleNamespace(
            results=[JobResult(job_id, failed=1)]
        ),
        invalid_block_ids=set(invalid),
        finished_recving=None,
        finished_sending=None,
    )


def test_scheduler_remembers_failed_blocks_reported_by_every_rank():
    """TP 2: the ranks report a failed load in different steps; the block
    rank 0 failed is remembered, and a request waits while it loads."""
    side = SchedulerSide(
        block_size=4,
        role=Role.CONSUMER,
        lookup=Lookup(),
        world_size=2,
        threaded_lookups=False,
    )

    def ask(req):
        """vLLM's call; the lookup thread answers before the next one."""
        answer = side.get_num_new_matched_tokens(req, 0)
        side.lookups.dispatch()  # as build_connector_meta does
        if answer == (None, False) and side.lookups.run_pending():
            answer = side.get_num_new_matched_tokens(req, 0)
        return answer

    first = request("r1", [b"a", b"b"])
    side.on_new_request(first)
    assert ask(first) == (8, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],))
    side.update_state_after_alloc(first, blocks, 8)
    (job,) = side.build_connector_meta(step_output()).jobs

    second = request("r2", [b"a", b"b"])
    side.on_new_request(second)
    assert ask(second) == (None, False)  # deferred: r1 is loading them
    assert side.lookup_counts["deferred"] == 1

    side.update_connector_output(report(job.job_id, {6}))  # rank 0
    assert ask(second) == (None, False)
    side.update_connector_output(report(job.job_id, set()))  # rank 1
    assert b"b" in side.failed_keys
    assert b"a" not in side.failed_keys
    assert ask(second) == (4, True)
