"""Keys of vLLM's own ``MooncakeStoreConnector`` and how this one treats them.

One extra config (or ``MOONCAKE_CONFIG_PATH`` file) serves both
connectors, so every key of vLLM's is accepted: those whose behaviour this
connector always has are named in one INFO line, those it does not
implement in one WARNING, so a deployment relying on one sees it at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Mapping

log: Final = logging.getLogger("connector.config")

# Keys of vLLM's own MooncakeStoreConnector that select a behaviour this
# connector has built in, whatever the value: loads always asynchronous,
# lookups always off the scheduler thread (no lookup server), only full
# blocks saved, the block layout chosen from the KV tensors, loads
# zero-copy (no disk staging buffer).  Accepted, named in one INFO line.
VLLM_BUILT_IN_KEYS: Final = frozenset(
    {
        "load_async",
        "lookup_async",
        "lookup_rpc_port",
        "discard_partial_chunks",
        "enable_cross_layers_blocks",
        "enable_offload",
    }
)
# Keys of vLLM's own MooncakeStoreConnector that this connector does not
# implement: accepted (one extra config serves both connectors) and named
# in one warning when a config is read.
VLLM_UNIMPLEMENTED_KEYS: Final = frozenset(
    {
        "enable_lookup",
        "enable_group_semantics",
        "custom_mem_pool",
    }
)


def name_vllm_keys(values: Mapping[str, object], source: str) -> None:
    """One INFO line for built-in vLLM keys, one WARNING for the rest."""
    built_in = sorted(k for k in values if k in VLLM_BUILT_IN_KEYS)
    if built_in:
        log.info(
            "%s: keys of vLLM's MooncakeStoreConnector whose behaviour this "
            "connector has built in, no effect: %s",
            source,
            ", ".join(built_in),
        )
    unimplemented = sorted(k for k in values if k in VLLM_UNIMPLEMENTED_KEYS)
    if unimplemented:
        log.warning(
            "%s: keys of vLLM's MooncakeStoreConnector that this connector "
            "does not implement, ignored: %s",
            source,
            ", ".join(unimplemented),
        )
