"""StoreConfig: parsing, validation and the vLLM-compatible sources."""

from __future__ import annotations

import json
import logging

import attrs
import pytest

from connector.config import (
    CONNECTOR_KEYS,
    VLLM_BUILT_IN_KEYS,
    VLLM_UNIMPLEMENTED_KEYS,
    EventsConfig,
    GiB,
    IdentityConfig,
    KiB,
    LoadConfig,
    LookupConfig,
    MiB,
    ParallelKVConfig,
    StoreConfig,
    TraceConfig,
    parse_size,
)
from connector.config_values import config_key
from connector.errors import ConfigError
from connector.ops.master import store_config_for

BASE = {
    "master_server_address": "10.0.0.1:50051",
    "metadata_server": "http://10.0.0.1:8080/metadata",
}


class FakeMaster:
    rpc_address = "127.0.0.1:40001"
    metadata_server = "http://127.0.0.1:40002/metadata"


def write(tmp_path, data, name="mooncake.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


class TestParseSize:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (0, 0),
            (1048576, MiB),
            ("1024", 1024),
            ("4GB", 4 * GiB),
            ("4gb", 4 * GiB),
            ("4GiB", 4 * GiB),
            ("512MiB", 512 * MiB),
            ("512 MB", 512 * MiB),
            ("64m", 64 * MiB),
            ("3.125GB", 3355443200),
            ("1.5KB", 1536),
            ("7b", 7),
            (2.0 * MiB, 2 * MiB),
        ],
    )
    def test_accepted(self, text, expected):
        """Ints and "4GB"-style strings parse to bytes (binary units)."""
        assert expected == parse_size("k", text)

    @pytest.mark.parametrize(
        "bad", ["", "GB", "4 XB", "-1", "1.3b", "four", True, None, [1], -5]
    )
    def test_rejected_names_the_key(self, bad):
        """A bad size raises ConfigError carrying the key and value."""
        with pytest.raises(ConfigError) as info:
            parse_size("global_segment_size", bad)
        assert info.value.key == "global_segment_size"
        assert bad == info.value.value
        assert "global_segment_size" in str(info.value)


