"""Fault injection: the connector in vLLM's real scheduler, the store failing.

Each test runs `harness.scheduler.Harness` (vLLM 0.33's `Scheduler`, our
connector loaded by module path, KV content checked every step) against a
private `mooncake_master` that is killed, hung (SIGSTOP) and restarted
mid-run, filled up, or whose transfers fail in part.  Loads that fail turn
into recompute through vLLM's load-error path (the harness checks that no
block serves wrong KV), saves are skipped, no step stalls beyond the
configured bound, and every request finishes: none hangs waiting for its
KV.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import time

import pytest

pytest.importorskip("vllm")

from connector.metadata import JobKind
from connector.store import (
    DEAD_MASTER_STALL_S,
    BatchResult,
    Op,
    Outcome,
)
from harness import Harness
from tests import connector_helpers as helpers
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    prompt,
    side,
    store_extra,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

RPC_TIMEOUT_MS = 1000
SLACK_S = 1.0
SLOW_S = 0.5


@pytest.fixture
def faulty(start_master, unique):
    """A private master and a harness factory bound to it."""
    master = start_master(lease_ttl_ms=500)
    made = []
    extra = store_extra(
        master,
        unique,
        local_hostname="127.0.0.1",
        rpc_timeout_ms=RPC_TIMEOUT_MS,
        breaker_probe_ms=200,
        close_timeout_ms=1000,
        setup_retries=1,
    )

    # The faults are injected from inside the lookup (which now runs on
    # the lookup thread) and take a while (SIGSTOP waits for the stopped
    # state): a long hold-back bound keeps the hit the faulted load needs
    # from being answered as a timed-out miss first.
    extra["lookup_timeout_ms"] = 30_000

    def make(**kwargs):
        config = {**extra, **kwargs.pop("extra", {})}
        h = Harness(CONNECTOR, extra_config=config, **kwargs)
        made.append(h)
        return h

    yield master, make
    clients = {
        c._client
        for h in made
        for c in (h.scheduler_connector, h.worker_connector)
    }
    for h in reversed(made):
        h.close()
    for client in clients:
        if client is not None:
            client.close()  # a client of a dead master must not outlive it


def drive(h, deadline_s=30.0, until=None):
    """Step until idle (or `until()`); return every step's duration (s)."""
    durations = []
    end = time.monotonic() + deadline_s
    while not h.is_idle() and time.monotonic() < end:
        if until is not None and until():
            return durations
        started = time.monotonic()
        report = h.step()
        durations.append(time.monotonic() - started)
        if not report.scheduled:
            time.sleep(0.005)  # only transfers pending: let them run
    h.check()
    return durations


def saves_again(h, within_s, seed, pause_s=0.2):
    """New requests on `h` until its worker saves one (a store fault is
    over), within `within_s`; then `h` is clean."""
    worker = h.worker_connector.worker_side
    saved = worker.jobs_done[JobKind.SAVE]
    deadline = time.monotonic() + within_s
    n = 0
    while worker.jobs_done[JobKind.SAVE] == saved:
        assert time.monotonic() < deadline, "no save after the restart"
        h.add_request(f"c{n}", prompt(seed + n, 40), max_tokens=2)
        drive(h)
        n += 1
        time.sleep(pause_s)
    assert_clean(h)


def fault_after_first_hit(h, fault):
    """Inject `fault` right after the first store hit: the load meets it."""
    real = side(h)._lookup
    fired = []

    class FaultAfterHit:
        def hit_blocks(self, hashes):
            hit = real.hit_blocks(hashes)
            if hit and not fired:
                fired.append(time.monotonic())
                fault()
            return hit

    side(h)._lookup = FaultAfterHit()
    return fired


def loads_failed(h):
    return h.worker_connector.worker_side.jobs_failed[JobKind.LOAD]


def store_prefix(make, seed, length):
    """`connector_helpers.store_prefix`, stepping with `drive`."""
    return helpers.store_prefix(make, seed, length, drive=drive)


