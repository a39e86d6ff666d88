"""A sick peer is fenced as a peer: `connector.scheduler.peers`.

Pure logic over a fake clock and a fake "where does this block live"
map, plus the real master for `StoreClient.replica_endpoints` and one
run through vLLM 0.33's scheduler.
"""

from __future__ import annotations

import pytest

from connector.scheduler.failed_keys import FailedKeys
from connector.scheduler.peers import FencedLookup, PeerFence, read_from
from connector.scheduler.side import Role, SchedulerSide


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Map:
    """block hash -> the peer its get reads; counts the calls."""

    def __init__(self, peers):
        self.peers = peers
        self.calls = 0

    def __call__(self, hashes):
        self.calls += 1
        return [(self.peers.get(h, ""),) for h in hashes]


class Inner:
    """The store lookup: every asked block is stored."""

    def hit_blocks_many(self, prefixes):
        return [len(p) for p in prefixes]


A_BLOCKS = [b"a0", b"a1", b"a2"]
B_BLOCKS = [b"b0", b"b1"]


@pytest.fixture
def where():
    return Map(
        {**dict.fromkeys(A_BLOCKS, "A:1"), **dict.fromkeys(B_BLOCKS, "B:1")}
    )


def make(clock, **kwargs):
    return PeerFence(ttl_s=kwargs.get("ttl_s", 15.0), probe_s=1.0, clock=clock)


def test_a_failed_load_fences_its_peer_for_every_block(where):
    """One failed block of A: every other block of A is cut at once,
    B's are not; the request keeps the blocks before A's."""
    clock = Clock()
    fence = make(clock)
    lookup = FencedLookup(Inner(), fence, where)
    mixed = [B_BLOCKS[0], A_BLOCKS[1], A_BLOCKS[2]]
    assert lookup.hit_blocks_many([A_BLOCKS, mixed]) == [3, 3]
    assert where.calls == 0  # no fence: no extra store call
    fence.failed([A_BLOCKS[0]])
    assert lookup.hit_blocks_many([A_BLOCKS, mixed, B_BLOCKS]) == [0, 1, 2]
    assert fence.fenced() == {"A:1"}
    stats = fence.stats()
    assert (stats.fences, stats.clipped, stats.blocks_clipped) == (1, 2, 5)


def test_a_probe_lets_one_request_through_and_success_lifts(where):
    clock = Clock()
    fence = make(clock)
    lookup = FencedLookup(Inner(), fence, where)
    fence.failed([A_BLOCKS[0]])
    assert lookup.hit_blocks_many([A_BLOCKS]) == [0]
    clock.now += 1.0  # the probe is due: one request goes through
    assert lookup.hit_blocks_many([A_BLOCKS, A_BLOCKS]) == [3, 0]
    assert lookup.hit_blocks_many([A_BLOCKS]) == [0]  # one probe per period
    fence.loaded(A_BLOCKS)  # the probe's load succeeded
    assert fence.fenced() == frozenset()
    assert lookup.hit_blocks_many([A_BLOCKS]) == [3]
    assert fence.stats().lifted == 1


def test_a_failed_probe_keeps_the_fence(where):
    clock = Clock()
    fence = make(clock)
    lookup = FencedLookup(Inner(), fence, where)
    fence.failed([A_BLOCKS[0]])
    lookup.hit_blocks_many([A_BLOCKS])
    clock.now += 1.0
    assert lookup.hit_blocks_many([A_BLOCKS]) == [3]  # the probe
    fence.failed(A_BLOCKS)
    assert lookup.hit_blocks_many([A_BLOCKS]) == [0]
    clock.now += 0.5
    assert lookup.hit_blocks_many([A_BLOCKS]) == [0]
    assert fence.stats().lifted == 0


def test_a_fence_lapses_after_its_ttl(where):
    clock = Clock()
    fence = make(clock, ttl_s=5.0)
    lookup = FencedLookup(Inner(), fence, where)
    fence.failed([A_BLOCKS[0]])
    lookup.hit_blocks_many([B_BLOCKS])  # resolves the failure
    clock.now += 5.0
    calls = where.calls
    assert lookup.hit_blocks_many([A_BLOCKS]) == [3]
    assert where.calls == calls  # nothing fenced: no extra store call
    assert fence.stats().lapsed == 1


def test_the_read_replica_follows_mooncakes_rule():
    """A local replica is read first, else the first listed; a block is
    cut when that replica's peer is fenced, though another lives."""
    assert read_from(("A:1", "B:1")) == "A:1"
    assert read_from(("A:1", "B:1"), local="B:1") == "B:1"
    assert read_from(("A:1",), local="C:1") == "A:1"
    assert read_from(()) == ""


def test_failed_keys_tell_the_fence_of_every_load():
    fence = PeerFence(ttl_s=15.0, probe_s=1.0)
    memory = FailedKeys(peers=fence)
    memory.loading([b"x", b"y"])
    memory.loaded([b"x", b"y"], [b"y"])
    assert b"y" in memory
    assert fence.busy  # the failure waits to be resolved by a lookup
    fence.resolve(lambda hashes: [("A:1",) for _ in hashes])
    assert fence.fenced() == {"A:1"}


def test_scheduler_keeps_the_failed_load_memory_it_is_given():
    """An empty memory is falsy (it has a length): still the one used."""
    memory = FailedKeys(ttl_s=3.0)
    side = SchedulerSide(
        block_size=16,
        role=Role.BOTH,
        lookup=Inner(),
        threaded_lookups=False,
        failed_keys=memory,
    )
    try:
        assert side.failed_keys is memory
    finally:
        side.close()


