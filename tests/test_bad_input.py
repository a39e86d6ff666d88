"""Bad input at start-up, through the connector's real constructor path.

`MooncakeLifecycleConnector(vllm_config, role, kv_cache_config)` is built
with a real `VllmConfig` (made by `harness.scheduler.Harness`) whose
`kv_connector_extra_config` or `MOONCAKE_CONFIG_PATH` file is wrong in one
way at a time.  Each must fail at construction with a clear error naming
the cause, within a bounded time, before any store client is opened;
unknown keys are warned about and otherwise ignored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time

import attrs
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
)

from connector.config import CONFIG_PATH_ENV, StoreConfig
from connector.errors import ConfigError, StoreUnavailable
from connector.integration.vllm_connector import MooncakeLifecycleConnector
from connector.store import clients
from harness import Harness
from tests.connector_helpers import CONNECTOR, store_extra

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BOUND_S = 3.0  # every failure below is reported within this

# One bad value for every key the connector reads from its extra config.
BAD_VALUES = {
    "master_server_address": "10.0.0.1",  # no port
    "metadata_server": "ftp://host/metadata",
    "cluster_id": "no spaces allowed",
    "protocol": "udp",
    "placement": "nearby",
    "pool_segment": "127.0.0.1",  # no port
    "device_name": 5,
    "global_segment_size": "8MiB",  # Mooncake's setup() fails under 16 MiB
    "local_buffer_size": "2TiB",
    "local_hostname": "host:notaport",
    "namespace": "line\nbreak",
    "cache_prefix": 7,
    "rpc_timeout_ms": 0,
    "setup_retries": -1,
    "breaker_probe_ms": "fast",
    "close_timeout_ms": 1.5,
    "replica_num": 0,
    "log_level": "LOUD",
    "tenant_id": "no spaces allowed",
    "enable_ssd_offload": "sometimes",
    "ssd_offload_path": 3,
    "enable_client_http_server": 1,
    "client_http_port": 0,
    "mode": "p2p",
    "real_client_address": "127.0.0.1",  # no port
    "shm_pool_size": "2TiB",
    "mooncake_config_path": 12,
    "lifecycle_trace": 5,
    "lifecycle_trace_max_events": 0,
}


@pytest.fixture(scope="module")
def good(mooncake_master):
    """A valid extra config and a harness holding a real VllmConfig."""
    extra = store_extra(
        mooncake_master, "bad-input", local_hostname="127.0.0.1"
    )
    h = Harness(CONNECTOR, extra_config=extra)
    yield extra, h
    h.close()


@contextlib.contextmanager
def extra_config(h, extra):
    """Swap the harness's `kv_connector_extra_config` for one construction."""
    transfer = h.vllm_config.kv_transfer_config
    saved = transfer.kv_connector_extra_config
    transfer.kv_connector_extra_config = extra
    try:
        yield
    finally:
        transfer.kv_connector_extra_config = saved


def construct(h, extra, role=KVConnectorRole.SCHEDULER):
    """Build the connector as vLLM does; return it and the seconds taken."""
    started = time.monotonic()
    with extra_config(h, extra):
        connector = MooncakeLifecycleConnector(
            h.vllm_config, role, h.kv_cache_config
        )
    return connector, time.monotonic() - started


def construct_fails(h, extra, error=ConfigError):
    started = time.monotonic()
    with pytest.raises(error) as info:
        construct(h, extra)
    assert time.monotonic() - started < BOUND_S
    return info.value


def test_every_key_has_a_bad_case():
    """The table covers every StoreConfig field, alias and trace key."""
    keys = set(attrs.fields_dict(StoreConfig)) | {
        "cache_prefix",
        "mooncake_config_path",
        "lifecycle_trace",
        "lifecycle_trace_max_events",
    }
    assert keys == set(BAD_VALUES)


