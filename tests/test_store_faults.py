"""Master failures: typed outcomes within bounds, then recovery."""

from __future__ import annotations

import threading
import time

import attrs
import pytest
import torch

from benchmarks.blackhole import Blackhole
from connector.config import MiB
from connector.errors import StoreUnavailable
from connector.ops.master import store_config_for
from connector.store import (
    DEAD_MASTER_STALL_S,
    BreakerState,
    Outcome,
    StoreClient,
)
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = pytest.mark.mooncake

BLOCK = 256 * 1024
RPC_TIMEOUT_MS = 1000
SLACK_S = 1.0
FAST_S = 0.25  # a short-circuited call; generous for a loaded machine
OUTAGE = {Outcome.MASTER_UNREACHABLE, Outcome.TIMEOUT}
SUCCESS = {Outcome.HIT, Outcome.STORED, Outcome.ALREADY_PRESENT}


def eight_keys(namespace: str) -> list[str]:
    """The keys of blocks 0..7 of one `BLOCK`-byte layout."""
    return KeyScheme(
        namespace=namespace,
        model="m",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, BLOCK),
    ).keys(range(8))


@pytest.fixture
def fault_env(start_master, kv_blocks):
    """A private master and client (64 MiB), with 8 stored blocks."""
    master = start_master(lease_ttl_ms=500)
    config = store_config_for(
        master,
        global_segment_size=64 * MiB,
        rpc_timeout_ms=RPC_TIMEOUT_MS,
        breaker_probe_ms=200,
        close_timeout_ms=4000,
    )
    client = StoreClient.open(config)
    src = kv_blocks(client, 8, BLOCK, seed=99)
    keys = eight_keys("faults")
    assert client.put(keys, src.regions(range(8))).ok
    yield master, client, src, keys
    client.close()


def timed(fn, *args):
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


def wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def expect_silent_master_outage(client, keys, out):
    """A master that answers nothing (hung or partitioned): each lookup
    ends within the RPC bound, at most one stalls, then the breaker
    answers every call at once."""
    bound = RPC_TIMEOUT_MS / 1000 + SLACK_S
    slow = 0
    for _ in range(30):
        result, elapsed = timed(client.exists, keys)
        assert elapsed < bound, f"{elapsed:.2f} s > {bound} s"
        slow += elapsed > 0.5
        if set(result) <= OUTAGE:
            break
    assert set(result) <= OUTAGE, list(result)
    assert slow <= 1, "a silent master must cost at most one stall"
    result, elapsed = timed(client.get, keys, out.regions(range(8)))
    assert elapsed < FAST_S, f"{elapsed:.3f} s"
    assert {Outcome.MASTER_UNREACHABLE} == set(result)


def expect_served_again(client, keys, src, out, *, timeout_s, since):
    """Within `timeout_s` of `since`, the eight keys are seen again and a
    get returns exactly the bytes that were stored (nothing was lost)."""
    hit = wait_for(lambda: client.exists(keys).ok, timeout_s=timeout_s)
    assert hit, f"keys not visible within {timeout_s:g} s of {since}"
    got = client.get(keys, out.regions(range(8)))
    assert list(got) == [Outcome.HIT] * 8
    assert torch.equal(src.tensor, out.tensor)


