"""The Mooncake surface this client calls, and how it reaches a master.

``MooncakeStore`` is the subset of ``MooncakeDistributedStore`` the
client uses (a Protocol, so tests can pass a fake); ``_mooncake_store``
imports the real one lazily (an optional, heavy import);
``probe_tcp`` is the one TCP probe of a master's RPC port, used before
a client sets up and by ``EmbeddedMaster.is_ready``.
"""

from __future__ import annotations

import socket
from typing import (
    TYPE_CHECKING,
    Any,
    Protocol,
)

from connector.errors import (
    StoreUnavailable,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from connector.config import StoreConfig


# -- the Mooncake surface we use -------------------------------------------


class MooncakeStore(Protocol):
    """The subset of ``MooncakeDistributedStore`` this client calls."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        engine: object = None,
        enable_ssd_offload: bool = False,  # noqa: FBT002
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,  # noqa: FBT002
        client_http_port: int = 9300,
        /,
    ) -> int: ...

    def setup_dummy(
        self,
        mem_pool_size: int,
        local_buffer_size: int,
        server_address: str,
        /,
    ) -> int: ...

    def alloc_from_mem_pool(self, size: int, /) -> int: ...

    def get_hostname(self) -> str: ...

    def register_buffer(self, buffer_ptr: int, size: int, /) -> int: ...

    def unregister_buffer(self, buffer_ptr: int, /) -> int: ...

    def batch_is_exist(self, keys: list[str], /) -> list[int]: ...

    def batch_put_from(
        self,
        keys: list[str],
        ptrs: list[int],
        sizes: list[int],
        config: Any,
        /,
    ) -> list[int]: ...

    def batch_get_into(
        self, keys: list[str], ptrs: list[int], sizes: list[int], /
    ) -> list[int]: ...

    def batch_put_from_multi_buffers(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        config: Any,
        /,
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        /,
    ) -> list[int]: ...

    def batch_get_session_start(self, keys: list[str], /) -> list[int]: ...

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        ptrs: list[list[int]],
        sizes: list[list[int]],
        src_offsets: list[list[int]],
        /,
    ) -> list[int]: ...

    def batch_get_session_end(self, keys: list[str], /) -> int: ...

    def batch_remove(self, keys: list[str], force: bool, /) -> list[int]: ...

    def remove_all(self, force: bool, /) -> int: ...

    def health_check(self) -> int: ...

    def close(self) -> int: ...


def _mooncake_store() -> tuple[MooncakeStore, Any]:
    """Create a real ``MooncakeDistributedStore`` and a ``ReplicateConfig``."""
    from mooncake.store import (
        MooncakeDistributedStore,
        ReplicateConfig,
    )

    store: MooncakeStore = MooncakeDistributedStore()
    return store, ReplicateConfig()


def _local_address(host: str, port: int) -> str:
    """The local IP address that routes to ``host``."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe_tcp(host: str, port: int, timeout_s: float) -> None:
    """Open and close one TCP connection; raise ``OSError`` if refused."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass


def probe_any(
    address: str,
    endpoints: Sequence[str],
    what: str,
    config: StoreConfig,
) -> None:
    """Fail fast unless one of `endpoints` (``host:port``) accepts TCP.

    Each probe is bounded by ``rpc_timeout_ms`` (at most 2 s).

    Raises:
        StoreUnavailable: for `address`, naming `what` and each
            endpoint's error.
    """
    timeout = min(config.rpc_timeout_ms / 1000, 2.0)
    errors: list[str] = []
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            probe_tcp(host.strip("[]"), int(port), timeout)
        except OSError as exc:
            errors.append(f"{endpoint}: {exc}")
        else:
            return
    reason = f"cannot connect to the {what}: {'; '.join(errors)}"
    raise StoreUnavailable(address, None, reason)


def _probe_master(config: StoreConfig) -> None:
    """Fail fast if nothing accepts TCP connections at the master address.

    An ``etcd://`` (HA) address passes when any of its etcd endpoints
    accepts a connection.
    """
    what = "etcd endpoint" if config.master_ha else "master RPC port"
    probe_any(
        config.master_server_address, config.master_endpoints, what, config
    )
