"""A deliberately naive, dict-backed vLLM 0.33 KV connector.

`ReferenceConnector` saves every full prompt block, keyed by vLLM's chained
block hash, into a process-global dict that stands in for a remote store,
and loads hits back into freshly allocated blocks.
It validates `harness/scheduler.py` and is the "naive connector" baseline
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
        self._note_alloc(request, blocks, num_external_tokens)
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

    def _note_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        """Hook run first by `update_state_after_alloc` (for variants)."""

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> ReferenceMetadata:
        """Ship this step's loads, and saves of newly full prompt blocks."""
        self._note_step(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._num_saved_blocks.pop(req_id, None)
        meta = ReferenceMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self._saves:
            self._add_saves(scheduler_output, meta)
        return self._step_meta(scheduler_output, meta)

    def _note_step(self, scheduler_output: SchedulerOutput) -> None:
        """Hook run first by `build_connector_meta` (for variants)."""

    def _step_meta(
        self, scheduler_output: SchedulerOutput, meta: ReferenceMetadata
    ) -> ReferenceMetadata:
        """Hook: the metadata `build_connector_meta` ships (for variants)."""
        del scheduler_output
        return meta

    def _add_saves(
        self, scheduler_output: SchedulerOutput, meta: ReferenceMetadata
    ) -> None:
        """Append saves of the prompt blocks that become full this step."""
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            computed = request.num_computed_tokens + num_new
            full = min(computed, request.num_prompt_tokens) // self._block_size
            start = self._num_saved_blocks.get(req_id, 0)
            if full <= start:
                continue
            self._num_saved_blocks[req_id] = full
            block_ids = self._block_table(scheduler_output, req_id)
            todo = [
                (block_ids[i], bytes(request.block_hashes[i]))
                for i in range(start, full)
                if bytes(request.block_hashes[i]) not in self._store
            ]
            if todo:
                ids, hashes = zip(*todo, strict=True)
                meta.saves.append(BlockTransfer(req_id, ids, hashes))

    def _block_table(
        self, scheduler_output: SchedulerOutput, req_id: str
    ) -> list[int]:
        """The request's block table, as vLLM's scheduler holds it."""
        block_state = scheduler_output.kv_connector_block_state
        tables = block_state.get_block_ids(req_id) if block_state else None
        return list(tables[0]) if tables else []

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are published in the step that computes them: free now.

        Variants decide otherwise in `_delay_free`.
        """
        self._forget(request.request_id)
        return self._delay_free(request, block_ids), None

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        """Hook: whether `request_finished` delays freeing the blocks."""
        del request, block_ids
        return False

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
        self._stage(layer_name, kv_layer)

    def _stage(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy `kv_layer`'s part of this step's saves for `wait_for_save`."""
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
        """Report async loads as received; variants report sends."""
        done, self._recved = self._recved, set()
        return self._sent(finished_req_ids, done) or None, done or None

    def _sent(self, finished_req_ids: set[str], recving: set[str]) -> set[str]:
        """Hook: ids `get_finished` reports sent; nothing is ever sent late."""
        del finished_req_ids, recving
        return set()

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

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        return bool(block_ids)


# --------------------------------------------------------- naive variants
#
# Each class below has exactly one ordering bug that vLLM KV connectors
# have shipped with (the vLLM issue is named in its docstring), in the
# shape the original connector had it; tests/test_ordering_regressions.py
# shows that vLLM's real scheduler (or a racing worker) trips it.


class StoreError(ConnectionError):
    """A transient store failure (the stand-in for a Mooncake RPC error)."""


@dataclasses.dataclass
class NaiveMetadata(ReferenceMetadata):
    """`ReferenceMetadata` plus the ids whose send completion is owed."""

    sends: list[str] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)


class PopsTrackerConnector(ReferenceConnector):
    """vLLM #43281 / vllm-ascend#3721 / #56780: `rf` asserts a tracker.

    The tracker is made at the first lookup and popped when the request is
    preempted, so `request_finished` for a request aborted before it was
    ever looked up, or while it is preempted, fails its assert.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trackers: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._trackers.setdefault(request.request_id, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _note_step(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.preempted_req_ids or ():
            self._trackers.pop(req_id, None)

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        tracker = self._trackers.pop(request.request_id, None)
        assert tracker is not None, f"no tracker for {request.request_id}"
        return super()._delay_free(request, block_ids)


class AbortNeedsWorkerEngineConnector(ReferenceConnector):
    """LMCache#3337 / #3499: the abort path asserts a worker-only engine."""

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        if request.status.name == "FINISHED_ABORTED":
            assert self._kv_caches, "engine exists only on workers"
        return super()._delay_free(request, block_ids)


