"""The scheduler half's table of open transfer jobs.

Jobs are keyed by job id and outlive their request on purpose: a save
pins its blocks in vLLM's block pool until every rank has finished
reading them, so neither preemption nor completion can hand those blocks
to another request while the store still reads them (vLLM #52360).  A job
is settled once every rank reported it; settling unpins its blocks.

A job moves (group, block) pairs: one job per load or save of a request,
whatever the number of KV cache groups, so a load still ends in exactly
one receive completion.  No vLLM import.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from connector.metadata import JobKind, TransferJob

if TYPE_CHECKING:
    from connector.groups import KVGroups, StateOffer
    from connector.scheduler.events import StoreEvents

log: Final = logging.getLogger(__name__)


class BlockPool(Protocol):
    """The part of vLLM's `BlockPool` used to pin blocks."""

    blocks: Sequence[Any]

    def touch(self, blocks: Sequence[Any]) -> None:
        """Take one reference on each block."""

    def free_blocks(self, ordered_blocks: Sequence[Any]) -> None:
        """Drop one reference on each block."""


@attrs.define(slots=True, eq=False)
class OpenJob:
    """A job issued and not yet reported by every rank."""

    job: TransferJob
    pinned: list[Any]
    ok: int = 0
    failed: int = 0
    invalid: set[int] = attrs.Factory(set)


def failed_hashes(job: TransferJob, invalid: set[int]) -> list[bytes]:
    """The hashes of a load's blocks that vLLM was told failed."""
    return [
        h
        for b, h in zip(job.block_ids, job.block_hashes, strict=True)
        if b in invalid
    ]


