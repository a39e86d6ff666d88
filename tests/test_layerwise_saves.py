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

from connector.metadata import ConnectorMeta, JobKind, JobResult
from connector.worker.transfer import Direct, Staged
from tests.worker_helpers import (
    JobMaker,
    assert_stored,
    make_worker,
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


def _forward(w, kv, meta, *, pause_s=0.0, layers=range(LAYERS)):
    """The runner's hooks of one step, writing each layer's KV first."""
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    for layer in layers:
        w.wait_for_layer_load(f"l{layer}")
        time.sleep(pause_s)
        _write(kv, layer, meta.step)
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


def test_shutdown_mid_forward_fails_the_waiting_save(make, job):
    """A save waiting for a layer the forward never ends: shutdown stops
    it at once, reported failed (its blocks are unpinned)."""
    kv = _kv()
    w = make(kv)
    save = job(1, SAVE, "r", 0, [0, 1], ["a", "b"])
    meta = ConnectorMeta(step=1, jobs=(save,))
    _forward(w, kv, meta, layers=[0])
    time.sleep(0.05)
    started = time.monotonic()
    assert w.shutdown(timeout=5)
    assert time.monotonic() - started < 2
    assert w.jobs_failed[SAVE] == 1
