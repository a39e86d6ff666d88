"""The vLLM 0.33 `KVConnectorBase_V1` over the Mooncake store.

Once the package is installed, vLLM finds it by name (the
``vllm.general_plugins`` entry point, ``connector.integration.plugin``)::

    KVTransferConfig(
        kv_connector="MooncakeLifecycleConnector",
        kv_role="kv_both",  # or kv_producer / kv_consumer
        kv_connector_extra_config={
            "master_server_address": "127.0.0.1:50051",
            "metadata_server": "http://127.0.0.1:8080/metadata",
        },
    )

Without the installed entry point, add
``kv_connector_module_path="connector.integration.vllm_connector"``.

This module is the role facade: it builds the two halves from vLLM's
config (key schemes: `connector.integration.layout`; the admission
lookup: `connector.scheduler.store_lookup`) and every hook is a one-line
delegation to `connector.scheduler.side.SchedulerSide` or
`connector.worker.side.WorkerSide`, which hold no vLLM import.  Importing
it imports vLLM.

The connector declares vLLM's `SupportsHMA`: it runs with the hybrid KV
cache manager, over full-attention, sliding-window and recurrent-state
(Mamba, gated DeltaNet, ... in ``mamba_cache_mode="align"``) KV cache
groups (`connector.groups`); a model with any other group kind is
refused at start-up with `UnsupportedKVGroups`.

Identity: a stored block's key names the model as configured (full name
or path, and revision), the TP shard, the pipeline stage, the layout and
a weights generation (`connector.store.keys`).  Pipeline parallelism is
refused at start-up (`UnsupportedParallelism`): the scheduler half sees
one stage's layout and could not tell whether every stage's blocks are
stored.  `reset_cache` moves to a new weights generation.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING, Any, Final

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from connector.config import (
    EventsConfig,
    IdentityConfig,
    LoadConfig,
    LookupConfig,
    StoreConfig,
    TraceConfig,
)
from connector.errors import ConfigError, StoreError
from connector.groups import KVGroups
from connector.integration.kv_events import hit_sources, vllm_events
from connector.integration.layout import (
    Schemes,
    key_layout,
    pipeline_size,
    tp_rank,
)
from connector.integration.stats import (
    LifecycleConnectorStats,
    LifecyclePromMetrics,
    StatsSource,
)
from connector.metadata import ConnectorMeta, JobResult, WorkerReport
from connector.parallel import ParallelKVConfig, TPPlan
from connector.scheduler.events import StoreEvents
from connector.scheduler.failed_keys import DEFAULT_TTL_S, FailedKeys
from connector.scheduler.peers import FencedLookup, PeerFence
from connector.scheduler.side import Role, SchedulerSide
from connector.scheduler.store_lookup import StoreLookup
from connector.store import Regions, StoreClient, clients
from connector.worker.lanes import Lane
from connector.worker.shards import group_lane
from connector.worker.sick import SickPeerStore
from connector.worker.side import WorkerSide
from connector.worker.transfer import DEFAULT_STAGING_BLOCKS, KVLayout
from lifecycle.trace import TraceError, TraceWriter

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        PromMetric,
        PromMetricT,
    )

    from connector.worker.pieces import HostMemory

log: Final = logging.getLogger(__name__)

DRAIN_TIMEOUT_S: Final = 10.0
"""How long `shutdown` and `unregister_kv_caches` wait for transfers."""

RESTORE_RETRY_S: Final = 1.0
"""How often a KV region the store refused at wake-up is registered again
(off the step thread: with a hung master one try takes about 6 s)."""


@attrs.define
class _Restorer:
    """The thread registering the KV cache again after wake-up.

    `lock` is held while a try registers and commits what it registered.
    """

    stop: threading.Event = attrs.Factory(threading.Event)
    lock: threading.Lock = attrs.Factory(threading.Lock)
    thread: threading.Thread | None = None


_KEPT: list[Any] = []
"""Workers whose transfers did not stop: held (with their KV memory, still
registered) until the process exits, so no transfer touches freed memory."""


class LifecycleConnectorMetadata(KVConnectorMetadata):
    """vLLM's scheduler -> worker envelope around a `ConnectorMeta`."""

    def __init__(self, meta: ConnectorMeta) -> None:
        self.meta = meta