class TestFromMapping:
    def test_minimal_uses_vllm_defaults(self):
        """Only the two addresses are required; defaults follow vLLM."""
        config = StoreConfig.from_mapping(BASE)
        assert config.protocol == "rdma"
        assert 4 * GiB == config.global_segment_size
        assert 4 * GiB == config.local_buffer_size
        assert config.namespace == ""
        assert config.rpc_timeout_ms == 5000
        assert config.master_host == "10.0.0.1"
        assert config.master_port == 50051

    def test_full_vllm_file_keys(self):
        """Every key of vLLM's MOONCAKE_CONFIG_PATH file is read."""
        config = StoreConfig.from_mapping(
            {
                **BASE,
                "protocol": "tcp",
                "device_name": "mlx5_0,mlx5_1",
                "global_segment_size": "512MiB",
                "local_buffer_size": "64MB",
                "local_hostname": "10.0.0.2",
            }
        )
        assert config.protocol == "tcp"
        assert config.device_name == "mlx5_0,mlx5_1"
        assert 512 * MiB == config.global_segment_size
        assert 64 * MiB == config.local_buffer_size
        assert config.local_hostname == "10.0.0.2"

    @pytest.mark.parametrize("missing", sorted(BASE))
    def test_missing_required_key(self, missing):
        """A missing address is an error naming it."""
        values = {k: v for k, v in BASE.items() if k != missing}
        with pytest.raises(ConfigError, match=missing) as info:
            StoreConfig.from_mapping(values)
        assert missing == info.value.key
        assert info.value.value is None

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("master_server_address", "10.0.0.1"),
            ("master_server_address", "10.0.0.1:0"),
            ("master_server_address", "10.0.0.1:99999"),
            ("master_server_address", "http://10.0.0.1:50051"),
            ("master_server_address", ":50051"),
            ("master_server_address", 50051),
            ("metadata_server", ""),
            ("metadata_server", "ftp://host/metadata"),
            ("metadata_server", "http:///metadata"),
            ("metadata_server", "justahost"),
            ("protocol", "udp"),
            ("protocol", 1),
            ("device_name", 0),
            ("global_segment_size", "lots"),
            ("global_segment_size", 512),
            ("global_segment_size", "2TiB"),
            ("local_buffer_size", -1),
            ("local_buffer_size", "2TiB"),
            ("local_hostname", "host:notaport"),
            ("namespace", 7),
            ("namespace", "x" * 200),
            ("namespace", "tab\there"),
            ("cache_prefix", "line\nbreak"),
            ("rpc_timeout_ms", 0),
            ("rpc_timeout_ms", "2000"),
            ("rpc_timeout_ms", 2.5),
            ("setup_retries", 0),
            ("breaker_probe_ms", -1),
            ("close_timeout_ms", True),
            ("replica_num", 0),
            ("log_level", "LOUD"),
        ],
    )
    def test_each_bad_value_names_its_key(self, key, value):
        """Each bad value raises ConfigError with that key and value."""
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_mapping({**BASE, key: value})
        assert key == info.value.key
        assert value == info.value.value or isinstance(value, str)
        assert repr(key) in str(info.value)

    def test_unknown_keys_are_warned_not_fatal(self, caplog):
        """Unknown keys are logged by name, the rest still loads."""
        with caplog.at_level(logging.WARNING, logger="connector.config"):
            config = StoreConfig.from_mapping({**BASE, "colour": "blue"})
        assert config.master_server_address == "10.0.0.1:50051"
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "unknown key 'colour' ignored" in messages

    def test_cache_prefix_is_the_namespace(self):
        """vLLM's ``cache_prefix`` sets ``namespace``."""
        config = StoreConfig.from_mapping({**BASE, "cache_prefix": "prod"})
        assert config.namespace == "prod"

    def test_conflicting_alias(self):
        """``cache_prefix`` and ``namespace`` must agree."""
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_mapping(
                {**BASE, "namespace": "a", "cache_prefix": "b"}
            )
        assert info.value.key in {"namespace", "cache_prefix"}

    def test_metadata_server_forms(self):
        """P2PHANDSHAKE, etcd host:port and URLs are accepted."""
        for value in (
            "P2PHANDSHAKE",
            "10.0.0.1:2379",
            "etcd://10.0.0.1:2379",
            "redis://10.0.0.1:6379",
            "http://[::1]:8080/metadata",
        ):
            config = StoreConfig.from_mapping(
                {**BASE, "metadata_server": value}
            )
            assert value == config.metadata_server

    def test_frozen_and_revalidated_by_evolve(self):
        """Configs are immutable; ``attrs.evolve`` validates again."""
        config = StoreConfig.from_mapping(BASE)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            config.protocol = "tcp"  # type: ignore[misc]
        with pytest.raises(ConfigError) as info:
            attrs.evolve(config, replica_num=0)
        assert info.value.key == "replica_num"

    def test_client_env(self):
        """The Mooncake environment comes from the timeouts and level."""
        config = StoreConfig.from_mapping(
            {**BASE, "rpc_timeout_ms": 1500, "log_level": "error"}
        )
        assert config.client_env() == {
            "MC_RPC_TIMEOUT_MS": "1500",
            "MC_STORE_CLIENT_SETUP_RETRIES": "3",
            "MC_LOG_LEVEL": "ERROR",
        }


