"""KV caches on a CUDA device: pinned staging and CUDA events.

Needs a CUDA device and the real `mooncake_master`; skipped with a reason
elsewhere.  The KV tensors live on the GPU, the store only ever sees the
pinned staging buffers (registered once), and the checks compare the bytes
the master holds with what kernels wrote:

* a round trip of GPU KV blocks, in both KV layouts, whose stored bytes
  equal a host copy of the blocks (so GPU and CPU instances share keys);
* a save issued right after a long kernel chain on the compute stream,
  without synchronizing: the saved bytes are what the chain wrote, not
  the zeros that were there before (the save waits on the layers' events);
* the same with layer-wise saves (each layer gathered after its own
  event, while later layers still compute);
* a load whose blocks a kernel on the compute stream reads as soon as the
  load is reported received.
"""

from __future__ import annotations

import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind, JobResult
from connector.store import Regions
from connector.worker.transfer import CudaOps, Staged
from tests.worker_helpers import (
    JobMaker,
    assert_same_blocks,
    block_parts,
    make_worker,
    settle,
    step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mooncake,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (torch.cuda.is_available() is False)",
    ),
]

NUM_BLOCKS = 32
TOKENS = 16
HEADS = 4
HEAD_DIM = 64
LAYERS = 3
LOAD, SAVE = JobKind.LOAD, JobKind.SAVE