class LifecycleWorkerMetadata(KVConnectorWorkerMetadata):
    """vLLM's worker -> scheduler envelope; folds ranks' job results."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    @property
    def results(self) -> tuple[JobResult, ...]:
        """The job results of every rank folded in so far."""
        return self.report.results

    def aggregate(
        self, other: KVConnectorWorkerMetadata
    ) -> LifecycleWorkerMetadata:
        """Fold another rank's report into this one."""
        if isinstance(other, LifecycleWorkerMetadata):
            return LifecycleWorkerMetadata(self.report.merged(other.report))
        return self


def _open_trace(
    trace: TraceConfig, scheduler: SchedulerSide | None
) -> TraceWriter | None:
    """Trace the scheduler half's machine if `lifecycle_trace` is set."""
    path = trace.file_for(os.getpid())
    if scheduler is None or path is None:
        return None
    try:
        writer = TraceWriter.open(path, max_events=trace.max_events)
    except TraceError as exc:
        key = "lifecycle_trace"
        raise ConfigError(key, path, exc.reason) from exc
    writer.attach(scheduler.machine)
    return writer


def _kv_events_on(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (``--kv-events-config``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _load_config(extra: dict[str, Any]) -> LoadConfig:
    """The load keys; sets the transport's bounds to match the deadline.

    An operator's own ``MC_TCP_*`` environment values win.
    """
    loads = LoadConfig.from_extra_config(extra)
    for name, value in loads.transport_env().items():
        os.environ.setdefault(name, value)
    return loads


def _warn_failure_policy(transfer: Any) -> None:
    """WARN when vLLM fails requests whose load failed (policy ``fail``)."""
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy == "fail":
        log.warning(
            "kv_transfer_config.kv_load_failure_policy is 'fail' (vLLM's "
            "default): a load the store cannot serve (a dead or hung peer, "
            "a master restart, an evicted block) will fail its request "
            "with an error instead of recomputing the blocks. Set "
            '"kv_load_failure_policy": "recompute" to keep serving '
            "through store faults."
        )


class MooncakeLifecycleConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector whose hooks only fire lifecycle events.

    It never asserts on ordering, never delays freeing (saves pin their
    own blocks), reports exactly one receive completion per load, even a
    failed one (whose blocks vLLM recomputes), and never reports one vLLM
    no longer expects.  It supports vLLM's hybrid KV cache manager
    (`SupportsHMA`) for full-attention, sliding-window and align-mode
    recurrent-state groups.

    Raises:
        UnsupportedKVGroups: the model has a KV cache group of another
            kind (e.g. Mamba state without align mode), naming every
            group's kind.
    """

    _asleep: list[tuple[int, int]] | None = None
    """While asleep: the (address, bytes) to register again at wake-up."""
    _restorer: _Restorer | None = None
    """While the store refuses the KV cache back after wake-up."""

    def __init__(
        self,
        vllm_config: Any,
        role: KVConnectorRole,
        kv_cache_config: Any,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        self._store_config = StoreConfig.from_vllm(extra)
        trace = TraceConfig.from_extra_config(extra)
        lookups = LookupConfig.from_extra_config(extra)
        self._loads = _load_config(extra)
        self._events_medium = EventsConfig.from_extra_config(extra).medium
        identity = IdentityConfig.from_extra_config(extra)
        self._parallel = ParallelKVConfig.from_extra_config(extra)
        parallel = vllm_config.parallel_config
        tp_size = parallel.tensor_parallel_size
        pp_size = pipeline_size(parallel)
        model_config = vllm_config.model_config
        self._groups = KVGroups.from_kv_cache_config(kv_cache_config)
        self._weights_version = identity.weights_version
        worker = role != KVConnectorRole.SCHEDULER
        rank = tp_rank(tp_size) if worker and tp_size > 1 else 0
        self._plan = TPPlan.of_vllm(vllm_config, rank, self._parallel)
        if self._parallel.shared_tp is not None and not self._plan.shared:
            log.info(
                "KV is identical on every TP rank (MLA or one KV head): "
                "stored once per block, shared by every TP size; "
                "store_tp_size is not needed"
            )
        if self._plan.shared and self._groups.hybrid:
            key, why = "store_tp_size", "the head-sharded layout: one group"
            raise ConfigError(key, self._plan.store_tp, why)
        schemes = Schemes(
            namespace=self._store_config.namespace,
            model=str(model_config.model),
            revision=str(getattr(model_config, "revision", None) or ""),
            generation=identity.weights_version,
            tp_size=tp_size,
            pp_size=pp_size,
            layouts=tuple(
                key_layout(kv_cache_config, g.index)
                for g in self._groups.groups
            ),
            plan=self._plan,
        )
        self._schemes = schemes
        self._keys = schemes.of_rank(rank)
        if not worker:
            _warn_failure_policy(transfer)
        self._client: StoreClient | None = clients.acquire(
            self._store_config,
            contribute=role != KVConnectorRole.SCHEDULER,
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._registered: list[int] = []
        self._num_blocks = kv_cache_config.num_blocks
        try:
            if role == KVConnectorRole.SCHEDULER:
                hybrid = self._groups.hybrid
                ttl_s = lookups.failed_load_ttl_s
                # A fence lifts once the master drops the peer (its blocks
                # are then read elsewhere or missing); its ttl only bounds
                # a peer that stays listed, so not below the default.
                fence_ttl_s = max(ttl_s, DEFAULT_TTL_S)
                fence = PeerFence(
                    ttl_s=fence_ttl_s,
                    probe_s=self._loads.peer_probe_s or fence_ttl_s,
                )
                store_lookup = StoreLookup(
                    self._client, schemes.every_shard(), self._groups
                )
                self._scheduler = SchedulerSide(
                    block_size=self._groups.groups[0].block_size
                    if hybrid
                    else vllm_config.cache_config.block_size,
                    role=Role(transfer.kv_role),
                    lookup=FencedLookup(
                        store_lookup, fence, store_lookup.read_from
                    ),
                    world_size=parallel.world_size,
                    lookup_timeout_s=lookups.timeout_ms / 1000,
                    lookup_wait_s=lookups.wait_ms / 1000,
                    max_pending=lookups.max_pending,
                    failed_keys=FailedKeys(ttl_s, peers=fence),
                    groups=self._groups if hybrid else None,
                    save_decode=self._parallel.save_decode_cache,
                    layerwise_max_blocks=self._loads.layerwise_max_blocks,
                )
                if _kv_events_on(vllm_config):
                    self._scheduler.jobs.events = StoreEvents(
                        self._scheduler.block_size,
                        [g.block_size for g in self._groups.groups],
                    )
            self._trace = _open_trace(trace, self._scheduler)
        except BaseException:
            # A construction error must not keep the client referenced.
            clients.release(self._client)
            self._client = None
            raise
        self._stats = self._stats_source(self._client)

    def _stats_source(self, client: StoreClient) -> StatsSource:
        """This half's `get_kv_connector_stats` answers."""
        scheduler = self._scheduler
        return StatsSource(
            machine=scheduler.machine if scheduler else None,
            also=(scheduler.lookup_machine,) if scheduler else (),
            store=client.stats,
            half="scheduler" if scheduler else "worker",
            groups=self._scheduler_group_stats if scheduler else None,
            lookups=(lambda: scheduler.lookup_counts) if scheduler else None,
        )

    # ------------------------------------------------------- scheduler side

    @property
    def scheduler_side(self) -> SchedulerSide:
        """The scheduler half (scheduler role only).

        The per-request hooks read ``self._scheduler`` first and this
        property only to raise (one call less per hook).
        """
        if self._scheduler is None:
            msg = "not a scheduler-role connector"
            raise RuntimeError(msg)
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide | None:
        """The worker half, once `register_kv_caches` ran."""
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss."""
        return False

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Let saves pin their blocks until every rank has read them."""
        self.scheduler_side.bind_block_pool(gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        """Track the request from NEW (vLLM #56780: abort before lookup)."""
        (self._scheduler or self.scheduler_side).on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Longest stored prefix beyond the local hit; loaded async?"""
        return (
            self._scheduler or self.scheduler_side
        ).get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Blocks allocated; `num_external_tokens == 0` means do not load."""
        (self._scheduler or self.scheduler_side).update_state_after_alloc(
            request, blocks, num_external_tokens
        )

    def build_connector_meta(
        self, scheduler_output: Any
    ) -> LifecycleConnectorMetadata:
        """Called once per `schedule()`: the step's events and jobs."""
        return LifecycleConnectorMetadata(
            (self._scheduler or self.scheduler_side).build_connector_meta(
                scheduler_output
            )
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when vLLM finishes a request, in any state."""
        return (self._scheduler or self.scheduler_side).request_finished(
            request, block_ids
        )

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when vLLM finishes a request of a hybrid model.

        The same contract as `request_finished`, which it calls (so a
        subclass hooking `request_finished` sees every finish): any state,
        never delays freeing, one finish per request.
        """
        return self.request_finished(
            request, list(block_ids[0]) if block_ids else []
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Settle job results; pass on only expected receive completions."""
        (self._scheduler or self.scheduler_side).update_connector_output(
            connector_output
        )

    def has_pending_push_work(self) -> bool:
        """Saves still pin blocks: keep the engine stepping."""
        return self.scheduler_side.has_pending_push_work()

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """Every external hit token comes from the store's DRAM pool."""
        del request
        return hit_sources(num_external_tokens)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The store's KV-cache events since the last call.

        Only with vLLM's KV events on (``--kv-events-config``); see
        `connector.integration.kv_events`.
        """
        events = self._scheduler.jobs.events if self._scheduler else None
        if events is None or not len(events):
            return ()
        return vllm_events(events.take(), self._events_medium)

    def store_cleared(self) -> None:
        """The store was wiped (a reset): publish `AllBlocksCleared`.

        Saves still in flight announce nothing.  A no-op on the worker
        half or with KV events off.
        """
        events = self._scheduler.jobs.events if self._scheduler else None
        if events is not None:
            events.cleared()

    def reset_cache(self) -> bool | None:
        """Move to a new weights generation: KV stored before never hits.

        vLLM 0.33 calls it on the scheduler-role connector for
        ``reset_prefix_cache(reset_connector=True)`` (RL frameworks do,
        after every weight update).  The new generation,
        ``<weights_version>+reset-<random>``, is this instance's own: no
        earlier KV and no other instance shares its keys, since nothing
        tells the connector which weights another instance now holds.
        Later lookups and jobs use it (the worker half learns it from the
        step's metadata); jobs already issued keep theirs.  Old keys are
        not removed: instances that did not reset still serve them, and
        the master's eviction reclaims them once unused.  With vLLM's KV
        events on, routers are told (`store_cleared`: `AllBlocksCleared`):
        nothing this instance stored before will be loaded again.

        Returns:
            True once moved (scheduler role); False after `shutdown`;
            None in the worker role (vLLM does not call it there).
        """
        if self._scheduler is None:
            return None
        if self._client is None:
            return False
        generation = f"{self._weights_version}+reset-{uuid.uuid4().hex}"
        self._scheduler.reset_generation(
            generation,
            StoreLookup(
                self._client,
                self._schemes.of_generation(generation).every_shard(),
                self._groups,
            ),
        )
        self.store_cleared()
        log.info(
            "kv-lifecycle: cache reset, new weights generation %r; KV "
            "stored before it will not be loaded",
            generation,
        )
        return True

    def wait_for_lookups(self, timeout_s: float) -> bool:
        """Block until this step's lookups ran: harnesses and tests only.

        A test harness steps far faster than an engine with a forward
        pass; waiting here keeps its step counts deterministic.  vLLM
        never calls it.
        """
        if self._scheduler is None:
            return True
        return self._scheduler.wait_for_lookups(timeout_s)

    # ---------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV tensors with the store once; start the threads."""
        client = self._client
        if client is None:
            msg = "register_kv_caches after shutdown"
            raise RuntimeError(msg)
        # A dummy client moves blocks only through its shared memory.
        memory = client.staging_memory if client.dummy else None
        lanes = self._lanes(client, kv_caches, memory)
        probe_s = self._loads.peer_probe_s
        store = SickPeerStore(client, hold_s=probe_s) if probe_s else client
        if lanes:  # hybrid, head-sharded or replicated: lanes of their own
            first = {n: kv_caches[n] for n in self._group_layers(kv_caches, 0)}
            self._worker = WorkerSide(
                store,
                lanes[0].keys,
                KVLayout.from_tensors(first, self._num_blocks),
                Regions,
                transfer=lanes[0].transfer,
                lanes=lanes,
                load_timeout_s=self._loads.timeout_s,
                layerwise_saves=self._loads.layerwise_save_blocks > 0,
            )
        else:
            self._worker = WorkerSide.for_kv_caches(
                store,
                self._schemes.shards(0)[0],
                kv_caches,
                self._num_blocks,
                Regions,
                register=client.register,
                load_timeout_s=self._loads.timeout_s,
                layerwise_save_blocks=self._loads.layerwise_save_blocks,
                memory=memory,
            )
        self._registered.extend(self._worker.registered)
        self._stats.watch(self._worker.machine)
        self._stats.groups = self._worker_group_stats

    def unregister_kv_caches(self) -> None:
        """Before sleep mode frees the KV cache: drain, then unregister.

        Transfers queued or running may end (bounded by
        `DRAIN_TIMEOUT_S`); until `restore_kv_caches` no job runs (one
        the worker takes is cancelled: its blocks are recomputed or not
        stored).  If a transfer is still stuck in the store, the memory
        stays registered and an ERROR says so.  Idempotent.
        """
        worker, client = self._worker, self._client
        if worker is None or client is None:
            return
        if self._restorer is not None:  # asleep again mid-restore
            self._stop_restoring()
            left = self._asleep or []
            self._asleep = [*self._unregister_all(client, "sleep mode"), *left]
            return
        if self._asleep is not None:
            return
        if not worker.suspend(DRAIN_TIMEOUT_S):
            log.error(
                "kv-lifecycle: a KV transfer is still running %.0f s after "
                "sleep mode asked to unregister the KV cache; its memory "
                "stays registered and the transfer may touch it",
                DRAIN_TIMEOUT_S,
            )
            self._asleep = []
            return
        self._take_registered()
        self._asleep = self._unregister_all(client, "sleep mode")
        log.info(
            "kv-lifecycle: KV cache unregistered for sleep mode (%d regions)",
            len(self._asleep),
        )

    def restore_kv_caches(self) -> None:
        """After wake-up: register the KV memory again; jobs run again.

        vLLM maps the KV cache back at the same addresses.  If the store
        refuses a region (its master down), the worker stays suspended
        (jobs cancelled: loads recomputed, saves skipped), one WARNING
        says so, and a thread tries again every `RESTORE_RETRY_S` until
        every region is back, then resumes the worker.  Idempotent.
        """
        worker, client, asleep = self._worker, self._client, self._asleep
        if worker is None or client is None or asleep is None:
            return
        if self._restorer is not None:
            return  # the retry thread is at it
        left, refused = self._register_again(client, asleep)
        if refused is None:
            self._woken(len(asleep))
            return
        self._asleep = left
        log.warning(
            "kv-lifecycle: the store refused to register %d of %d KV "
            "region(s) after wake-up (%s); KV transfers stay paused (loads "
            "recomputed) and it is retried every %.0f s",
            len(left),
            len(asleep),
            refused,
            RESTORE_RETRY_S,
        )
        restorer = _Restorer()
        restorer.thread = threading.Thread(
            target=self._keep_restoring,
            args=(client, restorer, len(asleep)),
            name="kv-lifecycle-restore",
            daemon=True,
        )
        self._restorer = restorer
        restorer.thread.start()

    def _keep_restoring(
        self, client: StoreClient, restorer: _Restorer, total: int
    ) -> None:
        """The retry thread: register what is left until none or stopped."""
        while not restorer.stop.wait(RESTORE_RETRY_S):
            with restorer.lock:
                if restorer.stop.is_set():
                    return
                left, refused = self._register_again(
                    client, self._asleep or []
                )
                self._asleep = left
                if refused is None:
                    if not restorer.stop.is_set():  # not asleep again
                        self._restorer = None
                        self._woken(total)
                    return

    def _register_again(
        self, client: StoreClient, regions: list[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], StoreError | None]:
        """Register `regions` in order, up to the first the store refuses.

        Returns what is left (from the refused one on) and the refusal.
        """
        for i, (ptr, nbytes) in enumerate(regions):
            try:
                if client.register(ptr, nbytes):
                    self._registered.append(ptr)
            except StoreError as error:
                return regions[i:], error
        return [], None

    def _woken(self, regions: int) -> None:
        """Every region is registered again: jobs run again."""
        self._asleep = None
        if self._worker is not None:
            self._worker.resume()
        log.info(
            "kv-lifecycle: KV cache registered again after wake-up "
            "(%d regions)",
            regions,
        )

    def _stop_restoring(self) -> None:
        """Stop the retry thread, if any; it changes nothing after this.

        Waits for a try in flight (about 6 s with a hung master).
        """
        restorer, self._restorer = self._restorer, None
        if restorer is not None:
            restorer.stop.set()
            with restorer.lock:  # the try in flight committed
                pass
            if restorer.thread is not None:
                restorer.thread.join(timeout=1.0)

    def _unregister_all(
        self, client: StoreClient, why: str
    ) -> list[tuple[int, int]]:
        """Unregister every region; the (ptr, nbytes) of those that were.

        A region Mooncake refuses to unregister (its master's metadata
        server down) stays registered, listed in `_registered`; one
        WARNING counts them.
        """
        done, kept = [], []
        refused: StoreError | None = None
        for ptr in self._registered:
            try:
                done.append((ptr, client.unregister(ptr)))
            except StoreError as error:
                kept.append(ptr)
                refused = error
        self._registered = kept
        if refused is not None:
            log.warning(
                "kv-lifecycle: the store refused to unregister %d KV "
                "region(s) for %s (%s); Mooncake keeps them registered",
                len(kept),
                why,
                refused,
            )
        return done

    def _take_registered(self) -> None:
        """Add what the worker registered since (load staging buffers)."""
        if self._worker is not None:
            more = self._worker.registered
            self._registered.extend(
                p for p in more if p not in self._registered
            )

    def _group_layers(
        self, kv_caches: dict[str, torch.Tensor], index: int
    ) -> list[str]:
        """The group's layers that have a KV tensor (all, one group)."""
        if not self._groups.hybrid:
            return list(kv_caches)
        layers = self._groups.groups[index].layers
        return [n for n in layers if n in kv_caches]

    def _lanes(
        self,
        client: StoreClient,
        kv_caches: dict[str, torch.Tensor],
        memory: HostMemory | None,
    ) -> list[Lane]:
        """Per group, its keys and a transfer over its layers.

        Empty for one group of distinct per-rank KV (the plain path).
        Head-sharded: one transfer per head shard the rank holds, keys
        shard-major.  A replica rank's lane does not write.  With
        layer-wise saves, writing lanes are staged in at least
        ``layerwise_save_blocks`` blocks, host caches too (as
        `WorkerSide.for_kv_caches` does on the plain path).

        Raises:
            ConfigError: ``store_tp_size`` over KV blocks that are not
                head-major.
        """
        if self._plan.plain and not self._groups.hybrid:
            return []
        save_blocks = self._loads.layerwise_save_blocks
        staging = (
            max(DEFAULT_STAGING_BLOCKS, save_blocks) if save_blocks else None
        )
        return [
            group_lane(
                {n: kv_caches[n] for n in self._group_layers(kv_caches, g)},
                self._num_blocks,
                Regions,
                register=client.register,
                plan=self._plan,
                keys=self._schemes.lane_keys(g),
                block_bytes=self._keys[g].layout.block_bytes,
                staging_blocks=staging,
                deadlines=self._loads.timeout_s is not None,
                memory=memory,
            )
            for g in range(len(self._groups.groups))
        ]

    def _meta(self) -> ConnectorMeta | None:
        bound = self._connector_metadata
        return (
            bound.meta
            if isinstance(bound, LifecycleConnectorMetadata)
            else None
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Queue this step's asynchronous loads; start its layer-wise ones."""
        del forward_context, kwargs
        if self._worker is not None:
            self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's KV of the step's layer-wise loads.

        Bounded by their deadline (`WorkerSide.wait_for_layer_load`).
        """
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        """Mark the layer written: its saves copy it only after now."""
        del kv_layer, attn_metadata, kwargs
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        """Queue this step's saves after the forward pass wrote the KV."""
        if self._worker is not None:
            self._worker.wait_for_save(self._meta())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """(None, requests whose load ended, failed or not)."""
        del finished_req_ids
        if self._worker is None:
            return None, None
        return self._worker.get_finished()

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """`get_finished`, plus (hybrid models) the failed loads' requests."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set()
        if self._worker is not None and self._groups.hybrid:
            failed = self._worker.take_failed_loads()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed: vLLM recomputes them.

        Always empty for a hybrid model: its failed loads go per request
        (`get_transfer_results`), as vLLM 0.33 requires.
        """
        if self._worker is None:
            return set()
        errors = self._worker.get_block_ids_with_load_errors()
        return set() if self._groups.hybrid else errors

    def build_connector_worker_meta(self) -> LifecycleWorkerMetadata | None:
        """This step's job results, for the scheduler half."""
        report = self._worker.build_report() if self._worker else None
        return LifecycleWorkerMetadata(report) if report else None

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Fire the step's preemptions; in-flight saves pinned their blocks."""
        if self._worker is not None and isinstance(
            kv_connector_metadata, LifecycleConnectorMetadata
        ):
            self._worker.handle_preemptions(kv_connector_metadata.meta)

    # ---------------------------------------------------------------- stats

    def _scheduler_group_stats(self) -> dict[str, dict[str, int]]:
        hits = self.scheduler_side.jobs.take_hits()
        return {f"g{g}": {"hit_blocks": n} for g, n in hits.items()}

    def _worker_group_stats(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        if self._worker is not None:
            for (kind, g, unit), n in self._worker.take_moved().items():
                out.setdefault(f"g{g}", {})[f"{kind}_{unit}"] = n
        return out

    def get_kv_connector_stats(self) -> LifecycleConnectorStats | None:
        """This half's lifecycle and store figures since the last call."""
        return self._stats.take()

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: dict[str, Any]
    ) -> bool:
        """Layer-wise loads wait inside the forward: no full CUDA graphs.

        Raises:
            ConfigError: naming a bad load key.
        """
        return (
            LoadConfig.from_extra_config(extra_config).layerwise_max_blocks > 0
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> LifecycleConnectorStats:
        """Rebuild a stats object from its payload (vLLM's loggers)."""
        return LifecycleConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LifecyclePromMetrics:
        """Register the ``vllm:kv_lifecycle_*`` Prometheus metrics."""
        return LifecyclePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    @property
    def trace(self) -> TraceWriter | None:
        """The lifecycle trace writer, when `lifecycle_trace` is set."""
        return self._trace

    def held(self) -> tuple[int, int]:
        """(live trackers, open jobs) of this half, now."""
        if self._scheduler is not None:
            side = self._scheduler
            return len(side.registry), side.open_jobs
        if self._worker is not None:
            return len(self._worker.registry), self._worker.open_jobs
        return 0, 0

    def shutdown(self) -> None:
        """Drain the transfer threads (bounded) and release the client.

        The KV memory is unregistered only once the transfer threads
        stopped; if one is stuck in the store (bounded by
        `DRAIN_TIMEOUT_S`), the worker and its KV views are kept, still
        registered, until the process exits (a WARNING says so).

        Logs once what the half still held: ``kv-lifecycle <half> half
        shutting down (pid P): T live trackers, J open jobs`` (INFO when
        both are 0, else WARNING).
        """
        if self._client is not None:
            trackers, jobs = self.held()
            log.log(
                logging.INFO if trackers == jobs == 0 else logging.WARNING,
                "kv-lifecycle %s half shutting down (pid %d): "
                "%d live trackers, %d open jobs",
                "scheduler" if self._scheduler is not None else "worker",
                os.getpid(),
                trackers,
                jobs,
            )
        if self._trace is not None:
            self._trace.close()
        if self._scheduler is not None:
            self._scheduler.close()
        self._stop_restoring()
        stopped = True
        if self._worker is not None:
            # Load staging may have registered more buffers since.
            self._take_registered()
            stopped = self._worker.shutdown(DRAIN_TIMEOUT_S)
            if not stopped:
                _KEPT.append(self._worker)
                log.warning(
                    "kv-lifecycle: KV memory kept registered and held until "
                    "the process exits: %d region(s) a stuck transfer may "
                    "still touch",
                    len(self._registered),
                )
            self._worker = None
        if self._client is not None:
            if stopped:
                self._unregister_all(self._client, "shutdown")
            self._registered.clear()
            clients.release(self._client)
            self._client = None
