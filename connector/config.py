"""Typed, validated configuration of the Mooncake store client.

``StoreConfig`` is built from any of:

- vLLM's ``kv_connector_extra_config`` dict (``from_extra_config``);
- the JSON file named by ``MOONCAKE_CONFIG_PATH``, in the format of vLLM's
  own ``MooncakeStoreConnector`` (``from_file`` / ``from_env``);
- both, the dict overriding the file (``from_vllm``);

Every bad or missing value raises ``ConfigError`` naming the key.
Unknown keys are logged as warnings and otherwise ignored.

Sizes accept ints or strings such as ``"4GB"``, ``"512MiB"``, ``"3.125 gb"``
or ``"1024"``. As in vLLM, ``KB``/``MB``/``GB``/``TB`` are *binary* units:
``"4GB"`` is ``4 * 1024**3`` bytes, the same as ``"4GiB"``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from connector.errors import ConfigError
from lifecycle.trace import DEFAULT_MAX_EVENTS

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

__all__ = [
    "CONFIG_PATH_ENV",
    "StoreConfig",
    "TraceConfig",
    "parse_size",
]

log = logging.getLogger(__name__)

CONFIG_PATH_ENV: Final = "MOONCAKE_CONFIG_PATH"

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB
TiB: Final = 1024 * GiB
MIN_SEGMENT: Final = 16 * MiB  # the smallest segment Mooncake sets up

_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": TiB,
    "tb": TiB,
    "tib": TiB,
}
_SIZE_RE: Final = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

PROTOCOLS: Final = frozenset({"tcp", "rdma", "efa", "cxl", "nvlink", "ascend"})
LOG_LEVELS: Final = frozenset({"TRACE", "INFO", "WARNING", "ERROR"})
_METADATA_SCHEMES: Final = frozenset({"http", "https", "etcd", "redis"})

# Keys of vLLM's kv_connector_extra_config that belong to the connector,
# not to the store: accepted silently by ``from_extra_config``.
CONNECTOR_KEYS: Final = frozenset(
    {
        "load_async",
        "lookup_async",
        "lookup_rpc_port",
        "discard_partial_chunks",
        "enable_cross_layers_blocks",
        "enable_lookup",
        "save_decode_cache",
        "store_tp_size",
        "enable_store_tp_lcm",
        "prefill_tp_sizes",
        "enable_group_semantics",
        "custom_mem_pool",
        "mooncake_config_path",
        "lifecycle_trace",
        "lifecycle_trace_max_events",
        "lookup_timeout_ms",
        "lookup_max_pending",
        "failed_load_ttl_s",
    }
)
# Keys that vLLM's or Mooncake's own loaders understand but this client
# does not implement: warned about specifically.
UNSUPPORTED_KEYS: Final = frozenset(
    {
        "mode",
        "enable_offload",
        "enable_ssd_offload",
        "ssd_offload_path",
        "tenant_id",
        "enable_client_http_server",
        "client_http_port",
        "transfer_timeout",
    }
)
# vLLM's extra config names the namespace ``cache_prefix``.
_ALIASES: Final[dict[str, str]] = {"cache_prefix": "namespace"}


def parse_size(key: str, value: object) -> int:
    """Parse a byte size given as an int or a string like ``"512MiB"``.

    Raises:
        ConfigError: naming ``key`` if ``value`` is not a non-negative
            whole number of bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected a size, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, value, "a size cannot be negative")
        return value
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise ConfigError(key, value, "expected a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        reason = "expected an int or a string such as '4GB' or '512MiB'"
        raise ConfigError(key, value, reason)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        reason = "expected a size such as 4GB, 512MiB, 64MB or 1048576"
        raise ConfigError(key, value, reason)
    try:
        amount = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex excludes it
        reason = "not a number"
        raise ConfigError(key, value, reason) from None
    if amount != amount.to_integral_value():
        raise ConfigError(key, value, "not a whole number of bytes")
    return int(amount)


def _coerce_size(key: str, value: object) -> int:
    return parse_size(key, value)


def _coerce_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, value, "expected an integer")
    return value