class TestSources:
    def test_from_extra_config_ignores_connector_keys(self, caplog):
        """Unimplemented vLLM keys: one warning naming them; store keys
        apply; the connector's own keys are silent."""
        extra = {
            **BASE,
            "enable_lookup": True,
            "custom_mem_pool": "",
            "lookup_timeout_ms": 20,
            "mooncake_config_path": None,
            "cache_prefix": "team-a",
            "global_segment_size": "1GB",
        }
        with caplog.at_level(logging.WARNING, logger="connector.config"):
            config = StoreConfig.from_extra_config(extra)
        (record,) = caplog.records
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert message.endswith("ignored: custom_mem_pool, enable_lookup")
        assert "lookup_timeout_ms" not in message
        assert config.namespace == "team-a"
        assert GiB == config.global_segment_size

    def test_from_extra_config_rejects_non_dict(self):
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_extra_config(["a"])  # type: ignore[arg-type]
        assert info.value.key == "kv_connector_extra_config"

    def test_from_file(self, tmp_path):
        """A vLLM-style JSON file loads."""
        path = write(tmp_path, {**BASE, "global_segment_size": "3.125GB"})
        config = StoreConfig.from_file(path)
        assert config.global_segment_size == 3355443200

    def test_from_file_errors(self, tmp_path):
        """Missing, non-JSON and non-object files name the path key."""
        for path in (
            tmp_path / "absent.json",
            write(tmp_path, "{not json", "broken.json"),
            write(tmp_path, [1, 2], "list.json"),
        ):
            with pytest.raises(ConfigError) as info:
                StoreConfig.from_file(path)
            assert info.value.key == "path"
            assert str(path) == info.value.value

    def test_from_file_bad_value_names_the_key(self, tmp_path):
        path = write(tmp_path, {**BASE, "local_buffer_size": "big"})
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_file(path)
        assert info.value.key == "local_buffer_size"

    def test_from_env(self, tmp_path):
        """MOONCAKE_CONFIG_PATH names the file; unset is a clear error."""
        path = write(tmp_path, BASE)
        config = StoreConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)})
        assert BASE["metadata_server"] == config.metadata_server
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_env({})
        assert info.value.key == "MOONCAKE_CONFIG_PATH"

    def test_from_vllm_merges_file_and_extra(self, tmp_path):
        """The extra config overrides the file, key by key."""
        path = write(tmp_path, {**BASE, "protocol": "rdma"})
        config = StoreConfig.from_vllm(
            {"protocol": "tcp", "cache_prefix": "p", "load_async": False},
            {"MOONCAKE_CONFIG_PATH": str(path)},
        )
        assert config.protocol == "tcp"
        assert config.namespace == "p"
        assert BASE["master_server_address"] == config.master_server_address

    def test_from_vllm_needs_an_address_somewhere(self):
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_vllm({"protocol": "tcp"}, {})
        assert info.value.key == "master_server_address"

    def test_store_config_for_master(self):
        """A loopback TCP config for an embedded master, with overrides."""
        config = store_config_for(
            FakeMaster(), global_segment_size="64MiB", namespace="n"
        )
        assert FakeMaster.rpc_address == config.master_server_address
        assert FakeMaster.metadata_server == config.metadata_server
        assert config.protocol == "tcp"
        assert 64 * MiB == config.global_segment_size
        assert config.local_hostname == "127.0.0.1"
        assert config.log_level == "ERROR"

    def test_store_config_for_rejects_unknown_fields(self):
        with pytest.raises(ConfigError) as info:
            store_config_for(FakeMaster(), segment=1)
        assert info.value.key == "segment"

    def test_errors_pickle(self):
        """ConfigError survives pickling (crosses spawn boundaries)."""
        import pickle  # noqa: PLC0415

        err = ConfigError("protocol", "udp", "bad")
        copy = pickle.loads(pickle.dumps(err))  # noqa: S301
        assert (
            copy.key,
            copy.value,
            copy.reason,
        ) == ("protocol", "udp", "bad")
        assert str(err) == str(copy)


def test_size_units_are_binary():
    """Like vLLM, ``GB`` means GiB."""
    assert parse_size("k", "1GB") == parse_size("k", "1GiB") == GiB
    assert parse_size("k", "1KB") == KiB


def test_lookup_bounds_default_and_parse() -> None:
    assert LookupConfig.from_extra_config({}) == LookupConfig(50, 4096)
    assert LookupConfig().failed_load_ttl_s == 15.0
    got = LookupConfig.from_extra_config(
        {
            "lookup_timeout_ms": 20,
            "lookup_max_pending": 8,
            "failed_load_ttl_s": 11,
        }
    )
    assert got == LookupConfig(20, 8, 11.0)
    assert isinstance(got.failed_load_ttl_s, float)
    assert (
        LookupConfig().wait_ms == 0.0
    )  # no wait: lookups answer a step later
    waited = LookupConfig.from_extra_config({"lookup_wait_ms": 2})
    assert waited.wait_ms == 2.0
    assert isinstance(waited.wait_ms, float)
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        LookupConfig.from_extra_config({"lookup_wait_ms": -1})