def gpu_kv(layout="kv_first", dtype=torch.bfloat16, *, fill=True, seed=0):
    """Per-layer KV caches on the GPU, in FlashAttention's or a flat layout."""
    if layout == "kv_first":
        shape = (2, NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM)
    else:
        shape = (NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = {}
    for i in range(LAYERS):
        t = torch.zeros(shape, dtype=dtype, device="cuda")
        if fill:
            t.copy_(torch.randn(shape, generator=gen, device="cuda"))
        kv[f"model.layers.{i}.attn"] = t
    torch.cuda.synchronize()
    return kv


def pieces(kv, b):
    return block_parts(kv, b, NUM_BLOCKS)


@pytest.fixture
def make(store_client, unique, workers):
    def _make(kv, **kwargs):
        w = make_worker(store_client, unique, kv, NUM_BLOCKS, TOKENS, **kwargs)
        assert isinstance(w.transfer, Staged)
        assert all(isinstance(ops, CudaOps) for ops in w.transfer.ops)
        return workers.add(w)

    return _make


@pytest.fixture
def job(unique):
    return JobMaker(unique)


def stored_bytes(store_client, w, hashes, block_bytes):
    """Read stored objects back into a registered host buffer."""
    out = torch.zeros((len(hashes), block_bytes), dtype=torch.uint8)
    store_client.register_tensor(out)
    try:
        keys = w._keys.keys(hashes)
        regions = Regions.blocks(out.data_ptr(), block_bytes, range(len(keys)))
        result = store_client.get(keys, regions)
        assert result.ok, list(result)
    finally:
        store_client.unregister(out.untyped_storage().data_ptr())
    return out


def host_bytes(kv, b):
    """Block `b` as the store object: its pieces in layer order, as bytes."""
    parts = []
    for t in kv.values():
        halves = [t[b]] if t.shape[0] == NUM_BLOCKS else [t[0][b], t[1][b]]
        parts.extend(
            h.contiguous().cpu().view(-1).view(torch.uint8) for h in halves
        )
    return torch.cat(parts)


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first"])
def test_gpu_blocks_round_trip_through_the_master(
    make, job, store_client, layout
):
    """Save GPU blocks, load them elsewhere: equal, and host-compatible."""
    src = gpu_kv(layout, seed=1)
    dst = gpu_kv(layout, fill=False)
    saver = make(src, staging_blocks=4)  # 10 blocks: three chunks
    loader = make(dst, staging_blocks=4)
    blocks = list(range(3, 13))
    hashes = [f"rt{i}" for i in blocks]
    save = job(1, SAVE, "s", 0, blocks, hashes)
    step(saver, ConnectorMeta(step=1, jobs=(save,)))
    assert [JobResult(1, ok=1)] == settle(saver, 1)[1]
    targets = list(range(20, 30))
    step(
        loader,
        ConnectorMeta(step=1, jobs=(job(1, LOAD, "l", 0, targets, hashes),)),
    )
    recving, results, errors = settle(loader, 1)
    assert (recving, results, errors) == ([{"l"}], [JobResult(1, ok=1)], set())
    assert_same_blocks(src, blocks, dst, targets, NUM_BLOCKS)
    untouched = [b for b in range(NUM_BLOCKS) if b not in targets]
    assert all(not p.any() for b in untouched for p in pieces(dst, b)), (
        "a load wrote outside its blocks"
    )
    block_bytes = saver.transfer.block_bytes
    got = stored_bytes(store_client, saver, save.block_hashes, block_bytes)
    for row, b in zip(got, blocks, strict=True):
        assert torch.equal(row, host_bytes(src, b))


def test_save_is_ordered_after_the_layers_compute(make, job, store_client):
    """Saved bytes are what a long kernel chain wrote, not the old zeros."""
    kv = gpu_kv(fill=False)
    w = make(kv, staging_blocks=8)
    blocks = list(range(8))
    ids = torch.tensor(blocks, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    expected = {
        name: torch.randn(
            (2, len(blocks), TOKENS, HEADS, HEAD_DIM),
            generator=gen,
            device="cuda",
        ).to(torch.bfloat16)
        for name in kv
    }
    chain = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    # The forward: each layer first runs a long chain of kernels, then
    # writes its KV from a value that depends on the chain's end.  Nothing
    # below synchronizes the host with the device.
    for name, t in kv.items():
        for _ in range(12):
            chain = torch.tanh(chain @ chain)
        zero = (chain[0, 0] * 0).to(torch.bfloat16)
        for half in range(2):
            t[half].index_copy_(0, ids, expected[name][half] + zero)
        w.save_kv_layer(name)
    hashes = [f"ord{i}" for i in blocks]
    save = job(1, SAVE, "r", 0, blocks, hashes)
    step(w, ConnectorMeta(step=1, jobs=(save,)))
    assert [JobResult(1, ok=1)] == settle(w, 1, timeout=120)[1]
    got = stored_bytes(
        store_client, w, save.block_hashes, w.transfer.block_bytes
    )
    torch.cuda.synchronize()
    for row, b in zip(got, blocks, strict=True):
        assert torch.equal(row, host_bytes(kv, b)), f"block {b} saved early"
    # And the KV really holds the expected values (not zeros).
    name = next(iter(kv))
    assert torch.equal(kv[name][0][ids], expected[name][0])


def test_layerwise_save_is_ordered_after_each_layers_compute(
    make, job, store_client
):
    """Layer-wise saves: the save thread gathers each layer as soon as its
    `save_kv_layer` ran, on its side stream after that layer's event;
    the bytes are still what each layer's kernel chain wrote."""
    kv = gpu_kv(fill=False)
    w = make(kv, staging_blocks=8, layerwise_saves=True)
    assert w.layerwise_saves
    blocks = list(range(8))
    ids = torch.tensor(blocks, device="cuda")
    save = job(1, SAVE, "r", 0, blocks, [f"lw{i}" for i in blocks])
    meta = ConnectorMeta(step=1, jobs=(save,))
    chain = torch.randn(4096, 4096, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(8)
    torch.cuda.synchronize()
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    for name, t in kv.items():
        for _ in range(12):
            chain = torch.tanh(chain @ chain)
        zero = (chain[0, 0] * 0).to(torch.bfloat16)
        value = torch.randn(
            (2, len(blocks), TOKENS, HEADS, HEAD_DIM),
            generator=gen,
            device="cuda",
        ).to(torch.bfloat16)
        for half in range(2):
            t[half].index_copy_(0, ids, value[half] + zero)
        w.save_kv_layer(name, meta)
    w.wait_for_save(meta)
    assert [JobResult(1, ok=1)] == settle(w, 1, timeout=120)[1]
    got = stored_bytes(
        store_client, w, save.block_hashes, w.transfer.block_bytes
    )
    torch.cuda.synchronize()
    for row, b in zip(got, blocks, strict=True):
        assert torch.equal(row, host_bytes(kv, b)), f"block {b} saved early"
    assert all(p.any() for b in blocks for p in pieces(kv, b))


def test_load_is_visible_to_the_next_kernel(make, job, store_client):
    """Once a load is reported, a kernel on the compute stream sees it."""
    src = gpu_kv(seed=3)
    dst = gpu_kv(fill=False)
    saver = make(src)
    loader = make(dst)
    blocks = list(range(4, 12))
    hashes = [f"vis{i}" for i in blocks]
    step(
        saver,
        ConnectorMeta(step=1, jobs=(job(1, SAVE, "s", 0, blocks, hashes),)),
    )
    assert [JobResult(1, ok=1)] == settle(saver, 1)[1]
    # Keep the compute stream busy while the load runs on its side stream.
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        busy = torch.tanh(busy @ busy)
    targets = list(range(16, 24))
    step(
        loader,
        ConnectorMeta(step=1, jobs=(job(1, LOAD, "l", 0, targets, hashes),)),
    )
    recving, _, errors = settle(loader, 1, timeout=120)
    assert (recving, errors) == ([{"l"}], set())
    # The next forward: kernels on the current stream read the blocks.
    src_ids = torch.tensor(blocks, device="cuda")
    dst_ids = torch.tensor(targets, device="cuda")
    for name in dst:
        read = dst[name].index_select(1, dst_ids)
        assert torch.equal(read, src[name].index_select(1, src_ids))
