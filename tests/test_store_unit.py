"""StoreClient logic against a scripted fake store (no master needed)."""

from __future__ import annotations

import threading

import pytest

from connector.config import StoreConfig
from connector.errors import RegionError, StoreClosedError
from connector.store import (
    BatchResult,
    BreakerState,
    CircuitBreaker,
    Op,
    Outcome,
    Regions,
    StoreClient,
    outcome_of_error,
)

CONFIG = StoreConfig(
    master_server_address="127.0.0.1:1",
    metadata_server="P2PHANDSHAKE",
    protocol="tcp",
    local_hostname="127.0.0.1",
    breaker_probe_ms=100,
)


class FakeStore:
    """Dict-backed store; ``health`` and ``fail_with`` script outages."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self.health = 0
        self.fail_with: int | None = None
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def setup(self, *args):
        self.calls.append("setup")
        return 0

    def get_hostname(self):
        return "127.0.0.1:12345"

    def register_buffer(self, ptr, size):
        return 0

    def unregister_buffer(self, ptr):
        return 0

    def health_check(self):
        return self.health

    def _failing(self, name, keys):
        with self.lock:
            self.calls.append(name)
        if self.fail_with is not None:
            return [self.fail_with] * len(keys)
        return None

    def batch_is_exist(self, keys):
        failed = self._failing("exists", keys)
        return failed or [int(k in self.data) for k in keys]

    def batch_put_from(self, keys, ptrs, sizes, config):
        failed = self._failing("put", keys)
        if failed:
            return failed
        for key, size in zip(keys, sizes, strict=True):
            self.data.setdefault(key, size)
        return [0] * len(keys)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
        self.calls.append("put_multi")
        return self.batch_put_from(keys, None, [sum(s) for s in sizes], None)

    def batch_get_into(self, keys, ptrs, sizes):
        failed = self._failing("get", keys)
        return failed or [self.data.get(k, -704) for k in keys]

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        self.calls.append("get_multi")
        return self.batch_get_into(keys, None, None)

    def batch_remove(self, keys, force):
        return [0 if self.data.pop(k, None) else -704 for k in keys]

    def remove_all(self, force):
        n = len(self.data)
        self.data.clear()
        return n

    def close(self):
        self.calls.append("close")
        return 0


@pytest.fixture
def fake():
    return FakeStore()


@pytest.fixture
def client(fake):
    client = StoreClient.open(CONFIG, store_factory=lambda: (fake, None))
    assert fake.calls == ["setup"]
    fake.calls.clear()
    yield client
    client.close()


def regions(n, size=64):
    return Regions.contiguous([4096 * (i + 1) for i in range(n)], [size] * n)


class TestOutcomes:
    @pytest.mark.parametrize(
        ("code", "outcome"),
        [
            (-704, Outcome.MISS),
            (-200, Outcome.STORE_FULL),
            (-800, Outcome.TRANSFER_FAILED),
            (-801, Outcome.TRANSFER_FAILED),
            (-707, Outcome.TRANSFER_FAILED),
            (-900, Outcome.MASTER_UNREACHABLE),
            (-1010, Outcome.MASTER_UNREACHABLE),
            (-901, Outcome.TIMEOUT),
            (-600, Outcome.INVALID),
            (-400, Outcome.INVALID),
            (-706, Outcome.OTHER),
            (-12345, Outcome.OTHER),
        ],
    )
    def test_code_mapping(self, code, outcome):
        assert outcome is outcome_of_error(code)

    def test_put_then_dedupe(self, client, fake):
        """New keys are STORED, then ALREADY_PRESENT without a put."""
        first = client.put(["a", "b"], regions(2))
        assert list(first) == [Outcome.STORED, Outcome.STORED]
        assert first.nbytes == 128
        fake.calls.clear()
        second = client.put(["a", "b", "c"], regions(3))
        assert list(second) == [
            Outcome.ALREADY_PRESENT,
            Outcome.ALREADY_PRESENT,
            Outcome.STORED,
        ]
        assert second.nbytes == 64
        assert fake.calls == ["exists", "put"]

    def test_duplicate_key_in_batch_written_once(self, client):
        result = client.put(["d", "d"], regions(2))
        assert list(result) == [Outcome.STORED, Outcome.ALREADY_PRESENT]

    def test_put_without_dedupe_skips_lookup(self, client, fake):
        client.put(["a"], regions(1), dedupe=False)
        assert fake.calls == ["put"]

    def test_get_hit_miss_and_short_read(self, client, fake):
        fake.data.update({"a": 64, "short": 10})
        result = client.get(["a", "zz", "short"], regions(3))
        assert list(result) == [Outcome.HIT, Outcome.MISS, Outcome.INVALID]
        assert result.codes == [64, -704, 10]
        assert result.nbytes == 64
        assert result.hit_prefix == 1
        assert (result.failures()) == [
            (1, Outcome.MISS, -704),
            (2, Outcome.INVALID, 10),
        ]

    def test_pieces_use_multi_buffer_calls(self, client, fake):
        """Non-adjacent pieces go through the *_multi_buffers calls."""
        pieces = [[(4096, 32), (8192, 32)], [(16384, 32), (20480, 32)]]
        assert client.put(["p", "q"], pieces).ok
        assert client.get(["p", "q"], pieces).ok
        assert "put_multi" in fake.calls
        assert "get_multi" in fake.calls

    def test_adjacent_pieces_coalesce(self, client, fake):
        """Adjacent pieces become one region: the contiguous call is used."""
        r = Regions.of([[(4096, 32), (4128, 32)]])
        assert r.contiguous_layout
        assert r.sizes == [64]
        assert client.put(["c"], [[(4096, 32), (4128, 32)]]).ok
        assert "put_multi" not in fake.calls

    def test_region_errors(self, client):
        with pytest.raises(RegionError):
            client.put(["a", "b"], regions(1))
        with pytest.raises(RegionError):
            client.put(["a"], [(4096, 0)])
        with pytest.raises(RegionError):
            client.get(["a"], [["nope"]])  # type: ignore[list-item]
        with pytest.raises(RegionError):
            Regions.pieces([[]], [[]])

    def test_empty_batches(self, client, fake):
        assert list(client.exists([])) == []
        assert list(client.put([], [])) == []
        assert list(client.get([], [])) == []
        assert fake.calls == []

    def test_stats(self, client, fake):
        """Stats count ops, keys, bytes, failures by outcome, latency."""
        client.put(["a"], regions(1))
        client.get(["a", "b"], regions(2))
        snap = client.stats.snapshot(reset=True)
        assert (
            snap[Op.PUT].ops,
            snap[Op.PUT].keys,
            snap[Op.PUT].bytes,
        ) == (1, 1, 64)
        assert snap[Op.GET].failures == {Outcome.MISS: 1}
        assert len(snap[Op.GET].latencies_s) == 1
        assert client.stats[Op.GET].ops == 0

    def test_closed_client_raises(self, client, fake):
        assert client.close()
        assert client.close()
        assert fake.calls.count("close") == 1
        with pytest.raises(StoreClosedError):
            client.exists(["a"])

    def test_batch_result_is_a_sequence(self):
        result = BatchResult(Op.EXISTS, [Outcome.HIT, Outcome.MISS], [1, 0])
        assert result[0] == Outcome.HIT
        assert len(result) == 2
        assert result.count(Outcome.MISS) == 1
        assert not result.ok
        assert result.succeeded == [True, False]
        assert "HIT=1" in repr(result)


class TestBreaker:
    def test_health_flag_short_circuits(self, client, fake):
        """health_check()==2 -> MASTER_UNREACHABLE, no call is made."""
        fake.health = 2
        result = client.exists(["a", "b"])
        assert list(result) == [Outcome.MASTER_UNREACHABLE] * 2
        assert result.short_circuited
        assert fake.calls == []
        assert client.breaker.state is BreakerState.OPEN
        assert client.stats.breaker_trips == 1

    def test_rpc_failure_trips_then_probe_recovers(self, client, fake):
        """One -900 opens the breaker; a probe after recovery closes it."""
        clock = [0.0]
        client.breaker._clock = lambda: clock[0]
        fake.fail_with = -900
        assert client.exists(["a"]).unavailable
        assert BreakerState.OPEN is client.breaker.state
        fake.calls.clear()
        for _ in range(5):
            assert client.put(["a"], regions(1)).short_circuited
        assert fake.calls == []
        fake.fail_with = None
        assert client.exists(["a"]).short_circuited  # before the interval
        clock[0] = 0.2
        assert list(client.exists(["a"])) == [Outcome.MISS]
        assert BreakerState.CLOSED is client.breaker.state

    def test_timeout_in_lookup_skips_the_put(self, client, fake):
        """A put whose lookup times out does not stall a second time."""
        fake.fail_with = -901
        result = client.put(["a", "b"], regions(2))
        assert list(result) == [Outcome.TIMEOUT] * 2
        assert fake.calls == ["exists"]

    def test_failed_probe_reopens(self):
        clock = [0.0]
        health = [2]
        breaker = CircuitBreaker(
            lambda: health[0], 1.0, clock=lambda: clock[0]
        )
        assert not breaker.allow()
        clock[0] = 1.5
        assert not breaker.allow()  # still unhealthy: no trial
        health[0] = 0
        assert not breaker.allow()  # probe interval restarted at 1.5
        clock[0] = 2.6
        assert breaker.allow()  # the trial
        assert BreakerState.HALF_OPEN is breaker.state
        assert not breaker.allow()  # only one trial at a time
        breaker.record(outage=True)
        assert BreakerState.OPEN is breaker.state
        clock[0] = 3.7
        assert breaker.allow()
        breaker.record(outage=False)
        assert BreakerState.CLOSED is breaker.state
        assert breaker.allow()

    def test_trial_that_raises_releases(self):
        clock = [10.0]
        breaker = CircuitBreaker(lambda: 0, 1.0, clock=lambda: clock[0])
        breaker.trip("test")
        clock[0] = 11.5
        assert breaker.allow()
        breaker.release()
        assert BreakerState.OPEN is breaker.state


def test_concurrent_calls(client, fake):
    """Many threads share one client; every key is accounted once."""
    errors: list[BaseException] = []

    def work(tid: int) -> None:
        try:
            for i in range(50):
                keys = [f"t{tid}-{i}-{j}" for j in range(4)]
                assert client.put(keys, regions(4)).ok
                assert client.get(keys, regions(4)).ok
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    snap = client.stats.snapshot()
    assert snap[Op.PUT].ops == 400
    assert snap[Op.GET].keys == 1600
    assert snap[Op.GET].bytes == 1600 * 64
