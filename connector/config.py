"""Typed, validated configuration of the Mooncake store client.

``StoreConfig`` is built from any of:

- vLLM's ``kv_connector_extra_config`` dict (``from_extra_config``);
- the JSON file named by ``MOONCAKE_CONFIG_PATH``, in the format of vLLM's
  own ``MooncakeStoreConnector`` (``from_file`` / ``from_env``);
- both, the dict overriding the file (``from_vllm``).

Every bad or missing value raises ``ConfigError`` naming the key.
Unknown keys are logged as warnings and otherwise ignored; keys of vLLM's
``MooncakeStoreConnector`` that this connector does not implement
(``VLLM_UNIMPLEMENTED_KEYS``) are named in one warning.

Sizes accept ints or strings such as ``"4GB"``, ``"512MiB"``, ``"3.125 gb"``
or ``"1024"``. As in vLLM, ``KB``/``MB``/``GB``/``TB`` are *binary* units:
``"4GB"`` is ``4 * 1024**3`` bytes, the same as ``"4GiB"``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs

from connector.config_values import (
    ETCD_SCHEME,
    Coerce,
    GiB,
    KiB,
    MiB,
    check_buffer,
    check_cluster_id,
    check_local_hostname,
    check_log_level,
    check_master_address,
    check_medium,
    check_metadata_server,
    check_namespace,
    check_optional_host_port,
    check_placement,
    check_protocol,
    check_segment,
    check_tenant,
    coerce_bool,
    coerce_int,
    coerce_level,
    coerce_mode,
    coerce_optional_str,
    coerce_path,
    coerce_seconds,
    coerce_seconds_or_off,
    coerce_str,
    coerce_tenant,
    config_key,
    is_bool,
    key_help,
    master_endpoints,
    not_negative,
    of_type,
    parse_size,
    positive,
)
from connector.errors import ConfigError
from connector.vllm_keys import (
    VLLM_BUILT_IN_KEYS,
    VLLM_UNIMPLEMENTED_KEYS,
    name_vllm_keys,
)
from lifecycle.trace import DEFAULT_MAX_EVENTS

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

__all__ = [
    "CONFIG_PATH_ENV",
    "CONNECTOR_KEYS",
    "DEFAULT_EVENTS_MEDIUM",
    "DEFAULT_FAILED_LOAD_TTL_S",
    "VLLM_BUILT_IN_KEYS",
    "VLLM_UNIMPLEMENTED_KEYS",
    "EventsConfig",
    "GiB",
    "IdentityConfig",
    "KiB",
    "LoadConfig",
    "LookupConfig",
    "MiB",
    "ParallelKVConfig",
    "StoreConfig",
    "TraceConfig",
    "parse_size",
]

log = logging.getLogger(__name__)

CONFIG_PATH_ENV: Final = "MOONCAKE_CONFIG_PATH"


# vLLM's extra config names the namespace ``cache_prefix``.
_ALIASES: Final[dict[str, str]] = {"cache_prefix": "namespace"}


@attrs.frozen(kw_only=True)
class StoreConfig:
    """Everything the store client needs, validated on construction.

    Field names are the keys of the ``MOONCAKE_CONFIG_PATH`` file (vLLM's
    format) plus this client's own keys; defaults follow vLLM's
    ``MooncakeStoreConfig`` (``protocol="rdma"``, 4 GiB segment and
    buffer). Construction, ``attrs.evolve`` and every ``from_*`` raise
    ``ConfigError`` naming the first bad key. The constructor takes typed
    values (sizes as ints); ``from_*`` also parse size strings such as
    ``"4GB"``.

    Each field declares its key's type, default, validation, help text and
    coercion from config values (``metadata``); the docs reference and the
    README table are generated from them.
    """

    master_server_address: str = attrs.field(
        validator=[of_type(str), check_master_address],
        metadata=key_help(
            "``host:port`` of the ``mooncake_master`` RPC service, or "
            "``etcd://host:2379[;host:2379...]`` for an HA master set "
            "(``mooncake_master --enable_ha``): the client finds the "
            "leader through those etcd endpoints and follows it on "
            "failover.",
            coerce_str,
        ),
    )
    metadata_server: str = attrs.field(
        validator=[of_type(str), check_metadata_server],
        metadata=key_help(
            "Transfer-engine metadata: ``http://host:8080/metadata``, "
            "``etcd://host:2379``, ``redis://host:6379`` or ``P2PHANDSHAKE``.",
            coerce_str,
        ),
    )
    cluster_id: str | None = attrs.field(
        default=None,
        validator=[of_type(str, type(None)), check_cluster_id],
        metadata=key_help(
            "With an ``etcd://`` master address: the HA master set's "
            "``--cluster_id`` (``MC_STORE_CLUSTER_ID``); ``null`` is "
            "Mooncake's default, ``mooncake_cluster``.",
            coerce_optional_str,
        ),
    )
    protocol: str = attrs.field(
        default="rdma",
        validator=[of_type(str), check_protocol],
        metadata=key_help(
            "``tcp`` or ``rdma`` (``efa``, ``cxl``, ``nvlink``, ``ascend`` "
            "pass through to Mooncake).",
            coerce_str,
        ),
    )
    device_name: str = attrs.field(
        default="",
        validator=of_type(str),
        metadata=key_help(
            'RDMA NICs, e.g. ``"mlx5_0,mlx5_1"``; ``""`` for TCP or '
            "auto-discovery.",
            coerce_str,
        ),
    )
    global_segment_size: int = attrs.field(
        default=4 * GiB,
        validator=[of_type(int), check_segment],
        metadata=key_help(
            "Memory this worker contributes to the pool; ``0`` is a pure "
            'client. Ints or strings (``"32GB"`` is 32 GiB, as in vLLM).',
            parse_size,
        ),
    )
    placement: str = attrs.field(
        default="local",
        validator=[of_type(str), check_placement],
        metadata=key_help(
            "Where this client's puts go. ``local``: its own segment "
            "first (Mooncake's ``preferred_segment``), the other segments "
            "once it is full, so a hit of the worker's own blocks is a "
            "copy inside its process. ``spread``: Mooncake's placement, "
            "over every segment (with several engines on a node, about "
            "half of a hit's blocks then cross the transfer engine). "
            "``mirror``: two replicas, one in its own segment and one in "
            "the node-level pool named by ``pool_segment``: hits stay "
            "copies inside the process and the blocks outlive the engine "
            "(twice the memory, a second put over the transfer engine). "
            "Only a client with ``global_segment_size`` > 0 has a segment "
            "to prefer; the others leave placement to Mooncake.",
            coerce_str,
        ),
    )
    pool_segment: str | None = attrs.field(
        default=None,
        validator=[of_type(str, type(None)), check_optional_host_port],
        metadata=key_help(
            "With ``placement: mirror``: the node-level pool's segment "
            "name, ``host:port`` (``kv-lifecycle pool --mirror`` prints "
            "it), where each block's second replica goes.  ``null`` "
            "otherwise.",
            coerce_optional_str,
        ),
    )
    local_buffer_size: int = attrs.field(
        default=4 * GiB,
        validator=[of_type(int), check_buffer],
        metadata=key_help(
            "Mooncake's staging buffer (allocated, unused by this client's "
            "zero-copy calls: keep it small).",
            parse_size,
        ),
    )
    local_hostname: str = attrs.field(
        default="",
        validator=[of_type(str), check_local_hostname],
        metadata=key_help(
            "Address other nodes reach this worker at (``ip`` or "
            '``ip:port``); ``""`` picks the local address that routes to '
            "the master.",
            coerce_str,
        ),
    )
    namespace: str = attrs.field(
        default="",
        validator=[of_type(str), check_namespace],
        metadata=key_help(
            "Key prefix separating deployments that share a master "
            "(alias ``cache_prefix``).",
            coerce_str,
        ),
    )
    rpc_timeout_ms: int = attrs.field(
        default=5000,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Bound of one master RPC (``MC_RPC_TIMEOUT_MS``): what a hung "
            "master costs.",
            coerce_int,
        ),
    )
    setup_retries: int = attrs.field(
        default=3,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Attempts to reach the master at start-up "
            "(``MC_STORE_CLIENT_SETUP_RETRIES``).",
            coerce_int,
        ),
    )
    breaker_probe_ms: int = attrs.field(
        default=1000,
        validator=[of_type(int), positive],
        metadata=key_help(
            "While the circuit breaker is open, one call per interval tests "
            "whether the master is back.",
            coerce_int,
        ),
    )
    close_timeout_ms: int = attrs.field(
        default=5000,
        validator=[of_type(int), positive],
        metadata=key_help(
            "How long closing the store client waits for calls in flight; "
            "with calls still in flight then, or the master gone, the "
            "client is left to process exit.",
            coerce_int,
        ),
    )
    replica_num: int = attrs.field(
        default=1,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Memory replicas per stored block (best effort).", coerce_int
        ),
    )
    tenant_id: str = attrs.field(
        default="default",
        validator=[of_type(str), check_tenant],
        metadata=key_help(
            "Mooncake tenant of this client: on a master started with "
            "``--enable_multi_tenants=true`` tenants never see each other's "
            "keys, and a tenant over its quota (``--tenant_quota_"
            "connector_uri``) evicts only its own objects. ``null`` or "
            '``""`` is ``"default"``.',
            coerce_tenant,
        ),
    )
    enable_ssd_offload: bool = attrs.field(
        default=False,
        validator=is_bool,
        metadata=key_help(
            "Mooncake's client-side SSD offload (passed to its set-up, with "
            "``ssd_offload_path``); keep it off: the SSD tier that serves "
            "blocks after DRAM eviction is the master's (``--enable_offload"
            "=true --root_fs_dir=DIR``, no client key), and with this key "
            "on the 0.3.13.post1 wheel refused puts instead of evicting "
            "(see the operators' page on cache tiers).",
            coerce_bool,
        ),
    )
    ssd_offload_path: str = attrs.field(
        default="",
        validator=of_type(str),
        metadata=key_help(
            'Directory of the client-side offload (``""``: Mooncake\'s '
            "``MOONCAKE_OFFLOAD_FILE_STORAGE_PATH``).",
            coerce_str,
        ),
    )
    enable_client_http_server: bool = attrs.field(
        default=False,
        validator=is_bool,
        metadata=key_help(
            "Start the Mooncake client's own HTTP endpoints (metrics) on "
            "``client_http_port``.",
            coerce_bool,
        ),
    )
    client_http_port: int = attrs.field(
        default=9300,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Port of the Mooncake client's HTTP endpoints.", coerce_int
        ),
    )
    mode: str | None = attrs.field(
        default=None,
        validator=of_type(str, type(None)),
        metadata=key_help(
            "vLLM's topology check: ``embedded`` (this worker contributes "
            "``global_segment_size`` > 0) or ``standalone-store`` (it "
            "contributes 0; a separate ``mooncake_client`` owns the pool); "
            "``null`` checks nothing.",
            coerce_mode,
        ),
    )
    real_client_address: str | None = attrs.field(
        default=None,
        validator=[of_type(str, type(None)), check_optional_host_port],
        metadata=key_help(
            "``host:port`` of the node-level pool's ``mooncake_client`` "
            "(its ``--port``; ``kv-lifecycle pool`` prints it): the "
            "worker's client is then Mooncake's dummy client, which moves "
            "no byte itself. The pool process copies each block between "
            "its memory and the worker's staging buffers in shared memory "
            "(no transfer engine, no TCP); KV caches are always staged. "
            "Needs ``global_segment_size: 0``; ``null``: the worker's "
            "client transfers itself.",
            coerce_optional_str,
        ),
    )
    shm_pool_size: int = attrs.field(
        default=256 * MiB,
        validator=[of_type(int), check_buffer],
        metadata=key_help(
            "With ``real_client_address``: the shared-memory pool the "
            "dummy client maps at set-up for the worker's staging buffers "
            "(Mooncake's ``mem_pool_size``; buffers past it are mapped "
            "as needed).",
            parse_size,
        ),
    )
    log_level: str | None = attrs.field(
        default=None,
        validator=[of_type(str, type(None)), check_log_level],
        metadata=key_help(
            "``MC_LOG_LEVEL`` for the Mooncake client (``TRACE``, ``INFO``, "
            "``WARNING``, ``ERROR``); ``null`` leaves it alone.",
            coerce_level,
        ),
    )

    def __attrs_post_init__(self) -> None:
        """Check ``mode`` against ``global_segment_size``, as vLLM does."""
        segment = self.global_segment_size
        if (self.mode == "embedded" and segment == 0) or (
            self.mode == "standalone-store" and segment != 0
        ):
            need = "> 0" if self.mode == "embedded" else "== 0"
            key = "global_segment_size"
            reason = f"mode {self.mode!r} needs {key} {need}"
            raise ConfigError(key, segment, reason)
        if self.real_client_address is not None and (
            segment != 0 or self.enable_ssd_offload
        ):
            key = "real_client_address"
            reason = (
                "the dummy client contributes no memory and no SSD tier "
                "(the pool process owns both): needs global_segment_size 0 "
                "and enable_ssd_offload false"
            )
            raise ConfigError(key, self.real_client_address, reason)
        self._check_mirror()
        if self.cluster_id is not None and not self.master_ha:
            key = "cluster_id"
            reason = "needs an etcd:// master_server_address (HA masters)"
            raise ConfigError(key, self.cluster_id, reason)

    def _check_mirror(self) -> None:
        """``placement: mirror`` and ``pool_segment`` go together."""
        mirror = self.placement == "mirror"
        if mirror and self.pool_segment is None:
            key = "pool_segment"
            reason = "placement 'mirror' needs the node pool's segment name"
            raise ConfigError(key, None, reason)
        if not mirror and self.pool_segment is not None:
            key = "pool_segment"
            reason = (
                f"only placement 'mirror' uses it (placement is "
                f"{self.placement!r})"
            )
            raise ConfigError(key, self.pool_segment, reason)
        if mirror and (
            self.global_segment_size == 0
            or self.real_client_address is not None
        ):
            key = "placement"
            reason = (
                "mirror keeps a replica in this worker's own segment: "
                "needs global_segment_size > 0 and no real_client_address"
            )
            raise ConfigError(key, self.placement, reason)

    # -- constructors ------------------------------------------------------

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, object],
        *,
        source: str = "config",
        ignore: Collection[str] = (),
    ) -> StoreConfig:
        """Build a config from a flat mapping of keys to values.

        Args:
            values: keys as in the ``MOONCAKE_CONFIG_PATH`` file, plus this
                client's own keys (see the class attributes) and
                ``cache_prefix`` as an alias of ``namespace``.
            source: where the mapping came from, for log messages.
            ignore: further keys to accept silently.

        Raises:
            ConfigError: a required key is missing or a value is bad.
        """
        kwargs = _known_values(values, source=source, ignore=ignore)
        for required in ("master_server_address", "metadata_server"):
            if required not in kwargs:
                reason = f"required key is missing from {source}"
                raise ConfigError(required, None, reason)
        return _build(kwargs, values)

    @classmethod
    def from_extra_config(
        cls,
        extra_config: Mapping[str, Any],
        *,
        ignore: Collection[str] = (),
    ) -> StoreConfig:
        """Build a config from vLLM's ``kv_connector_extra_config``.

        The connector's own keys (``load_async``, ``lookup_rpc_port``, ...)
        are accepted silently; ``cache_prefix`` sets ``namespace``.

        Raises:
            ConfigError: a required key is missing or a value is bad.
        """
        if not isinstance(extra_config, dict):
            key, reason = "kv_connector_extra_config", "expected a dict"
            raise ConfigError(key, extra_config, reason)
        return cls.from_mapping(
            extra_config,
            source="kv_connector_extra_config",
            ignore=CONNECTOR_KEYS | frozenset(ignore),
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StoreConfig:
        """Read a JSON file in the format of vLLM's Mooncake store connector.

        Raises:
            ConfigError: the file is missing, not a JSON object, or has a
                bad value (the key is named).
        """
        return cls.from_mapping(
            _read_json(path, key="path"), source=f"config file {path}"
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """Read the JSON file named by ``MOONCAKE_CONFIG_PATH``.

        Raises:
            ConfigError: the variable is unset (key
                ``MOONCAKE_CONFIG_PATH``) or the file is bad.
        """
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_PATH_ENV, "").strip()
        if not path:
            reason = "environment variable is not set"
            raise ConfigError(CONFIG_PATH_ENV, None, reason)
        return cls.from_mapping(
            _read_json(path, key=CONFIG_PATH_ENV),
            source=f"{CONFIG_PATH_ENV}={path}",
        )

    @classmethod
    def from_vllm(
        cls,
        extra_config: Mapping[str, Any] | None,
        environ: Mapping[str, str] | None = None,
        *,
        ignore: Collection[str] = (),
    ) -> StoreConfig:
        """Load the connector's config: file first, extra config on top.

        The file is named by ``mooncake_config_path`` in the extra config
        or by ``MOONCAKE_CONFIG_PATH``; the store keys of
        ``kv_connector_extra_config`` override its values.

        Raises:
            ConfigError: as ``from_mapping``; a required key must come
                from one of the two sources.
        """
        extra = dict(extra_config or {})
        env = os.environ if environ is None else environ
        merged: dict[str, object] = {}
        path_key, path = (
            "mooncake_config_path",
            extra.get("mooncake_config_path"),
        )
        if path is None and env.get(CONFIG_PATH_ENV, "").strip():
            path_key, path = CONFIG_PATH_ENV, env[CONFIG_PATH_ENV].strip()
        if path is not None:
            if not isinstance(path, str):
                raise ConfigError(path_key, path, "expected a file path")
            merged.update(_read_json(path, key=path_key))
        merged.update(extra)
        return cls.from_mapping(
            merged,
            source="kv_connector_extra_config and MOONCAKE_CONFIG_PATH",
            ignore=CONNECTOR_KEYS | frozenset(ignore),
        )

    # -- derived -----------------------------------------------------------

    @property
    def master_ha(self) -> bool:
        """Whether the address is an ``etcd://`` HA master set."""
        scheme = self.master_server_address[: len(ETCD_SCHEME)]
        return scheme.lower() == ETCD_SCHEME

    @property
    def master_endpoints(self) -> tuple[str, ...]:
        """``host:port`` of the master, or of each etcd endpoint (HA)."""
        return master_endpoints(self.master_server_address)

    @property
    def dummy(self) -> bool:
        """Whether the client is a dummy of a node-level pool process."""
        return self.real_client_address is not None

    @property
    def master_host(self) -> str:
        """The host of the master (HA: of the first etcd endpoint)."""
        return self.master_endpoints[0].rpartition(":")[0].strip("[]")

    @property
    def master_port(self) -> int:
        """The port of the master (HA: of the first etcd endpoint)."""
        return int(self.master_endpoints[0].rpartition(":")[2])

    def without_segment(self) -> StoreConfig:
        """This config for a client of the same store that owns no segment.

        What the scheduler's lookups use.  The keys only a contributing
        worker has are dropped: ``mode`` (its topology check; ``null``)
        and ``placement: mirror`` with ``pool_segment`` (``local``).
        """
        mirror = self.placement == "mirror"
        return attrs.evolve(
            self,
            global_segment_size=0,
            mode=None,
            placement="local" if mirror else self.placement,
            pool_segment=None,
        )

    def client_env(self) -> dict[str, str]:
        """Environment the Mooncake client reads at ``setup()``."""
        env = {
            "MC_RPC_TIMEOUT_MS": str(self.rpc_timeout_ms),
            "MC_STORE_CLIENT_SETUP_RETRIES": str(self.setup_retries),
        }
        if self.log_level is not None:
            env["MC_LOG_LEVEL"] = self.log_level
        if self.master_ha:
            env["MC_STORE_CLUSTER_ID"] = self.cluster_id or "mooncake_cluster"
        return env


