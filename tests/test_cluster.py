"""The cluster tier: instances in their own processes share, die, fill up.

Each instance is a process of `benchmarks.cluster_node` (vLLM 0.33's real
scheduler, the connector's worker half and its own store segment in the
same process); the scenarios are `benchmarks.cluster`'s.  Every node and
master is stopped at the end of each test, killed if need be.

`test_peer_death_and_restart` is the fast subset `make test` runs; the
others run with ``KV_CLUSTER=1`` (``make cluster``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from benchmarks import cluster as bench

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.cluster]

full_tier = pytest.mark.skipif(
    not os.environ.get("KV_CLUSTER"),
    reason="cluster tier: run with KV_CLUSTER=1 (make cluster)",
)
CLIENT_TTL_S = 4


@pytest.fixture
def cluster(master_binary):
    with bench.cluster(CLIENT_TTL_S) as made:
        yield made
    for node in made.nodes:
        assert not node.alive, f"node {node.name} outlived the test"
    for master in made.masters:
        assert not master.running


def test_peer_death_and_restart(cluster):
    """A dies mid-run: survivors finish with correct KV, one failed load
    per dead prefix each; a restarted A shares both ways, nothing stale.
    """
    death, restart, detail = bench.peer_death_and_restart(
        cluster, prefixes=2, per_prefix=4, interval_s=0.02
    )
    print(death, restart, detail)
    assert death["requests"] == 16
    assert death["requests_finished"] == 16
    assert death["mismatches"] == 0
    assert death["failed_loads"] >= death["dead_prefixes"]  # it did die
    assert death["failed_loads_per_dead_prefix_max"] <= 1
    pd = detail["peer_death"]
    assert pd["baseline_loads_ok"] == pd["baseline_requests"]
    assert pd["baseline_loads_failed"] == 0
    for stats in pd["survivor_stats"]:
        assert stats["illegal"] == 0
        assert stats["open_jobs"] == 0
        assert stats["trackers"] == 0
        assert stats["log_records"].get("ERROR", 0) == 0
    assert restart["hits_both_directions"] is True
    rs = detail["restart"]
    assert rs["finished"] == rs["requests"]
    assert rs["stale_failed_loads"] == 0  # the master forgot the dead keys


@full_tier
def test_replica2_serves_the_surviving_replica(cluster):
    """replica_num = 2: the surviving replica serves every load, before
    and after the master dropped the dead segment.

    Until then a get may pick the dead owner's replica (-800); the store
    client then reads the key from the live replica itself (raw read on
    its own transfer engine), so no load fails.
    """
    death, _, _ = bench.peer_death_and_restart(
        cluster, prefixes=1, per_prefix=1, interval_s=0.02
    )
    assert death["mismatches"] == 0
    b, c = cluster.nodes[1], cluster.nodes[2]
    result, detail = bench.replica2(cluster, b, c, prefixes=2, per_prefix=2)
    print(result, detail)
    assert detail["mismatches"] == 0
    assert detail["finished"] == detail["requests"] == 12
    assert result["hits_after_death"] > 0
    assert result["loads_failed_after_death"] == 0
    assert detail["hits_after_client_ttl"] > 0
    assert detail["loads_failed_after_client_ttl"] == 0


@full_tier
def test_store_full_is_back_pressure(cluster):
    """Saves far beyond the pool: -200 counted, evicted keys recompute."""
    nodes = cluster.spawn("F1", "F2", "F3")
    result, detail = bench.store_full(cluster, nodes, per_node=30, shared=3)
    print(result, detail)
    assert result["requests_finished"] == result["requests"]
    assert result["mismatches"] == 0
    assert detail["put_keys_over_capacity"] >= 2
    # The oldest saves were evicted (their lookups miss: recompute); the
    # shared prefixes, leased by every lookup, mostly survive.
    assert (
        detail["replayed_oldest_blocks_hit"] < detail["replayed_oldest_blocks"]
    )
    assert result["hit_rate"] > 0
    for failures in detail["save_failures"]:
        assert set(failures) <= {"STORE_FULL", "TRANSFER_FAILED"}
    for records in detail["log_records"]:
        assert records.get("ERROR", 0) == 0


@full_tier
def test_hung_peer_costs_one_deadline_not_a_stall(cluster):
    """The only copy lives in a peer that hangs: every request finishes
    with the right KV (checked every step) within about the deadline;
    after SIGCONT the same prefixes are served right again.
    """
    owner, reader = cluster.spawn("H", "R")
    result, detail = bench.hung_peer(
        cluster, owner, reader, prefixes=2, per_prefix=4, interval_s=0.02
    )
    print(result, detail)
    assert result["requests"] == result["requests_finished"] == 10
    assert result["mismatches"] == 0
    assert result["loads_failed"] >= 1  # the peer did hang
    # The default deadline (2 s) plus steps and recompute, never the
    # transport's 30-60 s.
    assert result["ttft_ms_p99"] <= 2500
    assert result["stalled_run_s"] <= 5
    assert detail["peers"]["fences"] >= 1
    assert detail["illegal"] == detail["open_jobs"] == detail["trackers"] == 0


def test_store_full_with_the_ssd_tier_serves_evicted_blocks(cluster, tmp_path):
    """The same load on a master with Mooncake's SSD tier: the oldest
    prompts, evicted from DRAM, are served again from disk."""
    nodes = cluster.spawn("S1", "S2", "S3")
    result, detail = bench.store_full(
        cluster, nodes, per_node=16, shared=3, ssd_root=tmp_path
    )
    print(result, detail)
    assert result["requests_finished"] == result["requests"]
    assert result["mismatches"] == 0
    assert detail["put_keys_over_capacity"] >= 1.5
    # Without the tier only the leased shared prefixes (2 of 16 blocks per
    # prompt) survive: a replay hit rate of about 0.125.
    assert result["replay_hit_rate"] > 0.5
    assert any(p.is_file() for p in tmp_path.rglob("*"))
