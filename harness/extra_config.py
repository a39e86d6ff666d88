"""`kv_connector_extra_config` for the connector on an embedded master.

One builder for tests, benchmarks and the e2e tier: `store_extra` gives a
valid extra config (TCP, 64 MiB segment, 16 MiB local buffer, the
caller's namespace) and `LOOPBACK` the settings of an instance that
reaches its master over loopback with short bounds.
"""

from __future__ import annotations

from typing import Any, Final, Protocol


class MasterAddresses(Protocol):
    """What a master must tell a client (`EmbeddedMaster` does)."""

    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        ...

    @property
    def metadata_server(self) -> str:
        """The transfer engine's metadata server URL."""
        ...


LOOPBACK: Final = {
    "local_hostname": "127.0.0.1",
    "rpc_timeout_ms": 2000,
    "setup_retries": 1,
}
"""Extra-config keys for an instance on a loopback master, short bounds."""


def store_extra(
    master: MasterAddresses, namespace: str, **more: Any
) -> dict[str, Any]:
    """A valid extra config for `master` and `namespace`; `more` overrides."""
    return {
        "master_server_address": master.rpc_address,
        "metadata_server": master.metadata_server,
        "protocol": "tcp",
        "global_segment_size": "64MiB",
        "local_buffer_size": "16MiB",
        "namespace": namespace,
        **more,
    }
