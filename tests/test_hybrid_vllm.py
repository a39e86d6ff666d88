"""Hybrid models: the connector under vLLM 0.33's hybrid KV cache manager.

Every scenario runs `harness.hybrid.HybridHarness`: vLLM's real
Scheduler over a full-attention group and a sliding-window group (one
block pool, different block counts per request: the window frees its old
blocks), with `connector.MooncakeLifecycleConnector` over a real master.
After every step the harness checks every computed block of every group,
and at the end that every block is free; each test also checks the
lifecycle is clean.  `pytest -k hybrid` selects them.
"""

from __future__ import annotations

import collections
import copy
import logging

import pytest

pytest.importorskip("vllm")

from connector.groups import GroupKind
from connector.metadata import JobKind
from harness.hybrid import HybridHarness
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    early_saves,
    fail_every_get,
    prompt,
    run,
    side,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BS = 16
WINDOW = 40  # 3 blocks at a prefix boundary: ceil(39 / 16)


@pytest.fixture
def make(extra, harnesses):
    def _make(**kwargs):
        kwargs.setdefault("num_blocks", 64)
        kwargs.setdefault("sliding_window", WINDOW)
        h = HybridHarness(CONNECTOR, extra_config=extra, **kwargs)
        harnesses.append(h)
        return tally(h)

    return _make


def worker(h):
    return h.worker_connector.worker_side


def tally(h):
    """Keep every per-group count the worker's stats hand out."""
    w = worker(h)
    take = w.take_moved
    w.totals = collections.Counter()

    def take_and_tally():
        moved = take()
        w.totals.update(moved)
        return moved

    w.take_moved = take_and_tally
    for conn in (h.scheduler_connector, h.worker_connector):
        conn.stats_seen = []
        real = conn.get_kv_connector_stats

        def get(real=real, conn=conn):
            stats = real()
            if stats is not None:
                conn.stats_seen.append(copy.deepcopy(stats.data["groups"]))
            return stats

        conn.get_kv_connector_stats = get
    return h


def group_stats(h):
    """The ``groups`` payloads both halves handed vLLM, summed."""
    total = collections.defaultdict(collections.Counter)
    for conn in (h.scheduler_connector, h.worker_connector):
        conn.get_kv_connector_stats()
        for groups in conn.stats_seen:
            for g, counts in groups.items():
                total[g].update(counts)
    return total


def moved(h, kind):
    """Blocks the worker moved so far, by group."""
    worker(h).take_moved()
    return {
        g: n
        for (k, g, unit), n in worker(h).totals.items()
        if k == kind and unit == "blocks"
    }


def produce(make, seeds, length, **kwargs):
    a = make(kv_role="kv_producer", **kwargs)
    for s in seeds:
        a.add_request(f"a{s}", prompt(s, length), max_tokens=3)
    run(a)
    assert_clean(a)
    return a


def test_hybrid_groups_are_read_from_vllm(make):
    """The connector sees vLLM's two groups: full attention, window 3 blocks;
    vLLM's scheduler runs its HybridKVCacheCoordinator."""
    h = make()
    groups = side(h).groups.groups
    assert [g.kind for g in groups] == [GroupKind.FULL, GroupKind.SLIDING]
    assert groups[1].window_blocks == 3
    coordinator = h.scheduler.kv_cache_manager.coordinator
    assert type(coordinator).__name__ == "HybridKVCacheCoordinator"
    assert len(worker(h).lanes) == 2


def test_hybrid_producer_consumer_prefix_sharing(make):
    """B loads what A saved, in both groups; the sliding-window group stores
    and loads only windows at prefix boundaries; bytes checked each step."""
    a = produce(make, [1, 2], 128)
    saved = moved(a, "save")
    # full: 8 blocks per prompt; window: <= 3 blocks per save boundary
    assert saved[0] == 2 * 8
    assert 0 < saved[1] < saved[0]
    b = make(kv_role="kv_consumer")
    for s in (1, 2):
        b.add_request(f"b{s}", [*prompt(s, 128), 7, 8], max_tokens=4)
    run(b)
    assert sum(b.external_hits.values()) == 2 * 128
    loaded = moved(b, "load")
    assert loaded == {0: 2 * 8, 1: 2 * 3}  # the window at the hit only
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 2}
    stats = group_stats(b)  # what vLLM's stats path received
    assert stats["g0"]["hit_blocks"] == 16
    assert stats["g1"]["hit_blocks"] == 6
    assert stats["g1"]["load_blocks"] == 6
    assert stats["g1"]["load_bytes"] == 6 * worker(b).lanes[1].block_bytes
    assert stats["g0"]["load_bytes"] == 16 * worker(b).lanes[0].block_bytes
    assert_clean(b)


def test_hybrid_groups_save_layer_by_layer(make, extra, harnesses):
    """``layerwise_save_blocks`` on a hybrid model (host caches staged):
    every save is queued at its step's first ``save_kv_layer``, each
    group's lane gathering its layers as the forward reports them; B
    loads both groups, bytes checked each step."""
    a = HybridHarness(
        CONNECTOR,
        extra_config={**extra, "layerwise_save_blocks": 8},
        num_blocks=64,
        sliding_window=WINDOW,
        kv_role="kv_producer",
    )
    harnesses.append(a)
    w = worker(a)
    assert all(lane.transfer.waits_by_layer for lane in w.lanes)
    early = early_saves(w)
    for s in (3, 4):
        a.add_request(f"a{s}", prompt(s, 128), max_tokens=3)
    run(a)
    assert sum(early) == w.jobs_done[JobKind.SAVE] >= 2
    assert w.jobs_failed[JobKind.SAVE] == 0
    assert_clean(a)
    b = make(kv_role="kv_consumer")
    for s in (3, 4):
        b.add_request(f"b{s}", [*prompt(s, 128), 7, 8], max_tokens=4)
    run(b)
    assert sum(b.external_hits.values()) == 2 * 128
    assert_clean(b)