class TestExtraConfig:
    @pytest.mark.parametrize(("key", "value"), sorted(BAD_VALUES.items()))
    def test_bad_value_names_its_key(self, good, key, value, monkeypatch):
        """Each bad value: ConfigError naming the key, no client opened."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        opened = []
        monkeypatch.setattr(
            clients, "acquire", lambda *a, **k: opened.append((a, k))
        )
        err = construct_fails(h, {**extra, key: value})
        assert key == err.key
        assert value == err.value or isinstance(value, str)
        assert repr(key) in str(err)
        assert opened == []

    @pytest.mark.parametrize(
        "missing", ["master_server_address", "metadata_server"]
    )
    def test_missing_required_key(self, good, missing, monkeypatch):
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        err = construct_fails(
            h, {k: v for k, v in extra.items() if k != missing}
        )
        assert missing == err.key
        assert err.value is None
        assert "missing" in err.reason

    def test_non_string_key(self, good, monkeypatch):
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        err = construct_fails(h, {**extra, 3: "x"})
        assert err.key == "3"

    def test_unwritable_trace_file(self, good, tmp_path, monkeypatch):
        """A trace file that cannot be opened names `lifecycle_trace`."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        path = str(tmp_path / "missing-dir" / "trace.jsonl")
        acquired, released = [], []
        acquire = clients.acquire

        def spy_acquire(*args, **kwargs):
            acquired.append(acquire(*args, **kwargs))
            return acquired[-1]

        monkeypatch.setattr(clients, "acquire", spy_acquire)
        monkeypatch.setattr(clients, "release", released.append)
        err = construct_fails(h, {**extra, "lifecycle_trace": path})
        assert err.key == "lifecycle_trace"
        # The failed construction released the store client it acquired.
        assert len(acquired) == 1
        assert released == acquired

    def test_unknown_keys_are_warned_about(self, good, caplog, monkeypatch):
        """An unknown key is logged by name; the connector still works."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        bad = {**extra, "colour": "blue"}
        with caplog.at_level(logging.WARNING, logger="connector.config"):
            connector, elapsed = construct(h, bad)
        connector.shutdown()
        assert elapsed < BOUND_S
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "unknown key 'colour' ignored" in messages

    @pytest.mark.parametrize(
        "worker_keys",
        [
            {"mode": "embedded", "global_segment_size": "64MiB"},
            {
                "global_segment_size": "64MiB",
                "placement": "mirror",
                "pool_segment": "127.0.0.1:9",
            },
        ],
        ids=["embedded", "mirror"],
    )
    def test_worker_only_keys_leave_the_scheduler_a_pure_client(
        self, good, worker_keys, monkeypatch
    ):
        """Keys about the worker's own segment (``mode: embedded``,
        ``placement: mirror``) build the scheduler's side too: its
        lookup client owns no segment, so they do not apply to it."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        connector, elapsed = construct(h, {**extra, **worker_keys})
        try:
            client = connector._client
            assert client is not None
            assert client.config.global_segment_size == 0
            assert client.config.pool_segment is None
        finally:
            connector.shutdown()
        assert elapsed < BOUND_S


class TestConfigFile:
    @pytest.fixture
    def only_file(self, good, monkeypatch):
        """The store keys come from the file alone."""
        _, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        return h, {"namespace": "bad-input"}

    @pytest.mark.parametrize(
        ("content", "reason"),
        [
            (None, "cannot read"),
            ("{not json", "not valid JSON"),
            ("[1, 2]", "JSON object"),
            ("", "not valid JSON"),
        ],
    )
    def test_missing_or_malformed_file(
        self, only_file, tmp_path, monkeypatch, content, reason
    ):
        """MOONCAKE_CONFIG_PATH: missing, broken or non-object files."""
        h, extra = only_file
        path = tmp_path / "mooncake.json"
        if content is not None:
            path.write_text(content)
        monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
        err = construct_fails(h, extra)
        assert err.key == CONFIG_PATH_ENV
        assert str(path) == err.value
        assert reason in err.reason

    def test_bad_value_in_file_names_the_key(
        self, good, only_file, tmp_path, monkeypatch
    ):
        store_keys, _ = good
        h, extra = only_file
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps({**store_keys, "protocol": "carrier"}))
        monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
        err = construct_fails(h, extra)
        assert err.key == "protocol"

    def test_extra_config_path_to_missing_file(self, only_file, tmp_path):
        h, extra = only_file
        path = tmp_path / "absent.json"
        err = construct_fails(h, {**extra, "mooncake_config_path": str(path)})
        assert err.key == "mooncake_config_path"

    def test_good_file_works(self, good, only_file, tmp_path, monkeypatch):
        """Positive control: the same keys from a file construct fine."""
        store_keys, _ = good
        h, extra = only_file
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(store_keys))
        monkeypatch.setenv(CONFIG_PATH_ENV, str(path))
        connector, elapsed = construct(h, extra)
        connector.shutdown()
        assert elapsed < BOUND_S


class TestUnreachableMaster:
    def test_nothing_listening(self, good, monkeypatch):
        """A master address nobody listens on: StoreUnavailable, at once."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        address = f"127.0.0.1:{free_port()}"
        err = construct_fails(
            h, {**extra, "master_server_address": address}, StoreUnavailable
        )
        assert address == err.address
        assert "connect" in err.reason

    def test_no_etcd_endpoint_listening(self, good, monkeypatch):
        """An HA address whose etcd endpoints all refuse: at once."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        address = f"etcd://127.0.0.1:{free_port()};127.0.0.1:{free_port()}"
        err = construct_fails(
            h, {**extra, "master_server_address": address}, StoreUnavailable
        )
        assert address == err.address
        assert "etcd endpoint" in err.reason
        assert err.reason.count("refused") == 2  # both were tried

    def test_unroutable_address_is_bounded(self, good, monkeypatch):
        """A blackholed master (no answer at all) fails within the bound."""
        extra, h = good
        monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
        address = "10.255.255.1:50051"
        err = construct_fails(
            h,
            {**extra, "master_server_address": address, "rpc_timeout_ms": 500},
            StoreUnavailable,
        )
        assert address == err.address


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
