"""The worker half of the connector: moves whole KV blocks, never tokens.

Transfers run on two background threads (loads, saves) against the store;
their results are posted to a queue and reported once per step, as
`get_finished` receive completions and as job results in the worker
report.  Job ids, not request ids, identify results, so a completion from
an old lifecycle of a reused request id can never be mistaken for the new
one's (the scheduler half fences it by epoch).

Blocks are copied whole (`kv[block_id]`, every layer), so the connector
never depends on how a backend orders tokens inside a block.  No vLLM
import.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from connector.metadata import (
    ConnectorMeta,
    JobKind,
    JobResult,
    TransferJob,
    WorkerReport,
)

if TYPE_CHECKING:
    import torch

log: Final = logging.getLogger(__name__)

_KV_HALVES: Final = 2  # K and V, on K/V-first layouts


class BatchOutcome(Protocol):
    """Per-key success of one batch call."""

    @property
    def succeeded(self) -> list[bool]:
        """One flag per key."""


class BlockStore(Protocol):
    """What the worker needs from a store client."""

    def put(self, keys: Sequence[str], regions: Any) -> BatchOutcome:
        """Save each key's region (existing keys keep their value)."""

    def get(self, keys: Sequence[str], regions: Any) -> BatchOutcome:
        """Load each key into its region."""


class KeyMaker(Protocol):
    """Turns block hashes into store keys."""

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """One key per hash."""


@attrs.frozen
class Segment:
    """One blocks-first memory range: block `b` at `base + b * stride`."""

    base: int
    stride: int
    nbytes: int


