"""Back-pressure: a full store answers STORE_FULL, then recovers."""

from __future__ import annotations

import time

import pytest
import torch

from connector.config import MiB
from connector.ops.master import store_config_for
from connector.store import Outcome, StoreClient
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = pytest.mark.mooncake

BLOCK = MiB
SEGMENT = 64 * MiB


def test_store_full_then_eviction(start_master, kv_blocks):
    """Overfilling a 64 MiB segment gives STORE_FULL, later puts succeed."""
    master = start_master(lease_ttl_ms=300)
    config = store_config_for(
        master, global_segment_size=SEGMENT, namespace="full"
    )
    with StoreClient.open(config) as client:
        src = kv_blocks(client, 8, BLOCK, seed=7)
        keys = KeyScheme(
            namespace="full",
            model="m",
            tp_rank=0,
            tp_size=1,
            layout=KeyLayout("uint8", 16, BLOCK),
        ).keys(range(200))

        outcomes: list[Outcome] = []
        full_at = None
        for start in range(0, len(keys), 16):
            batch = keys[start : start + 16]
            ids = [i % 8 for i in range(len(batch))]
            result = client.put(batch, src.regions(ids))
            outcomes.extend(result)
            if result.back_pressure and full_at is None:
                full_at = start
        assert Outcome.STORE_FULL in outcomes, outcomes
        assert full_at is not None
        assert full_at >= 48, "64 x 1 MiB objects must fit before -200"
        assert set(outcomes) <= {Outcome.STORED, Outcome.STORE_FULL}

        # Retry the rejected keys: eviction frees space within moments.
        pairs = zip(keys, outcomes, strict=True)
        rejected = [k for k, o in pairs if o is not Outcome.STORED][:8]
        block_of = {key: i for i, key in enumerate(rejected)}
        pending = list(rejected)
        retries = 0
        deadline = time.monotonic() + 5.0
        while pending and time.monotonic() < deadline:
            retries += 1
            result = client.put(
                pending, src.regions([block_of[k] for k in pending])
            )
            assert set(result) <= {Outcome.STORED, Outcome.STORE_FULL}
            pending = [
                k
                for k, o in zip(pending, result, strict=True)
                if o is Outcome.STORE_FULL
            ]
            if pending:
                time.sleep(0.05)
        assert pending == [], f"still rejected after {retries} retries"

        out = kv_blocks(client, 8, BLOCK)
        got = client.get(rejected, out.regions(range(8)))
        assert list(got) == [Outcome.HIT] * 8
        assert torch.equal(src.tensor, out.tensor)
