"""SCAFFOLDING: a file-backed KV connector that proves the engine wiring.

``FileStoreConnector`` saves every full prompt block, whole
(``kv[block_id]``, never single tokens, because the CPU layout differs by
ISA), one safetensors file per block hash holding all layers, and loads
matching prefixes back synchronously. Engine A saves, engine B in another
process loads; the greedy tokens must match, and corrupted files must
change them. It also records what vLLM hands it to a JSON-lines log.

It is deliberately simple (synchronous, no eviction, no async transfer)
and will be replaced by the project's Mooncake-backed connector.

``kv_connector_extra_config`` keys:
    ``store_dir`` (required): the directory of block files;
    ``load`` / ``save`` (default True): which directions are enabled;
    ``log_path`` (optional): where to append the JSON-lines event log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

BLOCK_SUFFIX = ".safetensors"


@dataclasses.dataclass(frozen=True)
class BlockOp:
    """Copy one whole block between the paged cache and a block file."""

    block_id: int
    block_hash: str  # hex


@dataclasses.dataclass
class FileStoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves."""

    loads: list[BlockOp]
    saves: list[BlockOp]


@dataclasses.dataclass
class FileStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what this step stored and loaded."""

    saved: list[str]
    loaded: int
    pid: int

    def aggregate(
        self, other: KVConnectorWorkerMetadata
    ) -> KVConnectorWorkerMetadata:
        """Merge another rank's report into this one."""
        if not isinstance(other, FileStoreWorkerMetadata):
            return self
        return FileStoreWorkerMetadata(
            self.saved + other.saved, self.loaded + other.loaded, self.pid
        )


@dataclasses.dataclass
class _RequestState:
    """Scheduler-side view of one request, for planning saves."""

    request: Request
    block_ids: list[int]
    next_save: int = 0  # index of the first block not yet considered


def block_path(store_dir: Path, block_hash: str) -> Path:
    """The file that holds one block's KV for every layer."""
    return store_dir / f"{block_hash}{BLOCK_SUFFIX}"


def corrupt_store(store_dir: Path, seed: int = 0) -> int:
    """Replace every stored block with seeded noise of the same scale.

    Returns:
        The number of block files rewritten.
    """
    gen = torch.Generator().manual_seed(seed)
    paths = sorted(store_dir.glob(f"*{BLOCK_SUFFIX}"))
    for path in paths:
        tensors = load_file(str(path))
        noisy = {}
        for name, t in tensors.items():
            std = float(t.float().std()) or 1.0
            noise = torch.randn(t.shape, generator=gen) * std
            noisy[name] = noise.to(t.dtype).contiguous()
        save_file(noisy, str(path))
    return len(paths)