_T = TypeVar("_T", bound=attrs.AttrsInstance)


def _read_keys(cls: type[_T], extra: Mapping[str, object]) -> _T:
    """Build ``cls`` from the config keys its fields declare.

    Absent keys take the field's default; values are coerced and validated
    as the fields declare.

    Raises:
        ConfigError: naming the key of a bad value.
    """
    values = {}
    for field in attrs.fields(cls):
        key = config_key(field)
        raw = extra.get(key, field.default)
        values[field.name] = field.metadata["coerce"](key, raw)
    return cls(**values)


@attrs.frozen
class TraceConfig:
    """The connector's lifecycle trace (off by default).

    Read from ``kv_connector_extra_config``: one key per field.
    """

    path: str | None = attrs.field(
        default=None,
        validator=of_type(str, type(None)),
        metadata=key_help(
            "JSONL file the scheduler appends every lifecycle event to; "
            "``{pid}`` in it becomes the process id (one file per engine); "
            '``null`` or ``""`` is off.',
            coerce_path,
            key="lifecycle_trace",
        ),
    )
    max_events: int = attrs.field(
        default=DEFAULT_MAX_EVENTS,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Event lines one connector writes at most; later events are "
            "dropped, counted and logged once.",
            coerce_int,
            key="lifecycle_trace_max_events",
        ),
    )

    def file_for(self, pid: int) -> str | None:
        """The trace file of process `pid`: ``{pid}`` in `path` expanded."""
        return (
            None if self.path is None else self.path.replace("{pid}", str(pid))
        )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> TraceConfig:
        """Read the two trace keys; absent, null or ``""`` turns it off.

        Raises:
            ConfigError: naming the key of a bad value.
        """
        return _read_keys(cls, extra)