def test_failed_load_ttl_is_a_declared_key(caplog) -> None:
    """``failed_load_ttl_s`` is the connector's own key: never warned
    about as unknown, and part of the configuration reference."""
    with caplog.at_level(logging.WARNING, logger="connector.config"):
        StoreConfig.from_vllm({**BASE, "failed_load_ttl_s": 12.5}, {})
    assert not caplog.records
    assert "failed_load_ttl_s" in CONNECTOR_KEYS
    assert "failed_load_ttl_s" in attrs.fields_dict(LookupConfig)


def test_weights_version_is_a_declared_key(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="connector.config"):
        StoreConfig.from_vllm({**BASE, "weights_version": "step-7"}, {})
    assert not caplog.records
    got = IdentityConfig.from_extra_config({"weights_version": " step-7 "})
    assert got.weights_version == "step-7"
    assert IdentityConfig.from_extra_config({}).weights_version == ""


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lookup_timeout_ms", 0),
        ("lookup_timeout_ms", "50"),
        ("lookup_max_pending", -1),
        ("lookup_max_pending", True),
        ("failed_load_ttl_s", 0),
        ("failed_load_ttl_s", -1.5),
        ("failed_load_ttl_s", "15"),
        ("failed_load_ttl_s", True),
        ("failed_load_ttl_s", float("inf")),
        ("failed_load_ttl_s", float("nan")),
    ],
)
def test_bad_lookup_bound_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        LookupConfig.from_extra_config({key: value})
    assert caught.value.key == key


def test_load_bounds_default_and_parse() -> None:
    """``transfer_timeout`` in seconds (vLLM's name); 0 turns it off."""
    default = LoadConfig.from_extra_config({})
    assert default == LoadConfig(2.0, 1.0)
    assert default.timeout_s == 2.0
    got = LoadConfig.from_extra_config(
        {"transfer_timeout": 1, "peer_probe_s": 0.25}
    )
    assert got == LoadConfig(1.0, 0.25)
    assert isinstance(got.transfer_timeout, float)
    assert (
        LoadConfig.from_extra_config({"transfer_timeout": 0}).timeout_s is None
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("transfer_timeout", -1),
        ("transfer_timeout", "2"),
        ("transfer_timeout", True),
        ("transfer_timeout", float("inf")),
        ("peer_probe_s", float("nan")),
    ],
)
def test_bad_load_bound_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        LoadConfig.from_extra_config({key: value})
    assert caught.value.key == key


def test_transfer_timeout_is_not_warned_about(caplog) -> None:
    """It is implemented now: neither unknown nor unsupported."""
    with caplog.at_level(logging.WARNING, logger="connector.config"):
        StoreConfig.from_extra_config({**BASE, "transfer_timeout": 1.5})
    assert not caplog.records


def test_lookup_keys_are_not_store_keys() -> None:
    config = StoreConfig.from_extra_config(
        {
            "master_server_address": "127.0.0.1:50051",
            "metadata_server": "P2PHANDSHAKE",
            "lookup_timeout_ms": 20,
        }
    )
    assert config.master_server_address == "127.0.0.1:50051"


def test_every_unimplemented_vllm_key_is_named_in_one_warning(caplog):
    """All of them, from extra config and file alike, once each."""
    extra = {**BASE, **dict.fromkeys(VLLM_UNIMPLEMENTED_KEYS, 1)}
    with caplog.at_level(logging.WARNING, logger="connector.config"):
        StoreConfig.from_extra_config(extra)
        StoreConfig.from_mapping(extra)
    assert len(caplog.records) == 2
    for record in caplog.records:
        named = record.getMessage().rpartition("ignored: ")[2].split(", ")
        assert named == sorted(VLLM_UNIMPLEMENTED_KEYS)