class CoQueuesLoadAndSaveConnector(ReferenceConnector):
    """vLLM #43371 / #46240: a loaded request also queues a save of it.

    `request_finished` delays freeing while that save is pending, and the
    worker reports the request in both `finished_recving` and
    `finished_sending` in the same step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._co_queued: set[str] = set()

    def _note_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        if num_external_tokens:
            self._co_queued.add(request.request_id)

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        pending = request.request_id in self._co_queued
        self._co_queued.discard(request.request_id)
        return pending

    def _sent(self, finished_req_ids: set[str], recving: set[str]) -> set[str]:
        return set(recving)


class DelayFreeConnector(ReferenceConnector):
    """Finishing requests wait for a flush of their KV to the store.

    `request_finished` returns delay-free when it owes a send; the worker
    runs the flush in the next step and reports the id as sent one step
    later (an async store thread).  Correct on its own; the variants below
    each break one step of this protocol.
    """

    lag = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sends: list[str] = []
        self._in_flight: list[list[str]] = []

    # scheduler side
    def _step_meta(
        self, scheduler_output: SchedulerOutput, meta: ReferenceMetadata
    ) -> NaiveMetadata:
        sends, self._sends = self._sends, []
        return NaiveMetadata(loads=meta.loads, saves=meta.saves, sends=sends)

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        if not block_ids:
            return False
        self._sends.append(request.request_id)
        return self._delay

    _delay = True

    # worker side
    def _flush(self, req_id: str) -> bool:
        """Flush a finished request's KV; True when it is done."""
        del req_id
        return True

    def _sent(self, finished_req_ids: set[str], recving: set[str]) -> set[str]:
        meta = self._get_connector_metadata()
        sends = meta.sends if isinstance(meta, NaiveMetadata) else []
        self._in_flight.append(list(sends))
        sent: set[str] = set()
        while len(self._in_flight) > self.lag:
            for req_id in self._in_flight.pop(0):
                try:
                    if self._flush(req_id):
                        sent.add(req_id)
                except StoreError:
                    pass  # logged and forgotten, as the bug did
        return sent


class LeaksOnStoreErrorConnector(DelayFreeConnector):
    """vLLM #43742 / #40344: a store error skips the pending-count release.

    The flush raises between counter++ and counter--; the request is never
    reported sent, so its delay-freed blocks are never returned.
    """

    def _flush(self, req_id: str) -> bool:
        msg = f"batch_is_exist failed for {req_id}"
        raise StoreError(msg)


class ReportsFreedRequestsConnector(DelayFreeConnector):
    """vLLM #43226 / LMCache#4185 / vllm-ascend#6570: completion after free.

    `request_finished` lets vLLM free the request at once, but the async
    flush still reports it sent a step later, when vLLM no longer has it.
    """

    _delay = False


class SendsBeforeFinishConnector(ReferenceConnector):
    """vLLM #26929: "finished sending" for a request that has not finished.

    Each save is reported sent in the next step, whether or not the
    request finished, and `request_finished` delays freeing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saved: set[str] = set()

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        return bool(block_ids)

    def wait_for_save(self) -> None:
        self._saved |= {s.req_id for s in self._meta().saves}
        super().wait_for_save()

    def _sent(self, finished_req_ids: set[str], recving: set[str]) -> set[str]:
        sent, self._saved = self._saved, set()
        return sent


class SpinsOnPushWorkConnector(ReferenceConnector):
    """vllm-ascend#16185: pending send events with no request map.

    Every save registers an event keyed by event id; events complete only
    when their request is scheduled again, so those of a request that
    finishes or is preempted right after a save never do, and
    `has_pending_push_work()` stays True: the engine spins forever.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._events: dict[int, str] = {}
        self._next_event = 0

    def _note_step(self, scheduler_output: SchedulerOutput) -> None:
        scheduled = set(scheduler_output.num_scheduled_tokens)
        self._events = {
            e: r for e, r in self._events.items() if r not in scheduled
        }

    def _step_meta(
        self, scheduler_output: SchedulerOutput, meta: ReferenceMetadata
    ) -> ReferenceMetadata:
        for save in meta.saves:
            self._events[self._next_event] = save.req_id
            self._next_event += 1
        return meta

    def has_pending_push_work(self) -> bool:
        return bool(self._events)


class AppendsOnResumeConnector(ReferenceConnector):
    """vLLM #46595 / LMCache#2069: a resume appends to the block table.

    It keeps its own block tables and extends them for every scheduled
    cached request, ignoring `resumed_req_ids`; after a preemption, saves
    read the old, freed blocks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tables: dict[str, list[int]] = {}

    def _note_step(self, scheduler_output: SchedulerOutput) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(
            cached.req_ids, cached.new_block_ids, strict=True
        ):
            if new_ids:
                self._tables.setdefault(req_id, []).extend(new_ids[0])

    def _block_table(
        self, scheduler_output: SchedulerOutput, req_id: str
    ) -> list[int]:
        return self._tables.get(req_id, [])


class ZeroExternalDropsBlocksConnector(ReferenceConnector):
    """vLLM #54643: `num_external_tokens == 0` records an empty table.

    Saves index the table recorded at allocation, which is empty for a
    request that loaded nothing: `IndexError`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._alloc_tables: dict[str, list[int]] = {}

    def _note_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        self._alloc_tables[request.request_id] = (
            list(blocks.get_block_ids()[0]) if num_external_tokens else []
        )

    def _block_table(
        self, scheduler_output: SchedulerOutput, req_id: str
    ) -> list[int]:
        return self._alloc_tables.get(req_id, [])


