"""The connector on a dummy client, in vLLM 0.33's real scheduler.

Every instance's worker runs Mooncake's dummy client of one node-level
``mooncake_client`` (``real_client_address``): the KV caches are never
registered; every block goes through staging buffers in shared memory,
copied by the pool process. The harness checks each computed block
against recomputation after every step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from connector.ops.procs import NodePool
from connector.worker.transfer import Staged
from harness import Harness
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    prompt,
    side,
    store_extra,
)
from tests.test_faults_vllm import (
    drive,
    fault_after_first_hit,
    loads_failed,
    saves_again,
    store_prefix,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

DEAD_POOL_STALL_S = 5.0
"""Longest step with the pool process just killed (measured: a call in
flight fails at once, the next ones stall up to about 4.3 s once)."""


@pytest.fixture
def pooled(start_master, unique):
    """A private master, its node-level pool, and a harness factory whose
    instances are dummy clients of that pool."""
    master = start_master(client_ttl_s=2)
    node = NodePool.for_master(master, 64 * 1024 * 1024).start()
    extra = store_extra(
        master,
        unique,
        local_hostname="127.0.0.1",
        global_segment_size=0,
        real_client_address=node.address,
        shm_pool_size="16MiB",
        rpc_timeout_ms=1000,
        breaker_probe_ms=200,
        close_timeout_ms=3000,
        setup_retries=1,
        lookup_timeout_ms=30_000,
    )
    made = []

    def make(**kwargs):
        h = Harness(CONNECTOR, extra_config=extra, **kwargs)
        made.append(h)
        return h

    try:
        yield node, make
    finally:
        clients = {
            c._client
            for h in made
            for c in (h.scheduler_connector, h.worker_connector)
        }
        for h in reversed(made):
            h.close()
        for client in clients:
            if client is not None:
                client.close()  # the process's client cache would keep it
        node.stop()


def kv_ranges(h):
    """(start, end) of each KV tensor's memory of `h`'s worker."""
    return [
        (t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes())
        for t in h.kv_caches.values()
    ]


def test_b_loads_what_a_saved_and_no_kv_memory_is_registered(pooled):
    """A saves three prompts, B loads them: every byte checked by the
    harness; B's transfer is staged and nothing registered with the pool
    process lies in the KV cache (the pool process cannot see it)."""
    _node, make = pooled
    a = make(kv_role="kv_producer", num_blocks=40)
    for i in range(3):
        a.add_request(f"a{i}", prompt(i, 64), max_tokens=4)
    drive(a)
    b = make(kv_role="kv_consumer", num_blocks=40)
    for i in range(3):
        b.add_request(f"b{i}", [*prompt(i, 64), 1, 2, 3], max_tokens=4)
    drive(b)
    assert sum(b.external_hits.values()) == 3 * 64
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 3}
    worker = b.worker_connector.worker_side
    assert all(isinstance(lane.transfer, Staged) for lane in worker.lanes)
    registered = worker.registered
    assert registered
    for ptr in registered:
        assert not any(lo <= ptr < hi for lo, hi in kv_ranges(b))
    assert b.worker_connector._client.dummy
    assert_clean(a)
    assert_clean(b)


def test_pool_process_killed_mid_load_then_restarted(pooled):
    """SIGKILL the pool process between B's lookup and load: the loads
    fail, vLLM recomputes (the harness checks every block), every step
    stays bounded and nothing leaks; after a restart, saves land again
    through the same dummy client."""
    node, make = pooled
    store_prefix(make, 7, 64)
    b = make(num_blocks=40)
    fired = fault_after_first_hit(b, node.kill)
    for i in range(3):
        b.add_request(f"b{i}", [*prompt(7, 64), i], max_tokens=6)
    durations = drive(b)
    assert fired
    assert loads_failed(b) >= 1
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 3}
    assert max(durations) < DEAD_POOL_STALL_S
    assert_clean(b)
    assert side(b).machine.illegal_counts == {}

    node.restart()
    saves_again(b, 20.0, seed=200, pause_s=0.3)
