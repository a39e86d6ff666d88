"""Layer-wise saves: a step's save follows its forward pass layer by layer.

A real `WorkerSide` over a real master (CPU staging runs the very gather
code CUDA runs): with layer-wise saves, the step's pinned saves start at
its first `save_kv_layer`, each layer is gathered once the forward
reports it (never before: the bytes stored are the layer's final KV) and
the put of each block's one object runs once the last layer is in,
before `wait_for_save`.  Unpinned saves, zero-copy lanes and steps whose
forward reports no layer still save in `wait_for_save`; a save waiting
for a layer ends failed at shutdown.
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind, JobResult, TransferJob
from connector.parallel import ShardKeys, TPPlan
from connector.store import Regions
from connector.worker.shards import Sharded, group_lane
from connector.worker.side import WorkerSide
from connector.worker.transfer import Direct, KVLayout, Staged
from tests.worker_helpers import (
    JobMaker,
    assert_stored,
    key_scheme,
    make_worker,
    read_back,
    settle,
)

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 8
TOKENS = 4
WIDTH = 16
LAYERS = 4
SAVE = JobKind.SAVE


def _kv() -> dict[str, torch.Tensor]:
    return {
        f"l{i}": torch.full((NUM_BLOCKS, TOKENS, WIDTH), -1.0)
        for i in range(LAYERS)
    }


def _write(kv: dict[str, torch.Tensor], layer: int, step: int) -> None:
    """The forward writes `layer`'s KV of step `step`."""
    kv[f"l{layer}"].copy_(
        torch.arange(NUM_BLOCKS * TOKENS * WIDTH, dtype=torch.float32)
        .reshape(NUM_BLOCKS, TOKENS, WIDTH)
        .add(1000.0 * layer + 100_000.0 * step)
    )


@pytest.fixture
def make(store_client, unique, workers):
    def _make(kv, *, layerwise=True, staging_blocks=4):
        return workers.add(
            make_worker(
                store_client,
                unique,
                kv,
                NUM_BLOCKS,
                TOKENS,
                staging_blocks=staging_blocks,
                layerwise_saves=layerwise,
            )
        )

    return _make


@pytest.fixture
def job(unique):
    return JobMaker(unique)


def _forward(w, kv, meta, *, pause_s=0.0, layers=range(LAYERS), write=None):
    """The runner's hooks of one step, writing each layer's KV first
    (with `write`, default `_write`)."""
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    for layer in layers:
        w.wait_for_layer_load(f"l{layer}")
        time.sleep(pause_s)
        (write or _write)(kv, layer, meta.step)
        w.save_kv_layer(f"l{layer}", meta)


def _results_before_wait_for_save(w, count, timeout=10.0):
    end = time.monotonic() + timeout
    results = []
    while len(results) < count and time.monotonic() < end:
        w.get_finished()
        report = w.build_report()
        if report:
            results.extend(report.results)
        time.sleep(0.005)
    return results


