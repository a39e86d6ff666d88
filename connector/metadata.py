"""Records that cross between the scheduler and worker halves.

vLLM runs the two halves as separate connector instances, often in
separate processes; they share nothing but these records.  All are frozen
`attrs` classes of plain values, so they pickle and cannot be mutated in
flight.  No vLLM import: the vLLM-facing module adapts them.
"""

from __future__ import annotations

import enum

import attrs


class JobKind(enum.Enum):
    """What a transfer job does."""

    LOAD = "load"
    SAVE = "save"


@attrs.frozen
class TransferJob:
    """One batch transfer between the KV cache and the store.

    Attributes:
        job_id: Unique per scheduler-side connector.  The identity of the
            job: request ids are reused after preemption, job ids never.
        kind: Load (store -> blocks) or save (blocks -> store).
        req_id: The request the job belongs to.
        epoch: The request's lifecycle epoch when the job was issued.
        block_ids: KV block ids, one per block hash.
        block_hashes: vLLM's chained block hashes, one per block.
        pinned: Whether the scheduler holds a reference on the blocks until
            the job completes (saves only).  An unpinned save must finish
            reading before `wait_for_save` returns.
        finished: vLLM finished the request before this job was issued
            (a load: vLLM keeps the blocks until the receive completion;
            a save: pinned, issued as the request finished in its
            layer-wise load's step): the worker ends the request's
            tracker as it accepts the job, instead of keeping it.
        group_ids: The KV cache group of each block (hybrid models: a
            job moves (group, block) pairs); empty means every block is
            in group 0.
        layerwise: A load vLLM schedules in the step that issues it
            (``load_async`` False): the worker starts it in
            `start_load_kv` and `wait_for_layer_load` waits for it, bounded
            by the load deadline.  It never gets a receive completion;
            its failed blocks go through ``get_block_ids_with_load_errors``
            in the same step.
    """

    job_id: int
    kind: JobKind
    req_id: str
    epoch: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    pinned: bool = False
    finished: bool = False
    group_ids: tuple[int, ...] = ()
    layerwise: bool = False

    def groups(self) -> tuple[int, ...]:
        """The group of each block (all 0 for a single-group job)."""
        return self.group_ids or (0,) * len(self.block_ids)


@attrs.frozen
class ConnectorMeta:
    """Scheduler -> worker, once per step (`build_connector_meta`).

    Attributes:
        step: The scheduler step that built it.
        jobs: Transfer jobs issued this step.
        preempted: (req_id, new epoch) of requests preempted this step.
        finished: Ids vLLM finished since the previous step.
        generation: The weights generation the step's jobs are keyed
            under; None until the first cache reset (the configured one).
    """

    step: int
    jobs: tuple[TransferJob, ...] = ()
    preempted: tuple[tuple[str, int], ...] = ()
    finished: frozenset[str] = frozenset()
    generation: str | None = None


@attrs.frozen
class JobResult:
    """How a job ended on one or more ranks.

    Every job gets exactly one result per rank, whatever its lifecycle
    decided: the scheduler releases the job's pinned blocks on it.

    Attributes:
        job_id: The job.
        ok: Ranks on which it succeeded.
        failed: Ranks on which it failed, was cancelled, or ended stale.
        stale: Of `failed`, the ranks whose worker lifecycle fenced the
            completion off: it came from an epoch before a preemption.
    """

    job_id: int
    ok: int = 0
    failed: int = 0
    stale: int = 0

    def merge(self, other: JobResult) -> JobResult:
        """The result over the ranks of both."""
        return JobResult(
            self.job_id,
            self.ok + other.ok,
            self.failed + other.failed,
            self.stale + other.stale,
        )


@attrs.frozen
class WorkerReport:
    """Worker -> scheduler, once per step (`build_connector_worker_meta`).

    Attributes:
        results: Jobs that ended on this worker since its last report.
    """

    results: tuple[JobResult, ...] = ()

    def merged(self, other: WorkerReport) -> WorkerReport:
        """The reports of two ranks folded into one (vLLM's aggregate)."""
        by_id = {r.job_id: r for r in self.results}
        for r in other.results:
            mine = by_id.get(r.job_id)
            by_id[r.job_id] = r if mine is None else mine.merge(r)
        return WorkerReport(tuple(by_id[k] for k in sorted(by_id)))
