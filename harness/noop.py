"""A KV connector whose hooks do nothing.

The cost of vLLM's connector plumbing alone: the baseline of
`benchmarks.scheduler_step`, `benchmarks.admission` and `benchmarks.soak`.

vLLM loads it by name (``harness.noop.NoopConnector``).  Importing this
module imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: The name vLLM loads it by.
NOOP_CONNECTOR = "harness.noop.NoopConnector"


class NoopMetadata(KVConnectorMetadata):
    """An empty step."""


class NoopConnector(KVConnectorBase_V1):
    """Does nothing: the cost of vLLM's connector plumbing alone."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """No external hits."""
        return 0, False

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """Nothing to remember."""

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """An empty step."""
        return NoopMetadata()

    def start_load_kv(
        self, forward_context: ForwardContext, **kwargs: Any
    ) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""