def test_a_layerwise_save_is_put_once_its_last_layer_is_in(
    make, job, store_client
):
    """Stored before `wait_for_save`, with every layer's final KV.

    Each layer is written only just before its `save_kv_layer`, with a
    pause between layers: a gather that read a layer before the forward
    reported it would store that layer's old bytes.
    """
    kv = _kv()
    w = make(kv)
    assert isinstance(w.transfer, Staged)
    save = job(1, SAVE, "r", 0, [0, 1, 2], ["a", "b", "c"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta, pause_s=0.02)
    results = _results_before_wait_for_save(w, 1)
    assert [JobResult(1, ok=1)] == results
    keys = w._keys.keys(save.block_hashes)
    assert_stored(store_client, keys, kv, [0, 1, 2], NUM_BLOCKS)
    w.wait_for_save(meta)  # queues nothing twice
    assert settle(w, 1, timeout=0.3)[1] == []
    assert w.jobs_done[SAVE] == 1


def test_without_layerwise_saves_the_save_waits_for_wait_for_save(
    make, job, store_client
):
    """Today's path: nothing is queued before the forward pass ends."""
    kv = _kv()
    w = make(kv, layerwise=False)
    save = job(1, SAVE, "r", 0, [0, 1], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta)
    assert _results_before_wait_for_save(w, 1, timeout=0.3) == []
    w.wait_for_save(meta)
    assert [JobResult(1, ok=1)] == settle(w, 1)[1]
    keys = w._keys.keys(save.block_hashes)
    assert_stored(store_client, keys, kv, [0, 1], NUM_BLOCKS)


def test_more_blocks_than_staging_and_unpinned_saves(make, job, store_client):
    """Chunks past the staging are gathered after the forward; an
    unpinned save of the same step still runs in `wait_for_save`."""
    kv = _kv()
    w = make(kv, staging_blocks=2)
    pinned = job(1, SAVE, "r", 0, [0, 1, 2, 3, 4], list("abcde"))
    unpinned = job(2, SAVE, "s", 0, [5, 6], ["f", "g"], pinned=False)
    meta = ConnectorMeta(step=1, jobs=(pinned, unpinned))
    _forward(w, kv, meta)
    w.wait_for_save(meta)
    results = sorted(settle(w, 2)[1], key=lambda r: r.job_id)
    assert [JobResult(1, ok=1), JobResult(2, ok=1)] == results
    for j in (pinned, unpinned):
        keys = w._keys.keys(j.block_hashes)
        assert_stored(store_client, keys, kv, list(j.block_ids), NUM_BLOCKS)


def test_layers_not_reported_wait_for_the_step(make, job, store_client):
    """A forward reporting only some layers (a CUDA graph reports none):
    the rest are gathered once `wait_for_save` closes the step."""
    kv = _kv()
    w = make(kv)
    save = job(1, SAVE, "r", 0, [0, 1], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta, layers=[0])
    for layer in range(1, LAYERS):
        _write(kv, layer, 1)  # written, not reported
    assert _results_before_wait_for_save(w, 1, timeout=0.3) == []
    w.wait_for_save(meta)
    assert [JobResult(1, ok=1)] == settle(w, 1)[1]
    keys = w._keys.keys(save.block_hashes)
    assert_stored(store_client, keys, kv, [0, 1], NUM_BLOCKS)


def test_zero_copy_saves_after_the_forward(make, job, store_client):
    """No staging (zero copy): layer-wise saves change nothing."""
    kv = _kv()
    w = make(kv, layerwise=False, staging_blocks=None)
    assert isinstance(w.transfer, Direct)
    w.layerwise_saves = True
    save = job(1, SAVE, "r", 0, [0], ["a"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta)
    assert _results_before_wait_for_save(w, 1, timeout=0.3) == []
    w.wait_for_save(meta)
    assert [JobResult(1, ok=1)] == settle(w, 1)[1]


# -- head-sharded lanes (``store_tp_size``) ---------------------------------

HEADS = 4
SHARDS = 2  # head shards this rank holds: one store object each


def _sharded_kv() -> dict[str, torch.Tensor]:
    """Head-major host KV: [blocks, heads, tokens, width] per layer."""
    return {
        f"l{i}": torch.full((NUM_BLOCKS, HEADS, TOKENS, WIDTH), -1.0)
        for i in range(LAYERS)
    }


def _write_heads(kv: dict[str, torch.Tensor], layer: int, step: int) -> None:
    """The forward writes `layer`'s KV of step `step`, every head its own."""
    kv[f"l{layer}"].copy_(
        torch.arange(NUM_BLOCKS * HEADS * TOKENS * WIDTH, dtype=torch.float32)
        .reshape(NUM_BLOCKS, HEADS, TOKENS, WIDTH)
        .add(1000.0 * layer + 100_000.0 * step)
    )


def _plan(*, writes: bool = True) -> TPPlan:
    """TP 1 over 4 heads stored as 2 head shards (a replica: TP 2, 1 head)."""
    if writes:
        return TPPlan(0, 1, num_kv_heads=HEADS, store_tp=SHARDS)
    return TPPlan(1, 2, num_kv_heads=1)


@pytest.fixture
def make_sharded(store_client, unique, workers):
    """A worker whose one lane is `group_lane`'s for `plan`."""

    def _make(kv, *, staging_blocks=4, writes=True):
        plan = _plan(writes=writes)
        scheme = key_scheme(unique, kv, NUM_BLOCKS, TOKENS)
        block_bytes = scheme.layout.block_bytes
        schemes = plan.schemes(scheme)
        lane = group_lane(
            kv,
            NUM_BLOCKS,
            Regions,
            register=store_client.register,
            plan=plan,
            keys=ShardKeys(schemes) if plan.shared else schemes[0],
            block_bytes=block_bytes,
            staging_blocks=staging_blocks,
        )
        return workers.add(
            WorkerSide(
                store_client,
                lane.keys,
                KVLayout.from_tensors(kv, NUM_BLOCKS),
                Regions,
                transfer=lane.transfer,
                lanes=[lane],
                layerwise_saves=staging_blocks is not None,
            )
        )

    return _make


def _sharded_forward(w, kv, meta, **kw):
    """`_forward` writing every head its own KV (`_write_heads`)."""
    _forward(w, kv, meta, write=_write_heads, **kw)


def _assert_shards_stored(client, w, job_, kv):
    """Each shard object of each block holds its head slice, every layer."""
    per_shard = HEADS // SHARDS
    keys = w.lanes[0].keys.keys(job_.block_hashes)  # shard-major
    count = len(job_.block_ids)
    for shard in range(SHARDS):
        heads = slice(shard * per_shard, (shard + 1) * per_shard)
        want = [
            torch.cat(
                [
                    t[b, heads].contiguous().view(torch.uint8).reshape(-1)
                    for t in kv.values()
                ]
            )
            for b in job_.block_ids
        ]
        shard_keys = keys[shard * count : (shard + 1) * count]
        got, rows = read_back(client, shard_keys, want[0].numel())
        assert got == [True] * count, f"shard {shard} not stored: {got}"
        for row, expected, b in zip(rows, want, job_.block_ids, strict=True):
            diff = int((row != expected).sum())
            assert diff == 0, f"shard {shard} block {b}: {diff} bytes differ"


def _save_waits(w):
    """Per head shard, the layers its save's gather has waited for."""
    return [part.ops[1].waits for part in w.lanes[0].transfer.parts]


def test_head_shards_save_layerwise_before_wait_for_save(
    make_sharded, job, store_client
):
    """Both shard objects of every block are put before `wait_for_save`,
    each layer gathered only once the forward reported it (each layer is
    written just before its report, after a pause: an early gather would
    store the old bytes), checked per shard object against its heads."""
    kv = _sharded_kv()
    w = make_sharded(kv)
    sharded = w.lanes[0].transfer
    assert isinstance(sharded, Sharded)
    assert len(sharded.parts) == SHARDS
    assert all(isinstance(p, Staged) for p in sharded.parts)
    assert sharded.waits_by_layer
    save = job(1, SAVE, "r", 0, [0, 2, 3], ["a", "b", "c"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _sharded_forward(w, kv, meta, pause_s=0.02)
    assert [JobResult(1, ok=1)] == _results_before_wait_for_save(w, 1)
    _assert_shards_stored(store_client, w, save, kv)
    w.wait_for_save(meta)  # queues nothing twice
    assert settle(w, 1, timeout=0.3)[1] == []
    assert (w.jobs_done[SAVE], w.jobs_failed[SAVE]) == (1, 0)


def test_shutdown_stops_the_shard_runner_threads(make_sharded, job):
    """The threads a side-by-side save started end at shutdown."""
    import threading  # noqa: PLC0415

    before = set(threading.enumerate())
    kv = _sharded_kv()
    w = make_sharded(kv)
    save = job(1, SAVE, "r", 0, [0, 2], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _sharded_forward(w, kv, meta)
    assert [JobResult(1, ok=1)] == _results_before_wait_for_save(w, 1)
    started = [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith("kv-lifecycle-shard")
    ]
    assert started  # the second shard saved on a runner thread
    assert w.shutdown()
    for thread in started:
        thread.join(2.0)
    assert not [t.name for t in started if t.is_alive()]


def test_every_head_shard_gathers_while_the_forward_runs(make_sharded, job):
    """Each shard's gather follows the forward layer by layer, side by
    side: before the last layer is reported, both shards gathered every
    earlier layer (one after another, the second shard would wait for
    the first's last layer), and nothing is put yet."""
    kv = _sharded_kv()
    w = make_sharded(kv)
    save = job(1, SAVE, "r", 0, [0, 1], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _sharded_forward(w, kv, meta, layers=range(LAYERS - 1))
    end = time.monotonic() + 5
    while _save_waits(w) != [LAYERS - 1] * SHARDS and time.monotonic() < end:
        time.sleep(0.005)
    assert _save_waits(w) == [LAYERS - 1] * SHARDS
    assert _results_before_wait_for_save(w, 1, timeout=0.1) == []
    _write_heads(kv, LAYERS - 1, 1)
    w.save_kv_layer(f"l{LAYERS - 1}", meta)
    assert [JobResult(1, ok=1)] == _results_before_wait_for_save(w, 1)
    assert _save_waits(w) == [LAYERS] * SHARDS
    w.wait_for_save(meta)


@pytest.mark.parametrize("layout", ["one object", "head shards"])
def test_shutdown_mid_forward_fails_the_waiting_save(layout, request, job):
    """A save waiting for a layer the forward never ends: shutdown stops
    it at once (every head shard's fence dropped), reported failed (its
    blocks are unpinned)."""
    sharded = layout == "head shards"
    kv = _sharded_kv() if sharded else _kv()
    w = request.getfixturevalue("make_sharded" if sharded else "make")(kv)
    save = job(1, SAVE, "r", 0, [0, 1], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    forward = _sharded_forward if sharded else _forward
    forward(w, kv, meta, layers=[0])
    time.sleep(0.05)
    started = time.monotonic()
    assert w.shutdown(timeout=5)
    assert time.monotonic() - started < 2
    assert w.jobs_failed[SAVE] == 1


def test_zero_copy_head_shards_save_after_the_forward(make_sharded, job):
    """Host KV without staging: shards are zero copy, the save waits for
    `wait_for_save` even with layer-wise saves on."""
    kv = _sharded_kv()
    w = make_sharded(kv, staging_blocks=None)
    assert all(isinstance(p, Direct) for p in w.lanes[0].transfer.parts)
    assert not w.lanes[0].transfer.waits_by_layer
    w.layerwise_saves = True
    save = job(1, SAVE, "r", 0, [0], ["a"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _sharded_forward(w, kv, meta)
    assert _results_before_wait_for_save(w, 1, timeout=0.3) == []
    w.wait_for_save(meta)
    assert [JobResult(1, ok=1)] == settle(w, 1)[1]


def test_a_replica_lane_is_not_staged_and_holds_nothing_back(
    make_sharded, job, store_client
):
    """A replica rank's lane puts nothing: no save staging (its host KV
    stays zero copy), and its layer-wise save ends at once, unread."""
    kv = _sharded_kv()
    w = make_sharded(kv, writes=False)
    lane = w.lanes[0]
    assert not lane.writes
    assert isinstance(lane.transfer, Direct)
    save = job(1, SAVE, "r", 0, [0], ["a"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _sharded_forward(w, kv, meta, layers=[0])
    assert [JobResult(1, ok=1)] == _results_before_wait_for_save(w, 1)
    keys = lane.keys.keys(save.block_hashes)
    assert read_back(store_client, keys, lane.block_bytes)[0] == [False]
    w.wait_for_save(meta)


# -- hybrid lanes: one per KV cache group --------------------------------

#: Group 0 holds layers 0 and 3, group 1 layers 1 and 2: group 0's last
#: layer is the forward's last, so one after another group 1's gather
#: would start only after the forward.
GROUPS = ((0, 3), (1, 2))


@pytest.fixture
def make_groups(store_client, unique, workers):
    """A worker with one staged lane per KV cache group (`GROUPS`)."""

    def _make(kv):
        lanes = []
        for g, layers in enumerate(GROUPS):
            group_kv = {f"l{i}": kv[f"l{i}"] for i in layers}
            scheme = key_scheme(
                unique, group_kv, NUM_BLOCKS, TOKENS, detail=f"g{g}"
            )
            lanes.append(
                group_lane(
                    group_kv,
                    NUM_BLOCKS,
                    Regions,
                    register=store_client.register,
                    plan=TPPlan(),
                    keys=scheme,
                    block_bytes=scheme.layout.block_bytes,
                    staging_blocks=4,
                )
            )
        return workers.add(
            WorkerSide(
                store_client,
                lanes[0].keys,
                KVLayout.from_tensors(kv, NUM_BLOCKS),
                Regions,
                transfer=lanes[0].transfer,
                lanes=lanes,
                layerwise_saves=True,
            )
        )

    return _make


def test_every_group_gathers_while_the_forward_runs(
    make_groups, unique, store_client
):
    """A hybrid save's groups follow the forward side by side: with
    every layer but the last reported (group 0's), group 1 gathered both
    of its layers and put them; one after another it would have gathered
    none.  Every group's objects hold the final KV."""
    kv = _kv()
    w = make_groups(kv)
    save = TransferJob(
        job_id=1,
        kind=SAVE,
        req_id="r",
        epoch=0,
        block_ids=(0, 2, 0, 2),
        block_hashes=tuple(f"{unique}/{h}".encode() for h in "abab"),
        pinned=True,
        group_ids=(0, 0, 1, 1),
    )
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta, layers=range(LAYERS - 1))
    gathered = [lane.transfer.ops[1] for lane in w.lanes]
    end = time.monotonic() + 5
    while gathered[1].waits < 2 and time.monotonic() < end:
        time.sleep(0.005)
    assert [ops.waits for ops in gathered] == [1, 2]
    assert _results_before_wait_for_save(w, 1, timeout=0.1) == []
    _write(kv, LAYERS - 1, 1)
    w.save_kv_layer(f"l{LAYERS - 1}", meta)
    assert [JobResult(1, ok=1)] == _results_before_wait_for_save(w, 1)
    w.wait_for_save(meta)
    for g, layers in enumerate(GROUPS):
        keys = w.lanes[g].keys.keys(list(save.block_hashes[:2]))
        want = [
            torch.cat(
                [kv[f"l{i}"][b].contiguous().view(torch.uint8).reshape(-1)
                 for i in layers]
            )
            for b in (0, 2)
        ]  # fmt: skip
        got, rows = read_back(store_client, keys, want[0].numel())
        assert got == [True, True]
        assert all(torch.equal(r, x) for r, x in zip(rows, want, strict=True))
