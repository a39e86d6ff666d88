"""Mooncake's SSD tier under the connector's store client, on a real master.

A master started with ``--enable_offload=true`` and ``--root_fs_dir=DIR``
writes every stored object to ``DIR`` as well; once DRAM is full it drops
the memory copy of old objects and keeps the disk copy, which a get still
serves.  Without the tier the same load keeps only what fits in DRAM.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from connector.ops.master import EmbeddedMaster, store_config_for
from connector.store import StoreClient

pytestmark = [pytest.mark.mooncake, pytest.mark.slow]

BLOCK = 1 << 20
SEGMENT = 32 << 20
N = 64  # twice the segment
PUT_GAP_S = 0.1  # lets the master offload and evict between puts


def fill(master, tmp_path):
    """Put N distinct 1 MiB blocks one by one; which are served after."""
    client = StoreClient.open(
        store_config_for(master, global_segment_size=SEGMENT)
    )
    try:
        data = [np.full(BLOCK, i % 251, dtype=np.uint8) for i in range(N)]
        out = np.zeros(BLOCK, dtype=np.uint8)
        for d in [*data, out]:
            client.register(d.ctypes.data, BLOCK)
        keys = [f"ssd-{i}" for i in range(N)]
        for key, d in zip(keys, data, strict=True):
            client.put([key], [(d.ctypes.data, BLOCK)])
            time.sleep(PUT_GAP_S)
        time.sleep(1.0)
        served = []
        for i, key in enumerate(keys):
            out[:] = 255
            got = client.get([key], [(out.ctypes.data, BLOCK)])
            if got.num_failed == 0 and (out == i % 251).all():
                served.append(i)
        return served
    finally:
        client.close()


def test_old_blocks_are_served_from_the_ssd_tier_after_dram_eviction(
    tmp_path,
):
    root = tmp_path / "ssd"
    root.mkdir()
    with EmbeddedMaster(
        lease_ttl_ms=200,
        extra_flags=("--enable_offload=true", f"--root_fs_dir={root}"),
    ) as master:
        served = fill(master, tmp_path)
    on_disk = [p for p in root.rglob("*") if p.is_file()]
    print(f"SSD tier: {len(served)} of {N} served, {len(on_disk)} files")
    # Far more than DRAM holds, the oldest among them, every byte right.
    assert len(served) > SEGMENT // BLOCK, served
    assert 0 in served
    assert len(on_disk) >= len(served) - SEGMENT // BLOCK


def test_without_the_tier_only_what_fits_in_dram_is_served(tmp_path):
    with EmbeddedMaster(lease_ttl_ms=200) as master:
        served = fill(master, tmp_path)
    print(f"DRAM only: {len(served)} of {N} served")
    assert 0 < len(served) <= SEGMENT // BLOCK
    assert 0 not in served
