"""vLLM KV connector over the Mooncake store, built on `lifecycle`.

``import connector`` works without vLLM: the vLLM-facing class is loaded
on first access (``connector.MooncakeLifecycleConnector``), which is what
vLLM's ``kv_connector_module_path="connector"`` does.  Installed, the
package registers the class with vLLM by name
(``connector.integration.plugin``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MooncakeLifecycleConnector"]


def __getattr__(name: str) -> Any:
    if name in {"MooncakeLifecycleConnector", "LifecycleConnectorMetadata"}:
        from connector.integration import vllm_connector  # noqa: PLC0415 - lazy on purpose

        return getattr(vllm_connector, name)
    msg = f"module 'connector' has no attribute {name!r}"
    raise AttributeError(msg)
