"""The cluster tier over HA masters and a node-level pool (issue 33).

Instance processes of `benchmarks.cluster_node` (vLLM 0.33's scheduler,
the connector's worker half) on a real etcd with two HA masters, or on a
master with the wheel's ``mooncake_client`` owning the pool; the
scenarios are `benchmarks.ha`'s. Slow (spawning instances dominates):
``KV_CLUSTER=1`` (``make cluster``) only.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("vllm")

from benchmarks import cluster as bench
from benchmarks import ha

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.mooncake,
    pytest.mark.cluster,
    pytest.mark.skipif(
        not os.environ.get("KV_CLUSTER"),
        reason="cluster tier: run with KV_CLUSTER=1 (make cluster)",
    ),
]


@pytest.fixture
def cluster(master_binary):
    with bench.cluster(4) as made:
        yield made
    for node in made.nodes:
        assert not node.alive, f"node {node.name} outlived the test"


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd")
def test_leader_sigkill_under_load(cluster):
    """The leader dies mid-run: every request finishes with correct KV,
    and the prefixes stored before the failover hit after it."""
    report, detail = ha.master_failover(
        cluster, prefixes=2, per_prefix=4, interval_s=0.05
    )
    print(report, detail)
    assert report["requests"] == 8
    assert report["requests_finished"] == 8
    assert report["mismatches"] == 0
    assert report["failover_s"] is not None
    assert report["failover_s"] < 20
    assert report["hits_after_failover"] > 0
    assert detail["baseline_hit_rate"] == 1.0


@pytest.mark.parametrize(
    ("node_pool", "mirror"),
    [(True, False), (True, True), (False, False)],
    ids=["pool", "mirror", "embedded"],
)
def test_engine_restart_keeps_its_prefixes_only_with_a_node_pool(
    cluster, node_pool, mirror
):
    """A is SIGKILLed and restarted: with the node-level pool (engines
    contributing none, or mirroring their own segment into it) its
    earlier prefixes all hit again and B hits them throughout; with A's
    own segment alone (the embedded default, the contrast) most are
    gone."""
    report = ha.engine_restart(
        cluster,
        prefixes=4,
        interval_s=0.05,
        node_pool=node_pool,
        mirror=mirror,
    )
    print(report)
    assert report["requests_finished"] == report["requests"]
    assert report["mismatches"] == 0
    assert report["hit_rate_before"] == 1.0
    if node_pool:
        assert report["hit_rate_after_restart"] == 1.0
        assert report["other_hit_rate_during"] == 1.0
    else:
        assert report["hit_rate_after_restart"] < 0.9