DEFAULT_LOOKUP_TIMEOUT_MS: Final = 50
DEFAULT_LOOKUP_MAX_PENDING: Final = 4096
DEFAULT_FAILED_LOAD_TTL_S: Final = 15.0
"""Mooncake's default ``client_ttl`` (10 s), plus the ~1 s the master
takes to drop a dead client's keys, plus margin."""


@attrs.frozen
class LookupConfig:
    """Bounds of the admission lookups (off the scheduler thread).

    Read from ``kv_connector_extra_config``: one key per field.
    """

    timeout_ms: int = attrs.field(
        default=DEFAULT_LOOKUP_TIMEOUT_MS,
        validator=[of_type(int), positive],
        metadata=key_help(
            'Longest a new request is held back (vLLM is answered "cannot '
            'tell yet") while its prefix lookup runs off the scheduler '
            "thread; past it the request is admitted as a miss and computes "
            "locally.",
            coerce_int,
            key="lookup_timeout_ms",
        ),
    )
    max_pending: int = attrs.field(
        default=DEFAULT_LOOKUP_MAX_PENDING,
        validator=[of_type(int), positive],
        metadata=key_help(
            "Most requests held back for lookups at once; beyond it a "
            "request is admitted as a miss at once.",
            coerce_int,
            key="lookup_max_pending",
        ),
    )

    failed_load_ttl_s: float = attrs.field(
        default=DEFAULT_FAILED_LOAD_TTL_S,
        validator=[of_type(float), positive],
        metadata=key_help(
            "Seconds a block whose load failed (a dead peer's block the "
            "master still lists) is not looked up again, unless a lookup "
            "shows the master dropped it first; at least the master's "
            "``client_ttl`` + 1 s.",
            coerce_seconds,
        ),
    )
    wait_ms: float = attrs.field(
        default=0.0,
        validator=of_type(float),
        metadata=key_help(
            "Scheduler-thread time per step spent waiting for lookups, "
            "so a new request is answered in the step it arrives (a "
            "store hit with layer-wise loads, and a cold prompt, then "
            "wait no step at all). Each new request's lookup is sent as "
            "it arrives (``on_new_request``; not one whose prefix vLLM's "
            "cache holds), so a burst's lookups reach the master in a "
            "call or two, and the hooks wait for the answers while the "
            "step's budget lasts; a request not answered by then waits "
            "a step, as with ``0`` (the default: lookups are sent with "
            "the step's batch, no wait). A hung master costs at most "
            "this per step, and nothing once the lookup thread's store "
            "call has run 50 ms, until it returns.",
            coerce_seconds_or_off,
            key="lookup_wait_ms",
        ),
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> LookupConfig:
        """Read the lookup keys (defaults when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        return _read_keys(cls, extra)


@attrs.frozen
class IdentityConfig:
    """The weights a stored block's key names, beyond model and revision.

    Read from ``kv_connector_extra_config``: one key per field.
    """

    weights_version: str = attrs.field(
        default="",
        validator=[of_type(str), check_namespace],
        metadata=key_help(
            "Names the weights this instance serves, when the model name "
            "or path and revision do not (a checkpoint replaced in place, "
            "a fine-tune loaded at start-up); instances share KV only with "
            "equal values. ``reset_cache()`` moves the instance on to a "
            "fresh generation of its own.",
            coerce_str,
        ),
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> IdentityConfig:
        """Read the identity keys (defaults when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        return _read_keys(cls, extra)


DEFAULT_EVENTS_MEDIUM: Final = "MOONCAKE"


@attrs.frozen
class EventsConfig:
    """The store's KV-cache events (published when vLLM's are on).

    Read from ``kv_connector_extra_config``: one key per field.
    """

    medium: str = attrs.field(
        default=DEFAULT_EVENTS_MEDIUM,
        validator=[of_type(str), check_medium],
        metadata=key_help(
            "``medium`` of the store's ``BlockStored`` / ``BlockRemoved`` "
            "events (published with vLLM's ``--kv-events-config``), so a "
            "KV-aware router tells the shared store from an instance's GPU "
            'blocks (``"GPU"``); ``"cpu"`` matches vLLM\'s own '
            "MooncakeStoreConnector.",
            coerce_str,
            key="kv_events_medium",
        ),
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> EventsConfig:
        """Read the events key (default when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        return _read_keys(cls, extra)


DEFAULT_TRANSFER_TIMEOUT_S: Final = 2.0
DEFAULT_PEER_PROBE_S: Final = 1.0


@attrs.frozen
class LoadConfig:
    """Bounds of the loads, and of the peers they come from.

    Read from ``kv_connector_extra_config``: one key per field.
    """

    transfer_timeout: float = attrs.field(
        default=DEFAULT_TRANSFER_TIMEOUT_S,
        validator=of_type(float),
        metadata=key_help(
            "Seconds a load may take, from when the worker takes it; past "
            "it the load is reported failed, vLLM recomputes its blocks, "
            "and a transfer still running can never write into the KV "
            "cache (keys read from other instances' segments land in "
            "staging memory first; keys held only in this instance's own "
            "segment are read zero-copy).  ``0`` turns the bound off (host "
            "KV caches then load zero-copy, unbounded).",
            coerce_seconds_or_off,
        ),
    )
    peer_probe_s: float = attrs.field(
        default=DEFAULT_PEER_PROBE_S,
        validator=of_type(float),
        metadata=key_help(
            "After a load from a peer's segment fails, no request waits on "
            "that segment: its blocks are recomputed at once.  Every this "
            "many seconds one request is let through to probe it; a load "
            "that succeeds lifts the fence.",
            coerce_seconds_or_off,
        ),
    )

    layerwise_load_max_blocks: int = attrs.field(
        default=0,
        validator=[of_type(int), not_negative],
        metadata=key_help(
            "A store hit of at most this many blocks loads layer-wise: vLLM "
            "schedules the request in the step it is admitted (no step "
            "spent in ``WAITING_FOR_REMOTE_KVS``) and the forward pass "
            "waits for the KV before each layer, each wait bounded by "
            "``transfer_timeout`` (past it the blocks are recomputed). "
            "Larger hits (a load that would not hide behind one forward "
            "pass) and every hit of a hybrid model load asynchronously. "
            "A request that ends in the step it loads in (one token, EOS) "
            "has what it computed saved as it finishes. "
            "``0`` (the default), or ``transfer_timeout = 0``: every load "
            "is asynchronous.",
            coerce_int,
        ),
    )

    layerwise_save_blocks: int = attrs.field(
        default=0,
        validator=[of_type(int), not_negative],
        metadata=key_help(
            "Layer-wise saves: a step's saves go to the save thread at the "
            "step's first ``save_kv_layer``, which gathers each layer's KV "
            "into staging as that layer's compute ends and puts each "
            "block's one object once its last layer is in, so a long "
            "prefill's save is mostly done when its forward pass ends. "
            "The save staging holds this many blocks (at least 32; host "
            "KV caches, zero copy otherwise, are staged too): a step's "
            "first this-many saved blocks overlap the forward, the rest "
            "are gathered after it. Blocks stay pinned until saved. "
            "Head-sharded (``store_tp_size``) and hybrid layouts save "
            "layer-wise too, their head shards and KV cache groups "
            "gathered side by side; a replica rank of replicated KV puts "
            "nothing and stages nothing. ``0`` (the default): every save "
            "starts after the "
            "forward pass.",
            coerce_int,
        ),
    )

    @property
    def timeout_s(self) -> float | None:
        """The load deadline in seconds, or None when off."""
        return self.transfer_timeout or None

    @property
    def layerwise_max_blocks(self) -> int:
        """Most blocks of a layer-wise load (0: none; needs a deadline)."""
        if self.timeout_s is None:
            return 0
        return self.layerwise_load_max_blocks

    def transport_env(self) -> dict[str, str]:
        """Mooncake TCP transport bounds to match the deadline.

        A transfer with no progress (or no status frame) for this many
        whole seconds is dropped by the transport itself, so a get or a
        put stuck on a hung peer ends soon after the deadline instead of
        after 30 s (the transport's defaults) or 60 s (the store's own
        wait).  Empty when the deadline is off.
        """
        if self.timeout_s is None:
            return {}
        seconds = str(max(1, math.ceil(self.timeout_s)))
        return {
            "MC_TCP_PROGRESS_TIMEOUT_SEC": seconds,
            "MC_TCP_STATUS_TIMEOUT_SEC": seconds,
        }

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> LoadConfig:
        """Read the load keys (defaults when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        return _read_keys(cls, extra)


def _coerce_store_tp(key: str, value: object) -> int | None:
    """A positive int, or null (no shared layout)."""
    if value is None:
        return None
    number = coerce_int(key, value)
    if number <= 0:
        raise ConfigError(key, value, "must be positive")
    return number


def _coerce_tp_sizes(key: str, value: object) -> tuple[int, ...]:
    """A list of positive ints; null is empty."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ConfigError(key, value, "expected a list of positive integers")
    for size in value:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            reason = "expected a list of positive integers"
            raise ConfigError(key, value, reason)
    return tuple(value)


@attrs.frozen
class ParallelKVConfig:
    """How tensor-parallel ranks lay KV out in the store, and what is saved.

    Read from ``kv_connector_extra_config``: one key per field, spelled as
    vLLM's own ``MooncakeStoreConnector`` spells them.
    """

    store_tp_size: int | None = attrs.field(
        default=None,
        validator=of_type(int, type(None)),
        metadata=key_help(
            "Store KV by KV-head shard: every block is stored as this many "
            "objects, one per slice of ``num_kv_heads / store_tp_size`` "
            "heads, so instances of any TP size dividing it (producers and "
            "consumers alike) share prefixes. Must divide the model's KV "
            "head count and be a multiple of the instance's TP size; "
            "``null`` keeps one object per rank (only equal TP sizes "
            "share).",
            _coerce_store_tp,
        ),
    )
    enable_store_tp_lcm: bool = attrs.field(
        default=False,
        validator=attrs.validators.instance_of(bool),
        metadata=key_help(
            "Take ``store_tp_size`` as the least common multiple of "
            "``prefill_tp_sizes`` (overrides ``store_tp_size``).",
            coerce_bool,
        ),
    )
    prefill_tp_sizes: tuple[int, ...] = attrs.field(
        default=(),
        validator=of_type(tuple),
        metadata=key_help(
            "The TP sizes of the instances that save (e.g. ``[1, 2]``), "
            "read with ``enable_store_tp_lcm``.",
            _coerce_tp_sizes,
        ),
    )
    save_decode_cache: bool = attrs.field(
        default=False,
        validator=attrs.validators.instance_of(bool),
        metadata=key_help(
            "Also save the KV of generated tokens, block by block as each "
            "block fills, so a conversation's next turn (prompt, answer, "
            "new message) hits the answer's blocks. Off: only prompt "
            "blocks are saved.",
            coerce_bool,
        ),
    )

    @property
    def shared_tp(self) -> int | None:
        """The store's TP size (head shards per block), None: per rank.

        Raises:
            ConfigError: ``enable_store_tp_lcm`` without
                ``prefill_tp_sizes``.
        """
        if self.enable_store_tp_lcm:
            if not self.prefill_tp_sizes:
                key, reason = (
                    "prefill_tp_sizes",
                    ("enable_store_tp_lcm needs the prefill TP sizes"),
                )
                raise ConfigError(key, self.prefill_tp_sizes, reason)
            return math.lcm(*self.prefill_tp_sizes)
        return self.store_tp_size

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object]
    ) -> ParallelKVConfig:
        """Read the four keys (defaults when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        config = _read_keys(cls, extra)
        config.shared_tp  # noqa: B018 - validates the LCM inputs
        return config


# The connector's own keys of kv_connector_extra_config (not the store's),
# and the vLLM connector's keys it accepts without implementing them.
CONNECTOR_KEYS: Final = (
    frozenset(
        config_key(f)
        for c in (
            TraceConfig,
            LookupConfig,
            EventsConfig,
            IdentityConfig,
            LoadConfig,
            ParallelKVConfig,
        )
        for f in attrs.fields(c)
    )
    | {"mooncake_config_path"}
    | VLLM_UNIMPLEMENTED_KEYS
    | VLLM_BUILT_IN_KEYS
)


def _known_values(
    values: Mapping[str, object],
    *,
    source: str,
    ignore: Collection[str],
) -> dict[str, object]:
    """Pick StoreConfig fields out of ``values``; warn about the rest."""
    fields = attrs.fields_dict(StoreConfig)
    kwargs: dict[str, object] = {}
    vllm_keys = VLLM_UNIMPLEMENTED_KEYS | VLLM_BUILT_IN_KEYS
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(str(key), value, "keys must be strings")
        name = _ALIASES.get(key, key)
        if name in fields:
            if name in kwargs and kwargs[name] != value:
                reason = f"conflicts with {name!r}={kwargs[name]!r}"
                raise ConfigError(key, value, reason)
            kwargs[name] = value
        elif key in vllm_keys:
            continue  # named below, in one line per kind
        elif key in ignore:
            log.debug("%s: key %r is not a store setting", source, key)
        else:
            log.warning("%s: unknown key %r ignored", source, key)
    name_vllm_keys(values, source)
    return kwargs


def _build(
    kwargs: Mapping[str, object], original: Mapping[str, object]
) -> StoreConfig:
    """Construct, reporting errors under the key the user spelled."""
    spelled = {name: alias for alias, name in _ALIASES.items()}
    coerced: dict[str, Any] = {}
    for name, value in kwargs.items():
        key = (
            spelled[name] if name in spelled and name not in original else name
        )
        coerced[name] = _COERCE[name](key, value)
    try:
        return StoreConfig(**coerced)
    except ConfigError as exc:
        for alias, name in _ALIASES.items():
            if exc.key == name and alias in original:
                raise ConfigError(alias, exc.value, exc.reason) from None
        raise


# Each field's coercion from config values, by field name.
_COERCE: Final[dict[str, Coerce]] = {
    f.name: f.metadata["coerce"] for f in attrs.fields(StoreConfig)
}


def _read_json(path: str | os.PathLike[str], *, key: str) -> dict[str, Any]:
    """Read a JSON object from ``path``; errors name ``key``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        reason = f"cannot read the config file: {exc.strerror or exc}"
        raise ConfigError(key, str(path), reason) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        reason = f"the config file is not valid JSON: {exc}"
        raise ConfigError(key, str(path), reason) from None
    if not isinstance(data, dict):
        reason = "the config file must hold a JSON object"
        raise ConfigError(key, str(path), reason)
    return data