class UnalignedFullHitConnector(ReferenceConnector):
    """vLLM #43494: a full-prompt hit is cut to `num_tokens - 1` tokens.

    The load is block-based, so the tail block vLLM now counts as computed
    is never loaded.
    """

    def _hit_tokens(self, request: Request) -> int:
        hits = 0
        for block_hash in request.block_hashes:
            if bytes(block_hash) not in self._store:
                break
            hits += 1
        tokens = hits * self._block_size
        if tokens >= request.num_tokens:
            return int(request.num_tokens) - 1
        return tokens


class UnpinnedAsyncSaveConnector(ReferenceConnector):
    """vLLM #52360 / #29870 / LMCache#4955: async saves read freed blocks.

    A save is read from the KV cache by a store thread `lag` steps later,
    without holding the blocks; a preemption in between lets another
    request overwrite them, and its KV is stored under this prefix.
    """

    lag = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queued: list[list[BlockTransfer]] = []

    def _stage(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Nothing now: the store thread reads the blocks later."""

    def wait_for_save(self) -> None:
        self._queued.append(list(self._meta().saves))
        while len(self._queued) > self.lag:
            for save in self._queued.pop(0):
                for block_id, block_hash in zip(
                    save.block_ids, save.block_hashes, strict=True
                ):
                    self._store.setdefault(
                        block_hash,
                        {
                            name: kv[block_id].clone()
                            for name, kv in self._kv_caches.items()
                        },
                    )


class DropsFailedLoadConnector(ReferenceConnector):
    """vLLM #50984 / local-inference-lab#191: a failed load never finishes.

    Failed blocks are reported, but the request is not reported received,
    so it waits in `WAITING_FOR_REMOTE_KVS` forever.
    """

    def start_load_kv(
        self, forward_context: ForwardContext, **kwargs: Any
    ) -> None:
        failed = {
            load.req_id
            for load in self._meta().loads
            if any(h not in self._store for h in load.block_hashes)
        }
        super().start_load_kv(forward_context, **kwargs)
        self._recved -= failed


class NoRetrievalAfterPreemptionConnector(ReferenceConnector):
    """LMCache#1969: a preempted request is not looked up again.

    The first answer is remembered per request id, so a resumed request
    recomputes the prefix the store holds.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._admitted: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.request_id in self._admitted:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _note_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        self._admitted.add(request.request_id)


class CountsSavesByRequestConnector(ReferenceConnector):
    """vLLM #51637: in-flight saves are counted per request id.

    The worker copies a save's blocks at once but completes it later, on
    its store thread (`hold` keeps those of some requests back);
    preemption drops the request's counter.  A save from before the
    preemption that completes after the resumed request queued a new one
    decrements the new lifecycle's counter, which never returns to zero:
    the delay-freed blocks are never reported sent.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._saving: set[str] = set()
        # Worker side.
        self.hold: set[str] = set()
        self.counters: dict[str, int] = {}
        self._jobs: list[str] = []
        self._finished: set[str] = set()

    def _step_meta(
        self, scheduler_output: SchedulerOutput, meta: ReferenceMetadata
    ) -> NaiveMetadata:
        self._saving |= {s.req_id for s in meta.saves}
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        return NaiveMetadata(
            loads=meta.loads, saves=meta.saves, preempted=preempted
        )

    def _delay_free(self, request: Request, block_ids: list[int]) -> bool:
        saving = request.request_id in self._saving
        self._saving.discard(request.request_id)
        return saving and bool(block_ids)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if isinstance(meta, NaiveMetadata):
            for req_id in meta.preempted:
                self.counters.pop(req_id, None)
        for save in meta.saves:
            self.counters[save.req_id] = self.counters.get(save.req_id, 0) + 1
            self._jobs.append(save.req_id)
        super().wait_for_save()

    def _sent(self, finished_req_ids: set[str], recving: set[str]) -> set[str]:
        for req_id in self._jobs:
            if req_id in self.counters and req_id not in self.hold:
                self.counters[req_id] -= 1
        self._jobs = [r for r in self._jobs if r in self.hold]
        self._finished |= finished_req_ids
        sent = {r for r in self._finished if self.counters.get(r, 0) == 0}
        self._finished -= sent
        for req_id in sent:
            self.counters.pop(req_id, None)
        return sent