def test_connector_keys_derive_from_the_fields():
    """The connector's keys are its config classes' keys, plus the file
    path and the vLLM keys it accepts without implementing them."""
    own = {
        config_key(f)
        for cls in (
            TraceConfig,
            LookupConfig,
            EventsConfig,
            IdentityConfig,
            LoadConfig,
            ParallelKVConfig,
        )
        for f in attrs.fields(cls)
    }
    assert own == {
        "lifecycle_trace",
        "lifecycle_trace_max_events",
        "lookup_timeout_ms",
        "lookup_max_pending",
        "lookup_wait_ms",
        "failed_load_ttl_s",
        "weights_version",
        "transfer_timeout",
        "peer_probe_s",
        "layerwise_load_max_blocks",
        "layerwise_save_blocks",
        "store_tp_size",
        "enable_store_tp_lcm",
        "prefill_tp_sizes",
        "save_decode_cache",
        "kv_events_medium",
    }
    assert not own & VLLM_UNIMPLEMENTED_KEYS
    assert (
        own
        | {"mooncake_config_path"}
        | VLLM_UNIMPLEMENTED_KEYS
        | VLLM_BUILT_IN_KEYS
        == CONNECTOR_KEYS
    )
    assert not CONNECTOR_KEYS & set(attrs.fields_dict(StoreConfig))


@pytest.mark.parametrize(
    "cls",
    [
        StoreConfig,
        TraceConfig,
        LookupConfig,
        IdentityConfig,
        LoadConfig,
        EventsConfig,
    ],
)
def test_every_field_declares_help_text_and_a_coercion(cls):
    for field in attrs.fields(cls):
        assert len(field.metadata["doc"]) > 10, field.name
        assert callable(field.metadata["coerce"]), field.name


def test_parallel_kv_keys_read_and_checked():
    """The four TP keys: defaults, the LCM, and clear errors."""
    default = ParallelKVConfig.from_extra_config({})
    assert default.shared_tp is None
    assert not default.save_decode_cache
    assert (
        ParallelKVConfig.from_extra_config({"store_tp_size": 4}).shared_tp == 4
    )
    lcm = ParallelKVConfig.from_extra_config(
        {
            "enable_store_tp_lcm": True,
            "prefill_tp_sizes": [2, 3],
            "store_tp_size": 8,
        }
    )
    assert lcm.shared_tp == 6
    bad = [
        ({"store_tp_size": 0}, "store_tp_size"),
        ({"store_tp_size": "2"}, "store_tp_size"),
        ({"prefill_tp_sizes": [2, 0]}, "prefill_tp_sizes"),
        ({"prefill_tp_sizes": 2}, "prefill_tp_sizes"),
        ({"enable_store_tp_lcm": "yes"}, "enable_store_tp_lcm"),
        ({"enable_store_tp_lcm": True}, "prefill_tp_sizes"),
        ({"save_decode_cache": 1}, "save_decode_cache"),
    ]
    for extra, key in bad:
        with pytest.raises(ConfigError) as err:
            ParallelKVConfig.from_extra_config(extra)
        assert err.value.key == key
    # Booleans read like every other boolean key: JSON or "true"/"false".
    spelled = ParallelKVConfig.from_extra_config(
        {"save_decode_cache": "True", "enable_store_tp_lcm": "false"}
    )
    assert (spelled.save_decode_cache, spelled.enable_store_tp_lcm) == (
        True,
        False,
    )


def test_tenant_and_ssd_keys_are_read_and_validated():
    config = StoreConfig.from_extra_config(
        {
            **BASE,
            "tenant_id": "team-a.prod_1",
            "enable_ssd_offload": "true",
            "ssd_offload_path": " /mnt/ssd ",
        }
    )
    assert config.tenant_id == "team-a.prod_1"
    assert config.enable_ssd_offload is True
    assert config.ssd_offload_path == "/mnt/ssd"
    defaults = StoreConfig.from_extra_config(BASE)
    assert (defaults.tenant_id, defaults.enable_ssd_offload) == (
        "default",
        False,
    )
    for key, bad in (
        ("tenant_id", "a b"),
        ("tenant_id", "x" * 129),
        ("enable_ssd_offload", 1),
        ("enable_ssd_offload", "maybe"),
    ):
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_extra_config({**BASE, key: bad})
        assert info.value.key == key


