"""A deliberately naive, dict-backed vLLM 0.33 KV connector.

`ReferenceConnector` saves every full prompt block, keyed by vLLM's chained
block hash, into a process-global dict that stands in for a remote store,
and loads hits back into freshly allocated blocks.
It validates `tests/vllm_harness.py` and is the "naive connector" baseline
for regression tests: plain dicts and no lifecycle, but correct under the
orderings the harness produces.

Its two halves share state only through the per-step metadata and the
store dict, as vLLM's scheduler and worker processes would:

- Scheduler side: `get_num_new_matched_tokens` counts the leading prompt
  blocks whose hash is in the store; `update_state_after_alloc` queues a
  load into the allocated blocks; `build_connector_meta` ships loads plus
  saves of prompt blocks that become full in this step.
- Worker side: `start_load_kv` copies stored blocks into the paged KV
  tensors; `save_kv_layer` copies each full block of the layer it is
  handed; `wait_for_save` publishes complete blocks to the store;
  `get_finished` reports async loads as received in the same step.

`kv_connector_extra_config` keys:

- `store` (str, default `"default"`): name of the store namespace, so that
  tests do not see each other's blocks.
- `load_async` (bool, default True): load asynchronously (the request
  waits in `WAITING_FOR_REMOTE_KVS` for one step) or synchronously.

Importing this module imports vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: store name -> block hash -> layer name -> one block's KV (a CPU copy).
STORES: dict[str, dict[bytes, dict[str, torch.Tensor]]] = {}


def get_store(name: str) -> dict[bytes, dict[str, torch.Tensor]]:
    """Return the named store, creating it empty on first use."""
    return STORES.setdefault(name, {})


@dataclasses.dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save, with their block hashes."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    is_async: bool = False


@dataclasses.dataclass
class ReferenceMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


class ReferenceConnector(KVConnectorBase_V1):
    """Dict-backed store connector; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = self._kv_transfer_config
        self._store = get_store(
            str(cfg.get_from_extra_config("store", "default"))
        )
        self._load_async = bool(
            cfg.get_from_extra_config("load_async", default=True)
        )
        self._saves = cfg.is_kv_producer
        self._block_size = vllm_config.cache_config.block_size
        # Scheduler side.
        self._local_hits: dict[str, int] = {}
        self._requests: dict[str, Request] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._num_saved_blocks: dict[str, int] = {}
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._staged: dict[bytes, dict[str, torch.Tensor]] = {}
        self._recved: set[str] = set()
        self._load_errors: set[int] = set()

    # --------------------------------------------------------------- scheduler

    def _hit_tokens(self, request: Request) -> int:
        """Leading tokens whose blocks are all in the store.

        At least one token is always left to compute, and hits stay
        block-aligned.
        """
        limit = int(request.num_tokens - 1) // self._block_size
        hits = 0
        for block_hash in request.block_hashes[:limit]:
            if bytes(block_hash) not in self._store:
                break
            hits += 1
        return hits * self._block_size

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Return the store hit beyond `num_computed_tokens`; idempotent."""
        self._local_hits[request.request_id] = num_computed_tokens
        extra = self._hit_tokens(request) - num_computed_tokens
        if extra <= 0:
            return 0, False
        return extra, self._load_async

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """Queue a load of `num_external_tokens` into the allocated blocks."""
        self._requests[request.request_id] = request
        if num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        first = self._local_hits[request.request_id] // self._block_size
        last = first + num_external_tokens // self._block_size
        self._pending_loads.append(
            BlockTransfer(
                req_id=request.request_id,
                block_ids=tuple(block_ids[first:last]),
                block_hashes=tuple(
                    bytes(h) for h in request.block_hashes[first:last]
                ),
                is_async=self._load_async,
            )
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> ReferenceMetadata:
        """Ship this step's loads, and saves of newly full prompt blocks."""
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._num_saved_blocks.pop(req_id, None)
        meta = ReferenceMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self._saves:
            return meta
        block_state = scheduler_output.kv_connector_block_state
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or block_state is None:
                continue
            computed = request.num_computed_tokens + num_new
            full = min(computed, request.num_prompt_tokens) // self._block_size
            start = self._num_saved_blocks.get(req_id, 0)
            if full <= start:
                continue
            self._num_saved_blocks[req_id] = full
            tables = block_state.get_block_ids(req_id)
            block_ids: list[int] = tables[0] if tables else []
            todo = [
                (block_ids[i], bytes(request.block_hashes[i]))
                for i in range(start, full)
                if bytes(request.block_hashes[i]) not in self._store
            ]
            if todo:
                ids, hashes = zip(*todo, strict=True)
                meta.saves.append(BlockTransfer(req_id, ids, hashes))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are published in the step that computes them: free now."""
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._local_hits.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._num_saved_blocks.pop(req_id, None)

    # ------------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the paged KV tensors, one per layer."""
        self._kv_caches = dict(kv_caches)

    def _meta(self) -> ReferenceMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ReferenceMetadata):
            msg = f"unexpected connector metadata {type(meta).__name__}"
            raise TypeError(msg)
        return meta

    def start_load_kv(
        self, forward_context: ForwardContext, **kwargs: Any
    ) -> None:
        """Copy every stored block of this step's loads into its KV block."""
        for load in self._meta().loads:
            for block_id, block_hash in zip(
                load.block_ids, load.block_hashes, strict=True
            ):
                stored = self._store.get(block_hash)
                if stored is None:
                    self._load_errors.add(block_id)
                    continue
                for name, kv in self._kv_caches.items():
                    kv[block_id].copy_(self._loaded_value(stored[name]))
            if load.is_async:
                self._recved.add(load.req_id)

    def _loaded_value(self, stored: torch.Tensor) -> torch.Tensor:
        """Return what a load writes for a stored block (a test hook)."""
        return stored

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are done in `start_load_kv`; nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Copy this layer's part of every block saved in this step."""
        for save in self._meta().saves:
            for block_id, block_hash in zip(
                save.block_ids, save.block_hashes, strict=True
            ):
                staged = self._staged.setdefault(block_hash, {})
                staged[layer_name] = kv_layer[block_id].clone()

    def wait_for_save(self) -> None:
        """Publish the blocks staged in this step, all layers at once."""
        for block_hash, layers in self._staged.items():
            if layers.keys() == self._kv_caches.keys():
                self._store.setdefault(block_hash, layers)
        self._staged = {}

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """Report async loads as received; nothing is ever sent late."""
        done, self._recved = self._recved, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose hash vanished from the store; reported once."""
        errors, self._load_errors = self._load_errors, set()
        return errors


class CorruptingConnector(ReferenceConnector):
    """Loads every stored block with 0.5 added: the harness must notice."""

    def _loaded_value(self, stored: torch.Tensor) -> torch.Tensor:
        return stored + 0.5


class NeverSendsConnector(ReferenceConnector):
    """Keeps every finished request's blocks and never reports them sent."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        super().request_finished(request, block_ids)
        return bool(block_ids), None
