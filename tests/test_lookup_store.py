"""Admission lookups against the real store: one key per distinct block."""

from __future__ import annotations

import pytest

from connector.scheduler.store_lookup import StoreLookup
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm]

BLOCK = 4096


def test_a_block_shared_by_prefixes_is_asked_for_once(
    store_client, kv_blocks, unique
):
    scheme = KeyScheme(
        namespace=f"dedupe-{unique}",
        model="m",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, BLOCK),
    )
    asked: list[list[str]] = []

    class Counting:
        def exists(self, keys):
            asked.append(list(keys))
            return store_client.exists(keys)

    shared = [bytes([i + 1]) * 8 for i in range(4)]
    prefixes = [[*shared, bytes([100 + i]) * 8] for i in range(8)]
    lookup = StoreLookup(Counting(), (scheme,))
    assert lookup.hit_blocks_many(prefixes) == [0] * 8
    assert len(asked) == 1
    assert len(asked[0]) == 4 + 8  # each distinct block once, not 8 * 5

    src = kv_blocks(store_client, 2, BLOCK, seed=5)
    assert store_client.put(scheme.keys(shared[:2]), src.regions(range(2))).ok
    assert lookup.hit_blocks_many(prefixes) == [2] * 8
    assert lookup.hit_blocks_many([shared[1:], shared[:1], []]) == [1, 1, 0]