def test_killed_master_then_restart(fault_env, kv_blocks):
    """SIGKILL mid-run: MASTER_UNREACHABLE within the stall bound, no
    hang, and recovery after a restart on the same ports (keys are gone).
    """
    master, client, src, keys = fault_env
    # Registering memory needs the metadata server, which
    # lives in the master: allocate destinations before the fault.
    out = kv_blocks(client, 8, BLOCK)
    scratch = kv_blocks(client, 8, BLOCK)
    rpc_address = master.rpc_address

    # A transfer thread keeps loading and saving while the master dies.
    calls: list[tuple[float, frozenset[Outcome], bool]] = []
    stop = threading.Event()

    def transfers() -> None:
        serial = 0
        while not stop.is_set():
            serial += 1
            # Eight sets of keys in turn: a fast loop never fills the
            # 64 MiB segment (a full store is not what this test is about).
            more = [f"{k}/run{serial % 8}" for k in keys[:4]]
            for call, args in (
                (client.get, (keys, scratch.regions(range(8)))),
                (client.put, (more, src.regions(range(4)))),
            ):
                result, elapsed = timed(call, *args)
                calls.append(
                    (elapsed, frozenset(result), result.short_circuited)
                )

    worker = threading.Thread(target=transfers, daemon=True)
    worker.start()
    assert wait_for(lambda: len(calls) >= 10, timeout_s=5.0)
    assert all(outcomes <= SUCCESS for _, outcomes, _ in calls)
    before = len(calls)
    master.kill()

    bound = DEAD_MASTER_STALL_S + SLACK_S
    assert wait_for(
        lambda: any(short for _, _, short in calls[before:]),
        timeout_s=bound + 1,
    ), "the breaker did not open"
    stop.set()
    worker.join(timeout=bound)
    assert not worker.is_alive(), "a transfer call hung"
    after = calls[before:]
    assert max(elapsed for elapsed, _, _ in after) < bound
    assert sum(elapsed > 0.5 for elapsed, _, _ in after) <= 1, (
        "a dead master must cost at most one stall"
    )
    failures = set().union(*(o for _, o, _ in after)) - SUCCESS
    assert failures <= OUTAGE, failures
    assert Outcome.MASTER_UNREACHABLE in failures

    # Every further call is answered at once, puts and gets included.
    for call in (
        lambda: client.exists(keys),
        lambda: client.put(keys, src.regions(range(8))),
        lambda: client.get(keys, out.regions(range(8))),
    ):
        result, elapsed = timed(call)
        assert elapsed < FAST_S, f"{elapsed:.3f} s"
        assert {Outcome.MASTER_UNREACHABLE} == set(result)
        assert result.short_circuited
    assert BreakerState.OPEN is client.breaker.state
    assert client.stats.breaker_trips >= 1

    master.restart()
    assert rpc_address == master.rpc_address
    # The client re-mounts by itself; the breaker half-opens and closes.
    fresh = keys[:4]
    put = wait_for(
        lambda: client.put(fresh, src.regions(range(4))).ok, timeout_s=8.0
    )
    assert put, "no successful put within 8 s of the restart"
    assert client.breaker.state is BreakerState.CLOSED
    lookup = client.exists(keys)
    assert list(lookup) == [Outcome.HIT] * 4 + [Outcome.MISS] * 4
    got = client.get(fresh, out.regions(range(4)))
    assert got.ok
    assert torch.equal(src.tensor[:4], out.tensor[:4])


def test_paused_master_then_resume(fault_env, kv_blocks):
    """SIGSTOP: TIMEOUT/UNREACHABLE within the RPC bound; data intact
    after SIGCONT.
    """
    master, client, src, keys = fault_env
    out = kv_blocks(client, 8, BLOCK)
    master.pause()

    expect_silent_master_outage(client, keys, out)

    master.resume()
    expect_served_again(client, keys, src, out, timeout_s=5.0, since="SIGCONT")


def test_open_against_dead_master_fails_fast(start_master):
    """open() raises StoreUnavailable naming the address, quickly."""
    master = start_master()
    config = store_config_for(master, global_segment_size=16 * MiB)
    master.stop()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        StoreClient.open(config)
    assert time.monotonic() - started < 3.0
    assert config.master_server_address == info.value.address
    assert "connect" in info.value.reason


def test_blackholed_master_then_restored(start_master, kv_blocks):
    """A partition (nothing passes, nothing refused): each call ends
    within the RPC bound, the breaker opens and answers at once; after
    the partition heals the same keys are served, data intact.
    """
    master = start_master(lease_ttl_ms=500)
    with Blackhole(master.rpc_address) as hole:
        config = attrs.evolve(
            store_config_for(
                master,
                global_segment_size=64 * MiB,
                rpc_timeout_ms=RPC_TIMEOUT_MS,
                breaker_probe_ms=200,
                close_timeout_ms=4000,
            ),
            master_server_address=hole.address,
        )
        client = StoreClient.open(config)
        try:
            src = kv_blocks(client, 8, BLOCK, seed=7)
            out = kv_blocks(client, 8, BLOCK)
            keys = eight_keys("blackhole")
            assert client.put(keys, src.regions(range(8))).ok
            hole.drop()

            expect_silent_master_outage(client, keys, out)
            assert client.breaker.state is BreakerState.OPEN

            hole.restore()
            expect_served_again(
                client,
                keys,
                src,
                out,
                timeout_s=8.0,
                since="the partition healing",
            )
        finally:
            client.close()