@attrs.frozen
class KVLayout:
    """Where every block's bytes live, across all layers.

    Attributes:
        num_blocks: Blocks per layer.
        segments: Per layer (and per K/V half on K/V-first layouts), the
            range holding that layer's part of every block.
    """

    num_blocks: int
    segments: tuple[Segment, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer: one store object."""
        return sum(s.nbytes for s in self.segments)

    def pieces(
        self, block_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Per block, the (addresses, sizes) of its pieces, in layer order."""
        sizes = [s.nbytes for s in self.segments]
        ptrs = [
            [s.base + b * s.stride for s in self.segments] for b in block_ids
        ]
        return ptrs, [sizes] * len(block_ids)

    @classmethod
    def from_tensors(
        cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int
    ) -> KVLayout:
        """Read the layout off vLLM's per-layer KV tensors.

        Accepts blocks-first tensors (``[num_blocks, ...]``, CPU and
        FlashInfer/MLA layouts) and K/V-first ones (``[2, num_blocks,
        ...]``, FlashAttention).

        Raises:
            ValueError: naming the layer whose shape fits neither.
        """
        segments: list[Segment] = []
        for name in kv_caches:
            tensor = kv_caches[name]
            shape = tuple(tensor.shape)
            elem = tensor.element_size()
            if shape and shape[0] == num_blocks:
                halves = [tensor]
            elif (
                len(shape) > 1
                and shape[0] == _KV_HALVES
                and shape[1] == num_blocks
            ):
                halves = [tensor[0], tensor[1]]
            else:
                msg = (
                    f"KV cache for layer {name!r} has shape {shape}; "
                    f"expected [{num_blocks}, ...] or [2, {num_blocks}, ...]"
                )
                raise ValueError(msg)
            for half in halves:
                block = half[0]
                if not block.is_contiguous():
                    msg = f"KV blocks of layer {name!r} are not contiguous"
                    raise ValueError(msg)
                segments.append(
                    Segment(
                        base=half.data_ptr(),
                        stride=half.stride(0) * elem,
                        nbytes=block.numel() * elem,
                    )
                )
        return cls(num_blocks, tuple(segments))


class WorkerSide:
    """The connector's worker-role logic.

    Args:
        store: The store client (shared by both transfer threads).
        keys: Turns block hashes into keys.
        layout: The registered KV layout.
        regions: Builds a store batch from (ptr lists, size lists).
    """

    def __init__(
        self,
        store: BlockStore,
        keys: KeyMaker,
        layout: KVLayout,
        regions: Any,
    ) -> None:
        self._store = store
        self._keys = keys
        self.layout = layout
        self._regions = regions
        self._results: queue.SimpleQueue[tuple[TransferJob, bool, set[int]]]
        self._results = queue.SimpleQueue()
        self._queues: dict[JobKind, queue.SimpleQueue[TransferJob | None]]
        self._queues = {k: queue.SimpleQueue() for k in JobKind}
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(kind,),
                name=f"kv-lifecycle-{kind.value}",
                daemon=True,
            )
            for kind in JobKind
        ]
        for thread in self._threads:
            thread.start()
        self._load_errors: set[int] = set()
        self._step_results: list[JobResult] = []
        self._closed = False
        self.jobs_done = {JobKind.LOAD: 0, JobKind.SAVE: 0}
        self.jobs_failed = {JobKind.LOAD: 0, JobKind.SAVE: 0}

    # -- hooks ----------------------------------------------------------------

    def start_load_kv(self, meta: ConnectorMeta | None) -> None:
        """Queue this step's loads (async: the requests are not running)."""
        if meta is None:
            return
        for job in meta.jobs:
            if job.kind is JobKind.LOAD:
                self._queues[JobKind.LOAD].put(job)

    def wait_for_save(self, meta: ConnectorMeta | None) -> None:
        """Queue this step's saves, now that the forward pass wrote them.

        A pinned save reads its blocks later, on the save thread: the
        scheduler holds them until the job reports.  An unpinned one
        (vLLM without a bindable block pool) is done before returning.
        """
        if meta is None:
            return
        for job in meta.jobs:
            if job.kind is not JobKind.SAVE:
                continue
            if job.pinned:
                self._queues[JobKind.SAVE].put(job)
            else:
                self._run(job)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Drain finished jobs: (done sending, done receiving).

        Sending is always None: saves never delay freeing.  Every load
        job is reported once, failed or not (the failed blocks go to
        `get_block_ids_with_load_errors`).
        """
        recving: set[str] = set()
        while True:
            try:
                job, ok, failed_blocks = self._results.get_nowait()
            except queue.Empty:
                break
            self._step_results.append(
                JobResult(job.job_id, ok=int(ok), failed=int(not ok))
            )
            if job.kind is JobKind.LOAD:
                recving.add(job.req_id)
                self._load_errors |= failed_blocks
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_report(self) -> WorkerReport | None:
        """Job results drained by `get_finished` since the last report."""
        if not self._step_results:
            return None
        report = WorkerReport(tuple(self._step_results))
        self._step_results = []
        return report

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the threads after the queued jobs; bounded by `timeout`."""
        if self._closed:
            return
        self._closed = True
        for kind in JobKind:
            self._queues[kind].put(None)
        for thread in self._threads:
            thread.join(timeout)

    # -- transfers ------------------------------------------------------------

    def _serve(self, kind: JobKind) -> None:
        source = self._queues[kind]
        while (job := source.get()) is not None:
            self._run(job)

    def _run(self, job: TransferJob) -> None:
        """Run one job; never raises (a failure is a result)."""
        failed: set[int] = set()
        try:
            keys = self._keys.keys(job.block_hashes)
            regions = self._regions.pieces(*self.layout.pieces(job.block_ids))
            if job.kind is JobKind.LOAD:
                outcome = self._store.get(keys, regions)
            else:
                outcome = self._store.put(keys, regions)
            flags = outcome.succeeded
            failed = {
                b for b, ok in zip(job.block_ids, flags, strict=True) if not ok
            }
            ok = not failed
        except Exception:
            log.exception("%s job %d for %s failed", job.kind.value,
                          job.job_id, job.req_id)  # fmt: skip
            failed = set(job.block_ids)
            ok = False
        counter = self.jobs_done if ok else self.jobs_failed
        counter[job.kind] += 1
        self._results.put((job, ok, failed))