def test_events_medium_is_read_and_validated():
    assert EventsConfig.from_extra_config({}).medium == "MOONCAKE"
    assert EventsConfig.from_extra_config({"kv_events_medium": "cpu"}).medium
    for bad in ("", "two words", 3):
        with pytest.raises(ConfigError) as info:
            EventsConfig.from_extra_config({"kv_events_medium": bad})
        assert info.value.key == "kv_events_medium"


def test_mode_is_checked_against_the_segment_as_vllm_does():
    assert StoreConfig.from_extra_config(BASE).mode is None
    embedded = StoreConfig.from_extra_config({**BASE, "mode": "embedded"})
    assert embedded.mode == "embedded"
    standalone = StoreConfig.from_extra_config(
        {**BASE, "mode": "standalone-store", "global_segment_size": 0}
    )
    assert standalone.global_segment_size == 0
    for values in (
        {"mode": "standalone-store"},  # contributes the default 4 GiB
        {"mode": "embedded", "global_segment_size": 0},
    ):
        with pytest.raises(ConfigError) as info:
            StoreConfig.from_extra_config({**BASE, **values})
        assert info.value.key == "global_segment_size"
    with pytest.raises(ConfigError) as info:
        StoreConfig.from_extra_config({**BASE, "mode": "p2p"})
    assert info.value.key == "mode"


def test_tenant_null_or_empty_is_the_default_tenant_as_in_vllm():
    for value in (None, "", "  "):
        config = StoreConfig.from_extra_config({**BASE, "tenant_id": value})
        assert config.tenant_id == "default"


def test_client_http_server_keys_are_read():
    config = StoreConfig.from_extra_config(
        {**BASE, "enable_client_http_server": True, "client_http_port": 9400}
    )
    assert config.enable_client_http_server is True
    assert config.client_http_port == 9400


def test_built_in_vllm_keys_are_named_at_info_never_warned(caplog):
    """Keys selecting a behaviour this connector always has: one INFO."""
    extra = {**BASE, **dict.fromkeys(VLLM_BUILT_IN_KEYS, True)}
    with caplog.at_level(logging.INFO, logger="connector.config"):
        StoreConfig.from_extra_config(extra)
        StoreConfig.from_mapping(extra)  # the MOONCAKE_CONFIG_PATH file
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 2
    for record in caplog.records:
        named = record.getMessage().rpartition("no effect: ")[2].split(", ")
        assert named == sorted(VLLM_BUILT_IN_KEYS)
    assert not VLLM_BUILT_IN_KEYS & VLLM_UNIMPLEMENTED_KEYS


def test_placement_is_validated_and_read_from_config():
    base = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
    }
    assert StoreConfig.from_mapping(base).placement == "local"
    spread = StoreConfig.from_mapping({**base, "placement": "spread"})
    assert spread.placement == "spread"
    with pytest.raises(ConfigError) as caught:
        StoreConfig.from_mapping({**base, "placement": "nearby"})
    assert caught.value.key == "placement"
    assert "local" in str(caught.value)
    assert "spread" in str(caught.value)


def test_mirror_needs_the_pool_segment_and_a_segment_of_its_own():
    """``placement: mirror`` names the node pool's segment, keeps one of
    its own and is no dummy; ``pool_segment`` means nothing without it.
    Each bad combination names the key to fix."""
    base = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "global_segment_size": "64MiB",
    }
    mirror = {**base, "placement": "mirror", "pool_segment": "127.0.0.1:9"}
    ok = StoreConfig.from_mapping(mirror)
    assert (ok.placement, ok.pool_segment) == ("mirror", "127.0.0.1:9")
    assert StoreConfig.from_mapping(base).pool_segment is None
    for bad, key in [
        ({**base, "placement": "mirror"}, "pool_segment"),
        ({**base, "pool_segment": "127.0.0.1:9"}, "pool_segment"),
        ({**mirror, "pool_segment": "127.0.0.1"}, "pool_segment"),
        ({**mirror, "global_segment_size": 0}, "placement"),
        (
            {
                **mirror,
                "global_segment_size": 0,
                "real_client_address": "127.0.0.1:7",
            },
            "placement",
        ),
    ]:
        with pytest.raises(ConfigError) as caught:
            StoreConfig.from_mapping(bad)
        assert caught.value.key == key, (bad, caught.value)
