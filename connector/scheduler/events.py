"""What the scheduler half tells KV-aware routers about the store.

A router (vLLM's KV-event publisher feeding Dynamo, llm-d, ...) routes a
request to the instance that serves its prefix cheapest; with a shared
store it needs to know which blocks the store holds.  `StoreEvents`
turns the scheduler half's own facts into three plain records:

- `Stored`: a save job settled ok on every rank, so the store holds its
  blocks (one record per KV cache group and contiguous run of blocks,
  with the parent hash and the blocks' token ids);
- `Removed`: a load failed for these blocks, so the store no longer
  serves them (an evicted key, a dead peer's segment, an outage: the
  router stops counting them until a save announces them again);
- `Cleared`: the store was wiped (a reset).

Recording is off unless vLLM's KV events are on (the facade passes no
`StoreEvents` then), so a deployment without routers pays nothing.  A
save's record is prepared when the job is issued (the request may be gone
when it settles) and published only when it settles ok.  No vLLM import:
the facade turns the records into vLLM's event classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from connector.metadata import TransferJob

#: Records kept at most between two `take` calls; older ones are dropped
#: (vLLM takes them every step, so only a stalled engine reaches it).
MAX_RECORDS: Final = 65536


@attrs.frozen
class Stored:
    """The store now holds a run of a request's blocks of one group.

    Attributes:
        group: The KV cache group.
        hashes: vLLM's chained block hashes of the run, in order.
        parent: The hash of the block before the run (None: the run
            starts the prefix).
        token_ids: The run's tokens (``block_size`` per block).
        block_size: Tokens per block.
    """

    group: int
    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


@attrs.frozen
class Removed:
    """The store no longer serves these blocks of one group."""

    group: int
    hashes: tuple[bytes, ...]


@attrs.frozen
class Cleared:
    """The store was wiped."""


Record = Stored | Removed | Cleared


class StoreEvents:
    """Store records of one scheduler half, taken once per step.

    Args:
        block_size: Tokens per block hash (vLLM's hash block size).
        group_block_sizes: Tokens per block of each KV cache group, by
            group index (default: `block_size` for every group).
    """

    def __init__(
        self,
        block_size: int,
        group_block_sizes: Sequence[int] = (),
    ) -> None:
        self.block_size = block_size
        self._group_sizes = tuple(group_block_sizes)
        self._saving: dict[int, tuple[Stored, ...]] = {}
        self._out: list[Record] = []
        self.dropped = 0

    def __len__(self) -> int:
        """Records waiting to be taken."""
        return len(self._out)

    @property
    def saving(self) -> int:
        """Save jobs whose record waits for the job to settle."""
        return len(self._saving)

    def save_issued(
        self,
        job_id: int,
        blocks: Iterable[tuple[int, int]],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
    ) -> None:
        """Prepare the records of save job `job_id`.

        Args:
            job_id: The save job.
            blocks: (group, block index) of every block the job saves.
            hashes: The request's block hashes, by block index.
            token_ids: The request's tokens.
        """
        runs: dict[int, list[int]] = {}
        for group, index in blocks:
            runs.setdefault(group, []).append(index)
        records = []
        bs = self.block_size
        for group, indices in sorted(runs.items()):
            for run in _contiguous(sorted(indices)):
                first, last = run[0], run[-1] + 1
                records.append(
                    Stored(
                        group=group,
                        hashes=tuple(hashes[first:last]),
                        parent=hashes[first - 1] if first > 0 else None,
                        token_ids=tuple(token_ids[first * bs : last * bs]),
                        block_size=self._group_size(group),
                    )
                )
        if records:
            self._saving[job_id] = tuple(records)

    def save_settled(self, job_id: int, *, ok: bool) -> None:
        """Publish the job's records if it stored on every rank."""
        records = self._saving.pop(job_id, ())
        if ok:
            self._emit(*records)

    def load_failed(self, job: TransferJob, invalid: Iterable[int]) -> None:
        """A load failed for the blocks of `job` in `invalid`."""
        failed = set(invalid)
        by_group: dict[int, list[bytes]] = {}
        for group, block, block_hash in zip(
            job.groups(), job.block_ids, job.block_hashes, strict=True
        ):
            if block in failed:
                by_group.setdefault(group, []).append(block_hash)
        self._emit(
            *(Removed(g, tuple(h)) for g, h in sorted(by_group.items()))
        )

    def cleared(self) -> None:
        """The store was wiped: saves in flight announce nothing."""
        self._saving.clear()
        self._emit(Cleared())

    def take(self) -> list[Record]:
        """The records since the last call, oldest first."""
        out, self._out = self._out, []
        return out

    def _emit(self, *records: Record) -> None:
        self._out.extend(records)
        over = len(self._out) - MAX_RECORDS
        if over > 0:
            del self._out[:over]
            self.dropped += over

    def _group_size(self, group: int) -> int:
        if group < len(self._group_sizes):
            return self._group_sizes[group]
        return self.block_size


def _contiguous(indices: Sequence[int]) -> list[list[int]]:
    """Sorted indices cut into runs of consecutive ones."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] + 1 == index:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs
