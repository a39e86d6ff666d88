"""Test-only: the project's connector, observed, with one fault hook.

``ObservedLifecycleConnector`` is ``connector.MooncakeLifecycleConnector``
unchanged, plus JSON snapshots of what each half saw, so a test can check
the lifecycle of an engine it cannot reach into (vLLM's multiprocess
topology runs the scheduler half in EngineCore and the worker half in
VllmWorker). Snapshots are files ``<dir>/<role>-<pid>.json``, replaced
atomically:

* scheduler: the lifecycle after every ``build_connector_meta``,
  ``update_connector_output`` and ``request_finished`` (live trackers and
  their states, open jobs, illegal and stale counts, every request's
  terminal state, row counts, and, as of the last ``request_finished``,
  the trackers, open jobs and blocks held by anything but the finishing
  request);
* worker: the registered KV tensors and layout, blocks loaded and saved,
  jobs failed, and whether ``shutdown`` raised.

``kv_connector_extra_config`` keys (besides the store's):
    ``e2e_snapshot_dir``: where snapshots go (none without it);
    ``e2e_corrupt_loads``: fault hook: every block a load reads from the
        store is overwritten with seeded noise of the same scale before the
        load is reported, so the model reads wrong KV that the connector
        delivered.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from connector.integration.vllm_connector import MooncakeLifecycleConnector
from e2e.snapshots import write_json
from lifecycle.kv import TABLE, State

if TYPE_CHECKING:
    from collections.abc import Sequence

    from connector.store import Regions

SNAPSHOT_DIR_KEY = "e2e_snapshot_dir"
CORRUPT_LOADS_KEY = "e2e_corrupt_loads"
DIGESTS_KEY = "e2e_digests"


def _region_bytes(regions: Regions, index: int) -> bytes:
    """The bytes of one key's region (all its pieces, in order)."""
    if regions.piece_ptrs is not None and regions.piece_sizes is not None:
        pieces = list(
            zip(
                regions.piece_ptrs[index],
                regions.piece_sizes[index],
                strict=True,
            )
        )
    else:
        pieces = [(regions.ptrs[index], regions.sizes[index])]
    return b"".join(ctypes.string_at(ptr, size) for ptr, size in pieces)


class CountingStore:
    """Wraps a store client: counts blocks moved, optionally corrupts loads.

    Everything but ``get`` and ``put`` is passed through.
    """

    def __init__(
        self,
        inner: Any,
        dtype: torch.dtype,
        *,
        corrupt: bool,
        digests: bool = False,
    ) -> None:
        self._inner = inner
        self._dtype = dtype
        self._corrupt = corrupt
        #: With `digests`: per key, the SHA-256 of the bytes put / got.
        self.digests: dict[str, dict[str, str]] | None = (
            {"put": {}, "got": {}} if digests else None
        )
        self._gen = torch.Generator().manual_seed(0)
        self.loaded_blocks = 0
        self.loaded_bytes = 0
        self.load_seconds = 0.0  # wall time of the gets, this wrapper's
        self.saved_blocks = 0
        self.corrupted_blocks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, keys: Sequence[str], regions: Regions) -> Any:
        """The inner put; counts the keys stored or already present."""
        result = self._inner.put(keys, regions)
        self.saved_blocks += sum(result.succeeded)
        self._digest("put", keys, regions, result.succeeded)
        return result

    def _digest(
        self, kind: str, keys: Sequence[str], regions: Regions, flags: Any
    ) -> None:
        if self.digests is None:
            return
        for index, (key, ok) in enumerate(zip(keys, flags, strict=True)):
            if ok:
                data = _region_bytes(regions, index)
                self.digests[kind][key] = hashlib.sha256(data).hexdigest()

    def get(self, keys: Sequence[str], regions: Regions) -> Any:
        """The inner get; counts (and, as asked, corrupts) blocks read."""
        started = time.perf_counter()
        result = self._inner.get(keys, regions)
        self.load_seconds += time.perf_counter() - started
        flags = result.succeeded
        self._digest("got", keys, regions, flags)
        self.loaded_blocks += sum(flags)
        self.loaded_bytes += result.nbytes
        if self._corrupt:
            for index, ok in enumerate(flags):
                if ok:
                    self._scramble(regions, index)
        return result

    def _scramble(self, regions: Regions, index: int) -> None:
        if regions.piece_ptrs is not None and regions.piece_sizes is not None:
            pieces = zip(
                regions.piece_ptrs[index],
                regions.piece_sizes[index],
                strict=True,
            )
        else:
            pieces = iter([(regions.ptrs[index], regions.sizes[index])])
        for ptr, size in pieces:
            raw = (ctypes.c_char * size).from_address(ptr)
            view = torch.frombuffer(raw, dtype=self._dtype)
            std = float(view.float().std()) or 1.0
            noise = torch.randn(view.shape, generator=self._gen) * std
            view.copy_(noise.to(self._dtype))
        self.corrupted_blocks += 1