def test_hybrid_partial_window_limits_the_hit(make):
    """A prefix whose window blocks are missing at the full-attention
    boundary hits only as far as a boundary whose window is stored."""
    a = produce(make, [3], 128)
    del a
    b = make(kv_role="kv_consumer")
    # diverges inside block 5: full attention could serve 5 blocks, but
    # the window is stored only at the save boundaries (4 and 8 blocks)
    tokens = prompt(3, 128)
    tokens[5 * BS + 3] = 499
    b.add_request("b", tokens, max_tokens=2)
    run(b)
    assert b.external_hits["b"] == 4 * BS
    assert_clean(b)


def test_hybrid_full_hit(make):
    """The whole prompt is stored: all but the last token is loaded (vLLM
    recomputes one), both groups checked."""
    produce(make, [4], 129)
    b = make(kv_role="kv_consumer")
    b.add_request("b", prompt(4, 129), max_tokens=4)
    run(b)
    assert b.external_hits["b"] == 128
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def test_hybrid_preemption_and_resume(make):
    """Requests contend for blocks of both groups: preempted, resumed,
    finished; saves pin their (group, block) pairs; nothing leaks."""
    h = make(num_blocks=20)
    for i in range(4):
        h.add_request(f"r{i}", prompt(10 + i, 60), max_tokens=40)
    run(h)
    assert h.num_preemptions >= 1
    assert h.resumed
    assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
    assert_clean(h)


def test_hybrid_abort_during_load(make):
    """Aborted while its KV arrives in both groups: one receive completion,
    no leak, exactly one finish."""
    produce(make, [5], 128)
    b = make()
    b.add_request("b", [*prompt(5, 128), 9], max_tokens=8)
    b.step()  # the lookup runs off the scheduler thread
    tracker = side(b).registry.get("b")
    assert tracker is not None
    b.step()
    assert tracker.state.name == "LOADING"
    assert len(tracker.group_block_ids) == 1  # one table per extra group
    b.abort("b")
    assert tracker.state.name == "DRAINING"
    run(b, max_steps=100_000)  # bounded by run's deadline; loads may lag
    assert b.finished_by_status() == {"FINISHED_ABORTED": 1}
    assert tracker.state.name == "ABORTED"
    assert_clean(b)


def test_hybrid_load_failure_becomes_recompute(make):
    """A failed load of both groups is reported once and recomputed; the
    harness proves no group serves bad KV."""
    produce(make, [6], 128)
    b = make()
    w = fail_every_get(worker(b))
    b.add_request("b", [*prompt(6, 128), 3], max_tokens=6)
    run(b)
    assert sum(w.jobs_failed.values()) == 1
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


@pytest.mark.parametrize("model_runner", ["v1", "v2"])
def test_hybrid_finish_all_groups_called_once(make, model_runner):
    """vLLM calls `request_finished_all_groups` (never `request_finished`)
    once per request, in any state; it never delays freeing."""
    h = make(num_blocks=20, model_runner=model_runner)
    conn = h.scheduler_connector
    calls, outside = [], []
    real_all = conn.request_finished_all_groups
    real_one = conn.request_finished

    def spy(request, block_ids):
        calls.append((request.request_id, len(block_ids)))
        conn.inside = True
        try:
            result = real_all(request, block_ids)
        finally:
            conn.inside = False
        assert result == (False, None)
        return result

    def one(request, block_ids):
        if not getattr(conn, "inside", False):
            outside.append(request.request_id)  # vLLM must not call it
        return real_one(request, block_ids)

    conn.request_finished_all_groups = spy
    conn.request_finished = one
    for i in range(3):
        h.add_request(f"r{i}", prompt(20 + i, 60), max_tokens=30)
    for _ in range(3):
        h.step()
    h.abort("r1")
    run(h)
    assert sorted(calls) == [("r0", 2), ("r1", 2), ("r2", 2)]
    assert outside == []
    assert_clean(h)


def test_hybrid_supports_hma_in_vllm(caplog):
    """vLLM 0.33 sees SupportsHMA and does not turn HMA off for us."""
    from vllm.config import (  # noqa: PLC0415
        DeviceConfig,
        KVTransferConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
        KVConnectorFactory,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        supports_hma,
    )

    from connector.integration.vllm_connector import (  # noqa: PLC0415
        MooncakeLifecycleConnector,
    )

    assert supports_hma(MooncakeLifecycleConnector)
    warning = "Turning off hybrid kv cache manager"

    def warned(transfer):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            config = VllmConfig(
                kv_transfer_config=transfer, device_config=DeviceConfig("cpu")
            )
        assert KVConnectorFactory.supports_hma_config(transfer) == (
            warning not in caplog.text
        )
        return warning in caplog.text, config

    ours = KVTransferConfig(
        kv_connector="MooncakeLifecycleConnector",
        kv_connector_module_path="connector.integration.vllm_connector",
        kv_role="kv_both",
    )
    assert warned(ours)[0] is False
    # the control: a connector without SupportsHMA makes vLLM warn
    control = KVTransferConfig(
        kv_connector="ReferenceConnector",
        kv_connector_module_path="tests.reference_connectors",
        kv_role="kv_both",
    )
    assert warned(control)[0] is True