class JobTable:
    """Open jobs by id; pins save blocks until every rank reported.

    Args:
        world_size: Ranks that must report a job before it is settled.

    Attributes:
        events: Where settled saves and failed loads are announced to
            KV-aware routers (`connector.scheduler.events`); None: off.
    """

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.pool: BlockPool | None = None
        self.events: StoreEvents | None = None
        self._open: dict[int, OpenJob] = {}
        self._next = 0
        #: Blocks issued for loading (store hits), by KV cache group.
        self.hits: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._open

    def __getitem__(self, job_id: int) -> OpenJob:
        return self._open[job_id]

    def get(self, job_id: int) -> OpenJob | None:
        """The open job `job_id`, if any."""
        return self._open.get(job_id)

    def has_saves(self) -> bool:
        """Whether a save is still open (and pins blocks)."""
        return any(o.job.kind is JobKind.SAVE for o in self._open.values())

    def issue(
        self,
        kind: JobKind,
        req_id: str,
        epoch: int,
        pairs: Sequence[tuple[int, int, int]],
        hashes: Sequence[bytes],
        *,
        pin: bool = False,
        finished: bool = False,
        token_ids: Sequence[int] = (),
    ) -> TransferJob:
        """Open a job over (group, block id, block index) `pairs`.

        `hashes` are the request's block hashes (indexed by block index),
        `token_ids` its tokens (for the store events of a save).
        With `pin` and a bound pool, the blocks are referenced until the
        job settles.
        """
        groups: tuple[int, ...] = ()
        block_ids: tuple[int, ...] = ()
        indices: tuple[int, ...] = ()
        if pairs:
            groups, block_ids, indices = zip(*pairs, strict=True)
        job = self._open_job(
            kind,
            req_id,
            epoch,
            block_ids,
            tuple([hashes[i] for i in indices]),
            groups=groups if any(groups) else (),
            pin=pin,
            finished=finished,
        )
        if self.events is not None and kind is JobKind.SAVE:
            blocks = zip(groups, indices, strict=True)
            self.events.save_issued(job.job_id, blocks, hashes, token_ids)
        return job

    def issue_range(
        self,
        kind: JobKind,
        req_id: str,
        epoch: int,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[bytes],
        *,
        groups: KVGroups,
        first: int,
        last: int,
        pin: bool = False,
        finished: bool = False,
        states: Sequence[StateOffer] | None = None,
        token_ids: Sequence[int] = (),
        layerwise: bool = False,
    ) -> TransferJob:
        """`issue` over blocks ``[first, last)`` of each group's table.

        One full-attention group (the common case) is cut from slices
        without building pairs; `last` is then clipped to the blocks and
        hashes there are, as `KVGroups.pairs` clips it.  `states`: the
        recurrent states a save stores (`KVGroups.pairs`).  `layerwise`
        (a load of one full-attention group only): vLLM schedules the
        request in this step (`TransferJob.layerwise`).
        """
        if not groups.one_full_group:
            pairs = groups.pairs(tables, first, last, states)
            return self.issue(
                kind,
                req_id,
                epoch,
                pairs,
                hashes,
                pin=pin,
                finished=finished,
                token_ids=token_ids,
            )
        block_ids = tables[0]
        last = min(last, len(block_ids), len(hashes))
        job = self._open_job(
            kind,
            req_id,
            epoch,
            tuple(block_ids[first:last]),
            tuple(hashes[first:last]),
            groups=(),
            pin=pin,
            finished=finished,
            layerwise=layerwise,
        )
        if self.events is not None and kind is JobKind.SAVE:
            blocks = ((0, i) for i in range(first, last))
            self.events.save_issued(job.job_id, blocks, hashes, token_ids)
        return job

    def _open_job(
        self,
        kind: JobKind,
        req_id: str,
        epoch: int,
        block_ids: tuple[int, ...],
        hashes: tuple[bytes, ...],
        *,
        groups: tuple[int, ...],
        pin: bool,
        finished: bool,
        layerwise: bool = False,
    ) -> TransferJob:
        """Record a job; `groups` is empty when every block is group 0."""
        pinned: list[Any] = []
        if pin and self.pool is not None:
            pinned = [self.pool.blocks[b] for b in block_ids]
            self.pool.touch(pinned)
        job = TransferJob(
            job_id=self._next,
            kind=kind,
            req_id=req_id,
            epoch=epoch,
            block_ids=block_ids,
            block_hashes=hashes,
            pinned=bool(pinned),
            finished=finished,
            group_ids=groups,
            layerwise=layerwise,
        )
        self._next += 1
        self._open[job.job_id] = OpenJob(job, pinned)
        if kind is JobKind.LOAD:
            if groups:
                self.hits.update(groups)
            else:
                self.hits[0] += len(block_ids)
        return job

    def take_hits(self) -> dict[int, int]:
        """Loaded blocks by group since the last call (stats)."""
        hits, self.hits = dict(self.hits), collections.Counter()
        return hits

    def settle(
        self, job_id: int, ok: int, failed: int
    ) -> tuple[TransferJob, bool] | None:
        """Count one report; (job, all ok) once every rank reported.

        A report of an unknown job is logged and ignored (None).
        """
        open_job = self._open.get(job_id)
        if open_job is None:
            log.warning("report for unknown transfer job %d", job_id)
            return None
        open_job.ok += ok
        open_job.failed += failed
        if open_job.ok + open_job.failed < self.world_size:
            return None
        del self._open[job_id]
        if open_job.pinned and self.pool is not None:
            self.pool.free_blocks(open_job.pinned)
        ok = open_job.failed == 0
        if self.events is not None:
            if open_job.job.kind is JobKind.SAVE:
                self.events.save_settled(job_id, ok=ok)
            elif open_job.invalid:
                self.events.load_failed(open_job.job, open_job.invalid)
        return open_job.job, ok


def save_range(
    tracker: Any,
    computed: int,
    block_size: int,
    *,
    prompt: bool,
    decode: bool,
    stopped: bool = False,
) -> tuple[int, int]:
    """Blocks ``[first, last)`` of a request to save now (maybe empty).

    `computed` tokens have their KV after this step; blocks are saved
    once full and hashed, from the last saved one on.  `prompt`: prompt
    blocks are saved (a producer); `decode`: so are the blocks generated
    tokens fill (``save_decode_cache``; never a token only sampled, whose
    KV is not computed yet).  Neither, or `stopped` (a cache reset came
    after the request's admission): nothing.
    """
    if not (prompt or decode) or stopped:
        return 0, 0
    bs, num_prompt = block_size, tracker.num_prompt_tokens
    limit = computed if decode else min(computed, num_prompt)
    last = min(limit, len(tracker.block_hashes) * bs) // bs
    first = tracker.num_saved_tokens // bs
    if not prompt:  # a consumer keeps only what it generated
        first = max(first, num_prompt // bs)
    return first, last
