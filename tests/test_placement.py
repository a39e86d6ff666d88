"""Where puts go (``placement``), on a real master with two segments.

``local`` (the default) prefers the putting client's own segment, so a
hit of its own blocks is a copy inside its process; once that segment is
full the puts go to the others, and nothing is refused.  ``spread``
leaves placement to Mooncake, over every segment.  The key's parsing is
in ``tests/test_config.py`` (torch-free: it runs on every Python).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from connector.config import StoreConfig
from connector.ops.master import store_config_for
from connector.store import Outcome, StoreClient
from tests.conftest import MasterPool

BLOCK = 256 * 1024
SEGMENT = 16 * 1024 * 1024  # 64 blocks


@pytest.fixture
def master(master_binary):
    del master_binary  # the wheel's master is there
    pool = MasterPool()
    try:
        yield pool.start(lease_ttl_ms=500, client_ttl_s=60)
    finally:
        pool.stop_all()


def _open(
    config: StoreConfig, blocks: int
) -> tuple[StoreClient, torch.Tensor]:
    client = StoreClient.open(config, check_regions=True)
    gen = torch.Generator().manual_seed(blocks)
    buf = torch.randint(
        0, 256, (blocks, BLOCK), dtype=torch.uint8, generator=gen
    )
    assert client.register_tensor(buf)
    return client, buf


def _regions(t: torch.Tensor) -> list[tuple[int, int]]:
    return [(t[i].data_ptr(), BLOCK) for i in range(t.shape[0])]


def _put_and_place(
    master, unique: str, placement: str, blocks: int
) -> tuple[str, list[tuple[str, ...]], int]:
    """A (``placement``, a 16 MiB segment) puts ``blocks`` blocks beside
    B (a 32 MiB segment); B reads every one back, byte for byte.

    Returns A's segment, each block's replica segments, and how many
    blocks B read back equal.
    """
    config = store_config_for(master, global_segment_size=SEGMENT)
    a, src = _open(attrs.evolve(config, placement=placement), blocks)
    b, dst = _open(
        attrs.evolve(config, global_segment_size=2 * SEGMENT), blocks
    )
    with a, b:
        keys = [f"{unique}-{placement}-{i}" for i in range(blocks)]
        stored = list(a.put(keys, _regions(src)))
        assert stored == [Outcome.STORED] * blocks
        where = a.replica_endpoints(keys)
        dst.zero_()
        got = list(b.get(keys, _regions(dst)))
        assert got == [Outcome.HIT] * blocks
        equal = sum(torch.equal(src[i], dst[i]) for i in range(blocks))
        return a.hostname, where, equal


def test_local_placement_keeps_the_puts_in_the_own_segment(master, unique):
    """32 blocks (half of A's segment): every replica is in A's segment,
    and B, a peer, still reads each one exactly."""
    own, where, equal = _put_and_place(master, unique, "local", 32)
    assert where == [(own,)] * 32
    assert equal == 32


def test_spread_placement_uses_the_other_segment_too(master, unique):
    """The contrast (what ``local`` changes): Mooncake's own placement
    puts some of the 32 blocks in B's segment (all 32 in A by chance:
    about 2**-32 with B's larger segment)."""
    own, where, equal = _put_and_place(master, unique, "spread", 32)
    assert all(len(w) == 1 for w in where)
    assert sum(w != (own,) for w in where) > 0
    assert equal == 32


def test_a_full_own_segment_sends_the_rest_to_the_others(master, unique):
    """96 blocks, 1.5x A's segment: every put is stored, A's segment
    takes what fits and B's the rest; every block reads back exactly."""
    own, where, equal = _put_and_place(master, unique, "local", 96)
    assert all(len(w) == 1 for w in where)
    mine = sum(w == (own,) for w in where)
    assert 0 < mine <= SEGMENT // BLOCK
    assert len(where) - mine >= 96 - SEGMENT // BLOCK
    assert equal == 96