def faulted_consumer(make, seed, fault):
    """Store `prompt(seed, 64)`, then queue three requests extending it on
    a new instance that calls `fault()` right after its first store hit.

    Returns the instance and `fault_after_first_hit`'s record.
    """
    store_prefix(make, seed, 64)
    b = make(num_blocks=40)
    fired = fault_after_first_hit(b, fault)
    for i in range(3):
        b.add_request(f"b{i}", [*prompt(seed, 64), i], max_tokens=6)
    return b, fired


class TestMasterFaults:
    def test_killed_mid_run_then_restarted(self, faulty):
        """SIGKILL between lookup and load: recompute, one bounded stall;
        after a restart saves land again.
        """
        master, make = faulty
        b, fired = faulted_consumer(make, 5, master.kill)
        durations = drive(b)
        assert fired
        assert loads_failed(b) >= 1
        assert sum(b.external_hits.values()) >= 64
        assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 3}
        assert max(durations) < DEAD_MASTER_STALL_S + SLACK_S
        assert sum(d > SLOW_S for d in durations) <= 1
        assert_clean(b)

        master.restart()
        saves_again(b, 15.0, seed=100)

    def test_hung_mid_run_then_resumed(self, faulty):
        """SIGSTOP between lookup and load: every step within the RPC
        timeout, failed loads recomputed; after SIGCONT loads work again.
        """
        master, make = faulty
        b, fired = faulted_consumer(make, 6, master.pause)
        try:
            durations = drive(b, until=lambda: loads_failed(b) >= 1)
        finally:
            master.resume()
        durations += drive(b)
        assert fired
        assert loads_failed(b) >= 1
        assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 3}
        assert max(durations) < RPC_TIMEOUT_MS / 1000 + SLACK_S
        assert_clean(b)

        # The data survived the hang: another instance loads it.
        client = b.scheduler_connector._client
        deadline = time.monotonic() + 10.0
        while set(client.exists(["probe"])) != {Outcome.MISS}:
            assert time.monotonic() < deadline, "the master did not return"
            time.sleep(0.1)  # the breaker lets a probe through every 200 ms
        c = make(num_blocks=40)
        c.add_request("c", [*prompt(6, 64), 50], max_tokens=2)
        drive(c)
        assert c.external_hits["c"] == 64
        assert loads_failed(c) == 0
        assert_clean(c)


class TestStoreFaults:
    def test_store_full_skips_saves(self, start_master, unique):
        """The real master refuses saves (-200) once its segment is full.

        The 16 MiB segment holds 64 blocks of 256 KiB; 44 are taken by
        hard-pinned objects (never evicted) and the master evicts only
        when an allocation fails (high watermark 1.0), so the first 20
        saved blocks fit and the rest meet STORE_FULL however fast or
        slow the machine is.  (Without the pins the test raced the
        master's background eviction and failed once on a slow CI
        machine.)  Sixteen 512-token prompts save 128 blocks: refused
        saves are counted under STORE_FULL; requests finish, nothing
        leaks, no wrong KV.  (`tests/test_cluster.py` fills a pool of
        several instances.)
        """
        master = start_master(
            lease_ttl_ms=500, eviction_high_watermark_ratio=1.0
        )
        config = store_extra(
            master,
            unique,
            local_hostname="127.0.0.1",
            rpc_timeout_ms=RPC_TIMEOUT_MS,
            close_timeout_ms=1000,
            setup_retries=1,
            global_segment_size="16MiB",
        )
        h = Harness(
            CONNECTOR,
            extra_config=config,
            num_blocks=48,
            block_size=64,
            kv_width=512,  # 64 x 512 x 4 B x 2 layers = 256 KiB blocks
            max_num_batched_tokens=1024,
        )
        try:
            pin_fillers(h.worker_connector._client.raw, 44, 256 * 1024)
            worker = h.worker_connector.worker_side
            refused = count_store_full(h.worker_connector)
            for i in range(16):
                h.add_request(f"r{i}", prompt(200 + i, 512), max_tokens=2)
            drive(h, deadline_s=120.0)
            assert refused["keys"] >= 1
            assert worker.jobs_failed[JobKind.SAVE] >= 1
            assert worker.jobs_done[JobKind.SAVE] >= 1
            assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 16}
            assert_clean(h)
        finally:
            h.close()
            for c in (h.scheduler_connector, h.worker_connector):
                if c._client is not None:
                    c._client.close()

    @pytest.mark.parametrize("async_scheduling", [False, True])
    def test_fraction_of_transfers_fail(self, faulty, async_scheduling):
        """A third of the keys fail (garbage in the block): recompute."""
        _, make = faulty
        store_prefix(make, 8, 96)
        h = make(num_blocks=40, async_scheduling=async_scheduling)
        worker = h.worker_connector.worker_side
        flaky = Flaky(worker._store, seed=7, rate=1 / 3)
        worker._store = flaky
        for i in range(6):
            h.add_request(f"r{i}", [*prompt(8, 96), i], max_tokens=4)
        drive(h)
        assert flaky.failed[Op.GET] >= 1
        assert flaky.failed[Op.PUT] >= 1
        assert loads_failed(h) >= 1
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 6}
        assert_clean(h)