def _coerce_str(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(key, value, "expected a string")
    return value.strip()


def _coerce_level(key: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(key, value, "expected a string or null")
    return value.strip().upper()


_Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]


def _of_type(*types: type) -> _Validator:
    """Attrs validator: ``isinstance`` check raising ``ConfigError``."""
    names = " or ".join(
        "null" if t is type(None) else t.__name__ for t in types
    )

    def check(_: object, field: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, types):
            raise ConfigError(field.name, value, f"expected {names}")

    return check


def _split_host_port(key: str, value: str, *, need_port: bool) -> None:
    """Validate ``host[:port]`` (``[v6]:port`` allowed)."""
    if not value:
        raise ConfigError(key, value, "must not be empty")
    if "://" in value or "/" in value:
        raise ConfigError(key, value, "expected host:port without a scheme")
    host, sep, port = value.rpartition(":")
    if not sep or (host.startswith("[") != host.endswith("]")):
        host, port = value, ""
    if not host or host == "[]":
        raise ConfigError(key, value, "the host part is empty")
    if not port:
        if need_port:
            raise ConfigError(key, value, "expected host:port (port missing)")
        return
    if not port.isdigit() or not 1 <= int(port) <= 65535:  # noqa: PLR2004
        raise ConfigError(key, value, "the port must be 1..65535")


def _check_master_address(
    _: object, field: attrs.Attribute[str], value: str
) -> None:
    _split_host_port(field.name, value, need_port=True)


def _check_local_hostname(
    _: object, field: attrs.Attribute[str], value: str
) -> None:
    if value:
        _split_host_port(field.name, value, need_port=False)


def _check_metadata_server(
    _: object, field: attrs.Attribute[str], value: str
) -> None:
    key = field.name
    if not value:
        raise ConfigError(key, value, "must not be empty")
    if value == "P2PHANDSHAKE":
        return
    scheme, sep, rest = value.partition("://")
    if not sep:
        # Bare "host:port" means an etcd endpoint to Mooncake.
        _split_host_port(key, value, need_port=True)
        return
    if scheme.lower() not in _METADATA_SCHEMES:
        reason = (
            "expected P2PHANDSHAKE, host:port (etcd) or an "
            "http://, https://, etcd:// or redis:// URL"
        )
        raise ConfigError(key, value, reason)
    if not rest.split("/", 1)[0]:
        raise ConfigError(key, value, "the URL has no host")


def _check_protocol(
    _: object, field: attrs.Attribute[str], value: str
) -> None:
    if value not in PROTOCOLS:
        reason = f"expected one of {sorted(PROTOCOLS)}"
        raise ConfigError(field.name, value, reason)


def _check_segment(_: object, field: attrs.Attribute[int], value: int) -> None:
    # NOTE(reliab): Mooncake 0.3.13's setup() fails with -600 for a segment
    # under 16 MiB; say so here instead of as an unreachable master.
    if value != 0 and not MIN_SEGMENT <= value <= TiB:
        reason = "must be 0 (pure client) or between 16 MiB and 1 TiB"
        raise ConfigError(field.name, value, reason)


def _check_buffer(_: object, field: attrs.Attribute[int], value: int) -> None:
    if value > TiB:
        raise ConfigError(field.name, value, "must be at most 1 TiB")


def _positive(_: object, field: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ConfigError(field.name, value, "must be positive")


def _check_namespace(
    _: object, field: attrs.Attribute[str], value: str
) -> None:
    if len(value) > 128:  # noqa: PLR2004
        raise ConfigError(field.name, value, "at most 128 characters")
    if any(not ch.isprintable() for ch in value):
        raise ConfigError(field.name, value, "must be printable text")


def _check_log_level(
    _: object, field: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None and value not in LOG_LEVELS:
        reason = f"expected one of {sorted(LOG_LEVELS)} or null"
        raise ConfigError(field.name, value, reason)


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

    Attributes:
        master_server_address: ``host:port`` of ``mooncake_master`` RPC.
        metadata_server: transfer-engine metadata, e.g.
            ``http://host:8080/metadata`` or ``P2PHANDSHAKE``.
        protocol: ``tcp`` or ``rdma`` (``efa``, ... pass through).
        device_name: RDMA NIC list (``""`` for TCP or auto-discovery).
        global_segment_size: bytes this client contributes to the pool
            (0 = pure client).
        local_buffer_size: client staging buffer (unused by zero-copy
            calls, but allocated).
        local_hostname: ``ip`` or ``ip:port`` this client is reached at;
            ``""`` picks the local address that routes to the master.
        namespace: cache prefix; keys of different namespaces never meet
            (``cache_prefix`` in vLLM's extra config).
        rpc_timeout_ms: bound of one master RPC, ``MC_RPC_TIMEOUT_MS``.
        setup_retries: ``MC_STORE_CLIENT_SETUP_RETRIES`` (setup bound).
        breaker_probe_ms: how often an open circuit breaker lets one call
            through to test whether the master is back.
        close_timeout_ms: bound of ``close()``.
        replica_num: memory replicas per object (best effort).
        log_level: ``MC_LOG_LEVEL`` for the client (``None`` leaves it).
    """

    master_server_address: str = attrs.field(
        validator=[_of_type(str), _check_master_address],
    )
    metadata_server: str = attrs.field(
        validator=[_of_type(str), _check_metadata_server],
    )
    protocol: str = attrs.field(
        default="rdma",
        validator=[_of_type(str), _check_protocol],
    )
    device_name: str = attrs.field(
        default="",
        validator=_of_type(str),
    )
    global_segment_size: int = attrs.field(
        default=4 * GiB,
        validator=[_of_type(int), _check_segment],
    )
    local_buffer_size: int = attrs.field(
        default=4 * GiB,
        validator=[_of_type(int), _check_buffer],
    )
    local_hostname: str = attrs.field(
        default="",
        validator=[_of_type(str), _check_local_hostname],
    )
    namespace: str = attrs.field(
        default="",
        validator=[_of_type(str), _check_namespace],
    )
    rpc_timeout_ms: int = attrs.field(
        default=5000,
        validator=[_of_type(int), _positive],
    )
    setup_retries: int = attrs.field(
        default=3,
        validator=[_of_type(int), _positive],
    )
    breaker_probe_ms: int = attrs.field(
        default=1000,
        validator=[_of_type(int), _positive],
    )
    close_timeout_ms: int = attrs.field(
        default=5000,
        validator=[_of_type(int), _positive],
    )
    replica_num: int = attrs.field(
        default=1,
        validator=[_of_type(int), _positive],
    )
    log_level: str | None = attrs.field(
        default=None,
        validator=[_of_type(str, type(None)), _check_log_level],
    )

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
    def master_host(self) -> str:
        """The host part of ``master_server_address``."""
        return self.master_server_address.rpartition(":")[0].strip("[]")

    @property
    def master_port(self) -> int:
        """The port part of ``master_server_address``."""
        return int(self.master_server_address.rpartition(":")[2])

    def client_env(self) -> dict[str, str]:
        """Environment the Mooncake client reads at ``setup()``."""
        env = {
            "MC_RPC_TIMEOUT_MS": str(self.rpc_timeout_ms),
            "MC_STORE_CLIENT_SETUP_RETRIES": str(self.setup_retries),
        }
        if self.log_level is not None:
            env["MC_LOG_LEVEL"] = self.log_level
        return env


@attrs.frozen
class TraceConfig:
    """The connector's lifecycle trace (off by default).

    Read from ``kv_connector_extra_config`` keys ``lifecycle_trace`` (a
    JSONL file the scheduler appends every lifecycle event to; ``{pid}``
    in it becomes the process id, one file per engine) and
    ``lifecycle_trace_max_events`` (event lines written at most; later
    events are dropped, counted and logged once).

    Attributes:
        path: The trace file, or None when tracing is off.
        max_events: The bound on event lines (positive).
    """

    path: str | None = None
    max_events: int = DEFAULT_MAX_EVENTS

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
        key = "lifecycle_trace"
        path = extra.get(key)
        if path is not None and not isinstance(path, str):
            raise ConfigError(key, path, "expected a file path")
        key = "lifecycle_trace_max_events"
        raw = extra.get(key, DEFAULT_MAX_EVENTS)
        max_events = _coerce_int(key, raw)
        if max_events <= 0:
            raise ConfigError(key, raw, "must be positive")
        return cls((path or "").strip() or None, max_events)


DEFAULT_LOOKUP_TIMEOUT_MS: Final = 50
DEFAULT_LOOKUP_MAX_PENDING: Final = 4096


@attrs.frozen
class LookupConfig:
    """Bounds of the admission lookups (off the scheduler thread).

    Read from ``kv_connector_extra_config`` keys ``lookup_timeout_ms``
    (longest a request is held back for its store lookup before it is
    admitted as a miss) and ``lookup_max_pending`` (most requests held
    back at once; beyond it a request is admitted as a miss at once).

    Attributes:
        timeout_ms: The hold-back bound, positive.
        max_pending: The bound on requests held back, positive.
    """

    timeout_ms: int = DEFAULT_LOOKUP_TIMEOUT_MS
    max_pending: int = DEFAULT_LOOKUP_MAX_PENDING

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> LookupConfig:
        """Read the two lookup keys (defaults when absent).

        Raises:
            ConfigError: naming the key of a bad value.
        """
        values = []
        for key, default in (
            ("lookup_timeout_ms", DEFAULT_LOOKUP_TIMEOUT_MS),
            ("lookup_max_pending", DEFAULT_LOOKUP_MAX_PENDING),
        ):
            raw = extra.get(key, default)
            value = _coerce_int(key, raw)
            if value <= 0:
                raise ConfigError(key, raw, "must be positive")
            values.append(value)
        return cls(*values)


def _known_values(
    values: Mapping[str, object],
    *,
    source: str,
    ignore: Collection[str],
) -> dict[str, object]:
    """Pick StoreConfig fields out of ``values``; warn about the rest."""
    fields = attrs.fields_dict(StoreConfig)
    kwargs: dict[str, object] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(str(key), value, "keys must be strings")
        name = _ALIASES.get(key, key)
        if name in fields:
            if name in kwargs and kwargs[name] != value:
                reason = f"conflicts with {name!r}={kwargs[name]!r}"
                raise ConfigError(key, value, reason)
            kwargs[name] = value
        elif key in ignore:
            log.debug("%s: key %r is not a store setting", source, key)
        elif key in UNSUPPORTED_KEYS:
            log.warning(
                "%s: key %r is not supported by this store client; ignored",
                source,
                key,
            )
        else:
            log.warning("%s: unknown key %r ignored", source, key)
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
        coerced[name] = _COERCE.get(name, _keep)(key, value)
    try:
        return StoreConfig(**coerced)
    except ConfigError as exc:
        for alias, name in _ALIASES.items():
            if exc.key == name and alias in original:
                raise ConfigError(alias, exc.value, exc.reason) from None
        raise


def _keep(_: str, value: object) -> object:
    return value


_COERCE: Final[dict[str, Callable[[str, object], object]]] = {
    "master_server_address": _coerce_str,
    "metadata_server": _coerce_str,
    "protocol": _coerce_str,
    "device_name": _coerce_str,
    "global_segment_size": _coerce_size,
    "local_buffer_size": _coerce_size,
    "local_hostname": _coerce_str,
    "namespace": _coerce_str,
    "rpc_timeout_ms": _coerce_int,
    "setup_retries": _coerce_int,
    "breaker_probe_ms": _coerce_int,
    "close_timeout_ms": _coerce_int,
    "replica_num": _coerce_int,
    "log_level": _coerce_level,
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
