"""Two processes share one master: each reads what the other wrote."""

from __future__ import annotations

import multiprocessing
import os

import attrs
import pytest
import torch

from connector.store import Regions
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = pytest.mark.mooncake

BLOCK = 512 * 1024
N = 6


def expected_block(index: int) -> torch.Tensor:
    """Deterministic content, computable in either process."""
    gen = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=gen)


def keys_for(namespace: str, role: str) -> list[str]:
    return KeyScheme(
        namespace=namespace,
        model=f"mp-{role}",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, BLOCK),
    ).keys(range(N))


def child(config, namespace: str, queue) -> None:
    """Spawned: load the parent's blocks, then save blocks of its own."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    from connector.store import StoreClient  # noqa: PLC0415

    report: dict[str, object] = {}
    try:
        with StoreClient.open(config) as client:
            buf = torch.zeros((N, BLOCK), dtype=torch.uint8)
            client.register_tensor(buf)
            regions = Regions.blocks(buf.data_ptr(), BLOCK, range(N))
            got = client.get(keys_for(namespace, "parent"), regions)
            report["get"] = [o.name for o in got]
            report["equal"] = all(
                torch.equal(buf[i], expected_block(i)) for i in range(N)
            )
            mine = torch.stack([expected_block(100 + i) for i in range(N)])
            client.register_tensor(mine)
            put = client.put(
                keys_for(namespace, "child"),
                Regions.blocks(mine.data_ptr(), BLOCK, range(N)),
            )
            report["put"] = [o.name for o in put]
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        report["error"] = repr(exc)
    queue.put(report)


def test_two_processes_share_blocks(store_client, store_config, unique):
    """A spawned pure client loads our blocks; we load the blocks it saved."""
    namespace = f"mp-{unique}"
    src = torch.stack([expected_block(i) for i in range(N)])
    out = torch.zeros((N, BLOCK), dtype=torch.uint8)
    store_client.register_tensor(src)
    store_client.register_tensor(out)
    try:
        run_pair(store_client, store_config, namespace, src, out)
    finally:
        store_client.unregister(src.data_ptr())
        store_client.unregister(out.data_ptr())


def run_pair(store_client, store_config, namespace, src, out):
    parent_keys = keys_for(namespace, "parent")
    regions = Regions.blocks(src.data_ptr(), BLOCK, range(N))
    assert store_client.put(parent_keys, regions).ok

    # The child contributes no segment: its puts land in ours, so the data
    # outlives it. Never fork a process that holds a store: use spawn.
    config = attrs.evolve(store_config, global_segment_size=0)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(config, namespace, queue))
    proc.start()
    try:
        report = queue.get(timeout=60)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert proc.exitcode == 0
    assert "error" not in report, report
    assert report["get"] == ["HIT"] * N
    assert report["equal"] is True
    assert report["put"] == ["STORED"] * N

    got = store_client.get(
        keys_for(namespace, "child"),
        Regions.blocks(out.data_ptr(), BLOCK, range(N)),
    )
    assert got.ok, got
    for i in range(N):
        assert torch.equal(expected_block(100 + i), out[i])
