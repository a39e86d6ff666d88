"""The dummy client of a node-level pool (issue 33's last mode).

``real_client_address`` makes the worker's store client Mooncake's dummy
client: it moves no byte itself; the node-level ``mooncake_client``
(`connector.ops.procs.NodePool`) copies each block between its pool and
the worker's staging buffers in shared memory. Real processes only: the
wheel's ``mooncake_master`` and ``mooncake_client``, vLLM 0.33's real
scheduler for the connector tests.
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.config import StoreConfig
from connector.errors import ConfigError, RegistrationError, StoreUnavailable
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.ops.procs import NodePool, free_port
from connector.store import Outcome, StoreClient
from tests.conftest import pool_command

pytestmark = pytest.mark.mooncake

BLOCK = 64 * 1024
POOL = 64 * 1024 * 1024


def dummy_config(master: EmbeddedMaster, node: NodePool) -> StoreConfig:
    return store_config_for(
        master,
        global_segment_size=0,
        real_client_address=node.address,
        shm_pool_size=16 * 1024 * 1024,
        rpc_timeout_ms=1000,
    )


@pytest.fixture(scope="module")
def pool():
    """A master and a node-level pool for this module's tests."""
    with EmbeddedMaster(client_ttl_s=2) as master:
        node = NodePool.for_master(master, POOL).start()
        try:
            yield master, node
        finally:
            node.stop()


def test_the_key_is_checked() -> None:
    """``real_client_address`` is ``host:port``, needs no segment of the
    worker's own and no SSD tier (the pool process owns both)."""
    base = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 0,
    }
    ok = StoreConfig.from_mapping({**base, "real_client_address": "h:1"})
    assert ok.dummy
    assert ok.shm_pool_size == 256 * 1024 * 1024
    assert not StoreConfig.from_mapping(base).dummy
    for bad, more in [
        ("127.0.0.1", {}),
        ("127.0.0.1:1", {"global_segment_size": "64MiB"}),
        ("127.0.0.1:1", {"enable_ssd_offload": True}),
    ]:
        with pytest.raises(ConfigError) as err:
            StoreConfig.from_mapping(
                {**base, **more, "real_client_address": bad}
            )
        assert err.value.key == "real_client_address"
        assert err.value.value == bad


def test_no_pool_process_is_a_clear_error_at_once() -> None:
    """Nothing at the address: `StoreUnavailable` naming it, in well
    under Mooncake's own retries."""
    port = free_port()
    config = StoreConfig.from_mapping(
        {
            "master_server_address": "127.0.0.1:50051",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 0,
            "real_client_address": f"127.0.0.1:{port}",
        }
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        StoreClient.open(config)
    assert time.monotonic() - started < 5
    assert f"127.0.0.1:{port}" in str(err.value)
    assert "mooncake_client" in str(err.value)


def test_staging_memory_round_trips_through_the_pool(pool, unique) -> None:
    """Blocks put from and got into the dummy's shared memory come back
    byte for byte; other memory of the process the pool process cannot
    see, and registering it is refused at once."""
    master, node = pool
    client = StoreClient.open(dummy_config(master, node))
    try:
        assert client.dummy
        src = client.staging_memory(4 * BLOCK).view(4, BLOCK)
        dst = client.staging_memory(4 * BLOCK).view(4, BLOCK)
        assert client.register_tensor(src)
        assert client.register_tensor(dst)
        src.copy_(torch.randint(0, 256, (4, BLOCK), dtype=torch.uint8))
        keys = [f"dummy-{unique}-{i}" for i in range(4)]
        regions = [(src[i].data_ptr(), BLOCK) for i in range(4)]
        assert list(client.put(keys, regions)) == [Outcome.STORED] * 4
        got = client.get(keys, [(dst[i].data_ptr(), BLOCK) for i in range(4)])
        assert list(got) == [Outcome.HIT] * 4
        assert torch.equal(dst, src)
        plain = torch.ones(BLOCK, dtype=torch.uint8)
        with pytest.raises(RegistrationError):
            client.register_tensor(plain)
    finally:
        assert client.close()


def test_only_a_dummy_hands_out_staging_memory(store_client) -> None:
    with pytest.raises(ValueError, match="dummy"):
        store_client.staging_memory(BLOCK)


def test_cli_pool_dummy_prints_a_config_that_works(unique) -> None:
    """``kv-lifecycle pool --dummy``: the printed engines' config names
    the pool's address as ``real_client_address``, and a client opened
    from it stores and loads through that pool."""
    with (
        EmbeddedMaster() as master,
        pool_command(master, "--dummy") as (_, extra),
    ):
        config = StoreConfig.from_extra_config(
            {**extra, "shm_pool_size": "8MiB"}
        )
        assert config.dummy
        assert config.global_segment_size == 0
        client = StoreClient.open(config)
        try:
            buf = client.staging_memory(2 * BLOCK).view(2, BLOCK)
            assert client.register_tensor(buf)
            buf[0].fill_(0x3C)
            key = f"cli-{unique}"
            put = client.put([key], [(buf[0].data_ptr(), BLOCK)])
            assert list(put) == [Outcome.STORED]
            got = client.get([key], [(buf[1].data_ptr(), BLOCK)])
            assert list(got) == [Outcome.HIT]
            assert torch.equal(buf[1], buf[0])
        finally:
            client.close()