class FileStoreConnector(KVConnectorBase_V1):
    """SCAFFOLDING: whole-block KV save/load through a directory of files."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._store = Path(extra["store_dir"])
        self._store.mkdir(parents=True, exist_ok=True)
        self._do_load = bool(extra.get("load", True))
        self._do_save = bool(extra.get("save", True))
        self._log_path = extra.get("log_path")
        self._block_size = vllm_config.cache_config.block_size
        self._role_name = role.name
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        self._local_hit: dict[str, int] = {}
        self._step_loads: list[BlockOp] = []
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self._saved: list[str] = []
        self._loaded = 0
        self._saw_layer = False
        self._log("init", block_size=self._block_size)

    # -- helpers -------------------------------------------------------

    def _log(self, event: str, **fields: Any) -> None:
        if not self._log_path:
            return
        record = {"event": event, "role": self._role_name, "pid": os.getpid()}
        line = json.dumps({**record, **fields}, default=str) + "\n"
        # One O_APPEND write per line: safe across this engine's processes.
        fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def _stored(self, block_hash: str) -> bool:
        return block_path(self._store, block_hash).is_file()

    def _hashes(self, request: Request) -> list[str]:
        return [bytes(h).hex() for h in request.block_hashes]

    # -- scheduler side ------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Record that vLLM bound the block pool (scheduler side)."""
        self._log(
            "bind_gpu_block_pool", num_blocks=gpu_block_pool.num_gpu_blocks
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Count stored full blocks past the local hit; loads are sync.

        At least the prompt's last token is always left to compute.
        """
        self._local_hit[request.request_id] = num_computed_tokens
        if not self._do_load:
            return 0, False
        loadable = (request.num_prompt_tokens - 1) // self._block_size
        hits = 0
        for block_hash in self._hashes(request)[:loadable]:
            if not self._stored(block_hash):
                break
            hits += 1
        external = max(0, hits * self._block_size - num_computed_tokens)
        return external, False

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """Plan the loads of the external blocks into their new ids."""
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0])
        self._requests[req_id] = _RequestState(request, block_ids)
        local = self._local_hit.pop(req_id, 0)
        self._log(
            "alloc",
            req_id=req_id,
            prompt_len=request.num_prompt_tokens,
            local_tokens=local,
            external_tokens=num_external_tokens,
            block_ids=block_ids,
        )
        if num_external_tokens == 0:
            return
        hashes = self._hashes(request)
        first = local // self._block_size
        last = (local + num_external_tokens) // self._block_size
        self._step_loads += [
            BlockOp(block_ids[i], hashes[i]) for i in range(first, last)
        ]

    def _progress(
        self, so: SchedulerOutput
    ) -> list[tuple[_RequestState, int]]:
        """Each scheduled request with its computed tokens after the step."""
        progress: list[tuple[_RequestState, int]] = []
        for new in so.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                after = new.num_computed_tokens
                after += so.num_scheduled_tokens[new.req_id]
                progress.append((state, after))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids += new_ids[0]
            after = cached.num_computed_tokens[i]
            after += so.num_scheduled_tokens[req_id]
            progress.append((state, after))
        return progress

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """Hand this step's loads and the newly full prompt blocks over."""
        saves: list[BlockOp] = []
        planned: set[str] = set()
        progress = self._progress(scheduler_output) if self._do_save else []
        for state, computed in progress:
            prompt_len = state.request.num_prompt_tokens
            full = min(computed, prompt_len) // self._block_size
            hashes = self._hashes(state.request)
            for i in range(state.next_save, full):
                h = hashes[i]
                if h not in planned and not self._stored(h):
                    planned.add(h)
                    saves.append(BlockOp(state.block_ids[i], h))
            state.next_save = max(state.next_save, full)
        meta = FileStoreMetadata(loads=self._step_loads, saves=saves)
        self._step_loads = []
        if meta.loads or meta.saves:
            self._log(
                "build_connector_meta",
                loads=len(meta.loads),
                saves=len(meta.saves),
                has_sync_kv_loads=scheduler_output.has_sync_kv_loads,
            )
        return meta

    def update_connector_output(
        self, connector_output: KVConnectorOutput
    ) -> None:
        """Record whether the worker's metadata reached the scheduler."""
        meta = connector_output.kv_connector_worker_meta
        if meta is not None:
            self._log(
                "worker_meta",
                type=type(meta).__name__,
                saved=len(getattr(meta, "saved", ())),
                loaded=getattr(meta, "loaded", None),
                worker_pid=getattr(meta, "pid", None),
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; blocks are freed at once (saves are sync)."""
        self._requests.pop(request.request_id, None)
        self._local_hit.pop(request.request_id, None)
        self._log(
            "request_finished",
            req_id=request.request_id,
            status=str(request.status),
            nblocks=len(block_ids),
        )
        return False, None

    # -- worker side ---------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged KV tensors; log their shapes for the record."""
        self._kv_caches = dict(kv_caches)
        self._log(
            "register_kv_caches",
            layers={
                name: {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype),
                    "device": str(t.device),
                    "stride": list(t.stride()),
                    "contiguous": t.is_contiguous(),
                }
                for name, t in kv_caches.items()
            },
        )

    def _metadata(self) -> FileStoreMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FileStoreMetadata):
            msg = f"unexpected connector metadata {type(meta).__name__}"
            raise TypeError(msg)
        return meta

    def start_load_kv(
        self, forward_context: ForwardContext, **kwargs: Any
    ) -> None:
        """Copy every planned block file into its block, all layers."""
        del forward_context, kwargs
        meta = self._metadata()
        for op in meta.loads:
            tensors = load_file(str(block_path(self._store, op.block_hash)))
            for name, kv in self._kv_caches.items():
                src = tensors[name]
                if src.shape != kv[op.block_id].shape:
                    msg = (
                        f"block {op.block_hash} layer {name}: stored "
                        f"{tuple(src.shape)}, cache {tuple(kv.shape[1:])}"
                    )
                    raise ValueError(msg)
                kv[op.block_id].copy_(src)
        if meta.loads:
            self._loaded += len(meta.loads)
            self._log(
                "start_load_kv",
                blocks=len(meta.loads),
                before_forward=not self._saw_layer,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads finish inside ``start_load_kv``."""
        del layer_name
        self._saw_layer = True

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        """Stage a copy of each block to save from this layer."""
        del attn_metadata, kwargs
        for op in self._metadata().saves:
            staged = self._staged.setdefault(op.block_hash, {})
            staged[layer_name] = kv_layer[op.block_id].clone()

    def wait_for_save(self) -> None:
        """Write the staged blocks, each atomically as one file."""
        self._saw_layer = False
        for block_hash, layers in self._staged.items():
            fd, tmp = tempfile.mkstemp(dir=self._store, suffix=".tmp")
            os.close(fd)
            save_file(layers, tmp)
            Path(tmp).replace(block_path(self._store, block_hash))
            self._saved.append(block_hash)
        if self._staged:
            self._log("wait_for_save", blocks=len(self._staged))
        self._staged = {}

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """No async transfers: nothing is ever pending."""
        if finished_req_ids:
            self._log("get_finished", finished=sorted(finished_req_ids))
        return None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Report this step's saved hashes and load count, if any."""
        if not self._saved and not self._loaded:
            return None
        meta = FileStoreWorkerMetadata(self._saved, self._loaded, os.getpid())
        self._saved, self._loaded = [], 0
        return meta