class Flaky:
    """A store whose transfers fail per key, like a lossy link.

    Whether a key's n-th get (or put) fails is a pure function of the
    seed, so runs repeat.  A failed get scribbles over its region first,
    so KV served from a failed block would fail the content checks.
    """

    def __init__(self, store, seed, rate):
        self.store = store
        self.seed = seed
        self.rate = rate
        self.tries = collections.Counter()
        self.failed = {Op.GET: 0, Op.PUT: 0}

    def _fails(self, op, key):
        block = key.rpartition("@")[2]  # the block hash, not the namespace
        self.tries[op, block] += 1
        text = f"{self.seed}/{op.value}/{block}/{self.tries[op, block]}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest) < self.rate * 2**64

    def _fail(self, op, keys, result, regions):
        outcomes = list(result)
        codes = list(result.codes)
        for i, key in enumerate(keys):
            if self._fails(op, key):
                self.failed[op] += 1
                outcomes[i] = Outcome.TRANSFER_FAILED
                codes[i] = -800
                if op is Op.GET:
                    scribble(regions, i)
        return BatchResult(op, outcomes, codes)

    def get(self, keys, regions):
        result = self.store.get(keys, regions)
        return self._fail(Op.GET, keys, result, regions)

    def put(self, keys, regions):
        result = self.store.put(keys, regions)
        return self._fail(Op.PUT, keys, result, regions)


def scribble(regions, i):
    """Overwrite key `i`'s destination bytes with garbage."""
    if regions.piece_ptrs is None:
        pieces = [(regions.ptrs[i], regions.sizes[i])]
    else:
        pieces = zip(
            regions.piece_ptrs[i], regions.piece_sizes[i], strict=True
        )
    for ptr, size in pieces:
        ctypes.memset(ptr, 0x5A, size)


def pin_fillers(raw, count, nbytes):
    """Put `count` hard-pinned objects of `nbytes` (eviction skips them)."""
    pinned = pytest.importorskip("mooncake.store").ReplicateConfig()
    pinned.with_hard_pin = True
    value = bytes(nbytes)
    for i in range(count):
        rc = raw.put(f"filler-{i}-{time.monotonic_ns()}", value, pinned)
        assert rc == 0, f"filler {i}: put returned {rc}"


def count_store_full(connector):
    """Count the keys the store refused with STORE_FULL, as the stats
    the connector hands vLLM each step report them."""
    counted = {"keys": 0}
    take = connector.get_kv_connector_stats

    def counting():
        stats = take()
        if stats is not None:
            put = stats.data.get("store", {}).get("put", {})
            counted["keys"] += put.get("failures", {}).get("STORE_FULL", 0)
        return stats

    connector.get_kv_connector_stats = counting
    return counted