@pytest.mark.mooncake
def test_replica_endpoints_name_the_segment_that_holds_each_key(
    store_client, kv_blocks, unique
):
    blocks = kv_blocks(store_client, 2, 4096)
    keys = [f"{unique}/r0", f"{unique}/r1"]
    assert store_client.put(keys, blocks.regions([0, 1])).num_failed == 0
    found = store_client.replica_endpoints([*keys, f"{unique}/missing"])
    # One replica each, in some live client's segment (the session's
    # master may place it in any of them), none for a missing key.
    assert [len(f) for f in found] == [1, 1, 0]
    for (segment,) in found[:2]:
        host, _, port = segment.rpartition(":")
        assert host == "127.0.0.1"
        assert int(port) > 0
    assert store_client.replica_endpoints([]) == []


class DeadPeerStore:
    """Gets of A's keys fail (TRANSFER_FAILED), B's succeed; counts gets."""

    hostname = "B:1"

    def __init__(self):
        self.got = []

    def replica_endpoints(self, keys):
        return [("A:1",) if k.startswith("a") else ("B:1",) for k in keys]

    def get(self, keys, regions):
        from connector.store import BatchResult, Op, Outcome  # noqa: PLC0415

        self.got.append(list(keys))
        outcomes = [
            Outcome.TRANSFER_FAILED if k.startswith("a") else Outcome.HIT
            for k in keys
        ]
        return BatchResult(Op.GET, outcomes, [0] * len(keys))

    def put(self, keys, regions):
        return None


def test_worker_skips_a_peer_whose_get_just_failed():
    """After one failed get from A, the next gets of A's keys fail at
    once without a transfer; B's keys are still fetched; after `hold_s`
    A is tried again."""
    from connector.store import Regions  # noqa: PLC0415
    from connector.worker.sick import SickPeerStore  # noqa: PLC0415

    clock = Clock()
    dead = DeadPeerStore()
    store = SickPeerStore(dead, hold_s=1.0, clock=clock)
    regions = Regions.blocks(4096, 64, [0, 1, 2])
    assert store.get(["a0", "b0"], regions.select([0, 1])).succeeded == [
        False,
        True,
    ]
    assert store.sick() == {"A:1"}
    got = store.get(["a1", "b1", "a2"], regions)
    assert got.succeeded == [False, True, False]
    assert dead.got[-1] == ["b1"]  # A's keys skipped, no transfer
    assert store.skipped == 2
    clock.now += 1.0
    store.get(["a1"], regions.select([0]))
    assert dead.got[-1] == ["a1"]  # tried again after hold_s


class ReplicatedStore(DeadPeerStore):
    """A's keys also live in C: a get's retry and `read_replicas` read C.

    A get of A's keys fails on A and is retried on C (unless C is in
    `avoid`), reporting A in `failed_segments`, like `StoreClient.get`.
    """

    def __init__(self):
        super().__init__()
        self.avoided = []
        self.read = []

    def replica_endpoints(self, keys):
        return [
            ("A:1", "C:1") if k.startswith("a") else ("B:1",) for k in keys
        ]

    def get(self, keys, regions, *, avoid=()):
        from connector.store import BatchResult, Op, Outcome  # noqa: PLC0415

        self.got.append(list(keys))
        self.avoided.append(set(avoid))
        retry = "C:1" not in avoid
        outcomes = [
            Outcome.HIT
            if not k.startswith("a") or retry
            else Outcome.TRANSFER_FAILED
            for k in keys
        ]
        failed_on = (
            frozenset({"A:1"})
            if any(k.startswith("a") for k in keys)
            else frozenset()
        )
        return BatchResult(
            Op.GET, outcomes, [0] * len(keys), failed_segments=failed_on
        )

    def read_replicas(self, keys, regions, *, avoid=()):
        from connector.store import BatchResult, Op, Outcome  # noqa: PLC0415

        assert len(regions) == len(keys)
        self.read.append((list(keys), set(avoid)))
        ok = "C:1" not in avoid
        outcome = Outcome.HIT if ok else Outcome.TRANSFER_FAILED
        return BatchResult(
            Op.REPLICA_GET, [outcome] * len(keys), [0] * len(keys)
        )


def test_a_sick_peers_keys_are_read_from_another_replica():
    """A get whose first try failed on A, served by a retry on C, still
    fences A; later gets read A's keys from C without touching A, and
    never from a fenced peer."""
    from connector.store import Regions  # noqa: PLC0415
    from connector.worker.sick import SickPeerStore  # noqa: PLC0415

    clock = Clock()
    replicated = ReplicatedStore()
    store = SickPeerStore(replicated, hold_s=1.0, clock=clock)
    regions = Regions.blocks(4096, 64, [0, 1, 2])
    first = store.get(["a0", "b0"], regions.select([0, 1]))
    assert first.succeeded == [True, True]
    assert store.sick() == {"A:1"}  # learned from `failed_segments`
    got = store.get(["a1", "b1", "a2"], regions)
    assert got.succeeded == [True, True, True]
    assert replicated.got[-1] == ["b1"]  # no get of A's keys
    assert replicated.avoided[-1] == {"A:1"}
    assert replicated.read == [(["a1", "a2"], {"A:1"})]
    assert store.skipped == 2
