"""Process-wide clients: lookup-only callers never contribute memory."""

from __future__ import annotations

import pytest

from connector.config import MiB, StoreConfig
from connector.ops.master import store_config_for
from connector.store import StoreClient, clients

pytestmark = pytest.mark.mooncake


def _config(master, namespace: str = "a") -> StoreConfig:
    return store_config_for(
        master, global_segment_size=64 * MiB, namespace=namespace
    )


def _close(*opened: StoreClient) -> None:
    """Close only this test's clients (others' segments hold their KV)."""
    for client in opened:
        client.close()


def test_lookup_client_alone_contributes_nothing(start_master) -> None:
    master = start_master()
    lookup = clients.acquire(_config(master), contribute=False)
    mover = lookup
    try:
        assert lookup.config.global_segment_size == 0
        mover = clients.acquire(_config(master))
        assert mover is not lookup
        assert mover.config.global_segment_size == 64 * MiB
        # A second lookup caller shares one of the two, never a third.
        again = clients.acquire(_config(master, "b"), contribute=False)
        assert again is mover
    finally:
        _close(lookup, mover)


def test_lookup_caller_shares_the_contributing_client(start_master) -> None:
    master = start_master()
    mover = clients.acquire(_config(master))
    try:
        lookup = clients.acquire(_config(master, "b"), contribute=False)
        assert lookup is mover
        assert mover.config.global_segment_size == 64 * MiB
    finally:
        _close(mover)