class ObservedLifecycleConnector(MooncakeLifecycleConnector):
    """``MooncakeLifecycleConnector`` plus snapshots and a fault hook."""

    def __init__(
        self, vllm_config: Any, role: Any, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        directory = extra.get(SNAPSHOT_DIR_KEY)
        self._snapshot_dir = Path(directory) if directory else None
        self._corrupt = bool(extra.get(CORRUPT_LOADS_KEY, False))
        self._digests = bool(extra.get(DIGESTS_KEY, False))
        self._pool: Any = None
        self._terminal: dict[str, str] = {}
        self._at_finish: dict[str, Any] = {}
        self._counting: CountingStore | None = None
        self._worker_info: dict[str, Any] = {}
        if self._scheduler is not None:
            self._scheduler.machine.add_observer(self._observe)

    # -- scheduler half -------------------------------------------------------

    def _observe(
        self, tracker: Any, source: State, event: Any, dest: State
    ) -> None:
        del source, event
        if dest in TABLE.terminal:
            self._terminal[tracker.req_id] = dest.name

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keep the pool to count blocks, then bind as usual."""
        self._pool = gpu_block_pool
        super().bind_gpu_block_pool(gpu_block_pool)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """As usual, then a snapshot."""
        meta = super().build_connector_meta(scheduler_output)
        self._scheduler_snapshot()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """As usual, then a snapshot."""
        super().update_connector_output(connector_output)
        self._scheduler_snapshot()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As usual, then a snapshot counting everyone else's blocks."""
        result = super().request_finished(request, block_ids)
        self._scheduler_snapshot(finishing_blocks=len(set(block_ids)))
        return result

    def _scheduler_snapshot(self, finishing_blocks: int | None = None) -> None:
        if self._snapshot_dir is None or self._scheduler is None:
            return
        side = self._scheduler
        machine = side.machine
        trackers = {t.req_id: t.state.name for t in side.registry}
        used = -1
        if self._pool is not None:  # the null block is never free
            used = self._pool.num_gpu_blocks - 1
            used -= self._pool.get_num_free_blocks()
        if finishing_blocks is not None:
            # The finishing request's blocks are freed right after this.
            self._at_finish = {
                "trackers": trackers,
                "open_jobs": side.open_jobs,
                "others_blocks": used - finishing_blocks,
            }
        payload: dict[str, Any] = {
            "pid": os.getpid(),
            "trackers": trackers,
            "open_jobs": side.open_jobs,
            "used_blocks": used,
            "at_last_finish": self._at_finish,
            "illegal": {
                f"{getattr(s, 'name', s)}/{e.value}": n
                for (s, e), n in machine.illegal_counts.items()
            },
            "stale": sum(machine.stale_counts.values()),
            "unexpected_reports": side.unexpected_reports,
            "terminal": dict(self._terminal),
            "transitions": {
                f"{r.source.name}-{r.event.value}-{r.dest.name}": n
                for r, n in machine.transition_counts().items()
                if n
            },
        }
        write_json(
            self._snapshot_dir / f"scheduler-{os.getpid()}.json", payload
        )

    # -- worker half ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register as usual; wrap the worker's store to count (and fault)."""
        super().register_kv_caches(kv_caches)
        worker = self.worker_side
        if worker is None:
            return
        dtype = next(iter(kv_caches.values())).dtype
        # Test-only fault hook, so it reaches into the worker.
        self._counting = CountingStore(
            worker._store,  # noqa: SLF001
            dtype,
            corrupt=self._corrupt,
            digests=self._digests,
        )
        worker._store = self._counting  # noqa: SLF001
        layout = worker.layout
        self._worker_info = {
            "layers": {
                name: {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype),
                    "block_nbytes": t[0].numel() * t.element_size(),
                }
                for name, t in kv_caches.items()
            },
            "segment_nbytes": [s.nbytes for s in layout.segments],
            "block_bytes": layout.block_bytes,
            "num_blocks": layout.num_blocks,
        }
        self._worker_snapshot()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """As usual, then a worker snapshot."""
        result = super().get_finished(finished_req_ids)
        self._worker_snapshot()
        return result

    def shutdown(self) -> None:
        """As usual; a worker's snapshot records whether it raised."""
        if not self._worker_info:  # scheduler role
            super().shutdown()
            return
        error = None
        try:
            super().shutdown()
        except Exception as exc:
            error = repr(exc)
            raise
        finally:
            self._worker_info["shutdown_error"] = error
            self._worker_info["shut_down"] = True
            with contextlib.suppress(OSError):
                self._worker_snapshot()

    def _worker_snapshot(self) -> None:
        if self._snapshot_dir is None or not self._worker_info:
            return
        counting = self._counting
        payload = {
            **self._worker_info,
            "pid": os.getpid(),
            "loaded_blocks": counting.loaded_blocks if counting else 0,
            "loaded_bytes": counting.loaded_bytes if counting else 0,
            "load_seconds": counting.load_seconds if counting else 0.0,
            "saved_blocks": counting.saved_blocks if counting else 0,
            "corrupted_blocks": counting.corrupted_blocks if counting else 0,
            "digests": counting.digests if counting else None,
        }
        write_json(self._snapshot_dir / f"worker-{os.getpid()}.json", payload)
