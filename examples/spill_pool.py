"""A host-RAM block pool that spills to disk: cyclic, composed, threaded.

Two lifecycles over the public ``lifecycle`` API only:

* ``CHUNKS`` - one per cached block (int keys), *cyclic* (no terminal
  state): stored in RAM, pinned by readers, spilled to disk by a worker
  thread (a spill can fail and fall back, or be cancelled by a read, which
  makes its completion stale), promoted back to RAM on a hit, dropped.
  An idle chunk (ABSENT) is retired from its registry (``retire_at=``),
  so the registry holds only the chunks in use.
* ``READS`` - one per request reading chunks: WAITING, READING, DONE.

Composition: "pin every chunk, start the read, undo the pins if the read
is refused" spans both tables.  Both machines share one lock and every
step runs under ``atomic(...)``, so no thread ever sees a read started
on chunks it has not pinned.  Because *every* call, on every thread,
holds that lock, the machines may run with ``thread_safe=False``.

Refusals that are normal outcomes (a pinned chunk is not spilled or
dropped; a read over budget waits) are ``expected_refusals``: counted,
traced, never raised, even in strict mode.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Sequence

import attrs

from lifecycle import (
    LifecycleMachine,
    Registry,
    Row,
    Table,
    Tracker,
    atomic,
    define_tracker,
)


class ChunkState(enum.Enum):
    """Where a cached block's bytes are."""

    ABSENT = "absent"
    RAM = "ram"
    SPILLING = "spilling"
    DISK = "disk"


class ChunkEvent(enum.StrEnum):
    """What happens to a cached block."""

    STORE = "store"
    PIN = "pin"
    UNPIN = "unpin"
    SPILL = "spill"
    SPILLED = "spilled"
    SPILL_FAILED = "spill_failed"
    DROP = "drop"


@define_tracker
class Chunk(Tracker[ChunkState, int]):
    """One block: its readers (pins)."""

    state: ChunkState = ChunkState.ABSENT
    readers: int = 0


def add_reader(chunk: Chunk, _data: object) -> None:
    """One more reader."""
    chunk.readers += 1


def drop_reader(chunk: Chunk, _data: object) -> None:
    """One reader less."""
    chunk.readers -= 1


def has_reader(chunk: Chunk, _data: object) -> bool:
    """The chunk is pinned (an unpin must match a pin)."""
    return chunk.readers > 0


def unpinned(chunk: Chunk, _data: object) -> bool:
    """Nobody reads the chunk: it may leave RAM."""
    return chunk.readers == 0


def cancel_spill(chunk: Chunk, _data: object) -> None:
    """A read wants the chunk in RAM: the spill in flight becomes stale."""
    chunk.epoch += 1
    chunk.readers += 1


C, CE = ChunkState, ChunkEvent
CHUNKS: Table[ChunkState, ChunkEvent, object, Chunk] = Table(
    [
        Row(C.ABSENT, CE.STORE, C.RAM),
        Row(C.RAM, CE.PIN, C.RAM, after=(add_reader,)),
        Row(C.RAM, CE.UNPIN, C.RAM, after=(drop_reader,), guard=has_reader),
        Row(C.RAM, CE.SPILL, C.SPILLING, guard=unpinned),
        Row(C.RAM, CE.DROP, C.ABSENT, guard=unpinned),
        Row(C.SPILLING, CE.SPILLED, C.DISK),
        Row(C.SPILLING, CE.SPILL_FAILED, C.RAM),  # falls back to RAM
        Row(C.SPILLING, CE.PIN, C.RAM, after=(cancel_spill,)),
        Row(C.DISK, CE.PIN, C.RAM, after=(add_reader,)),  # promoted on a hit
        Row(C.DISK, CE.DROP, C.ABSENT),
    ],
    initial=C.ABSENT,
    terminal=(),  # cyclic: a chunk is never done
    # Declining is the guards' job here, not an error.
    expected_refusals=[(C.RAM, CE.SPILL), (C.RAM, CE.DROP)],
    name="chunks",
    title="spill pool: one cached block",
)


class ReadState(enum.Enum):
    """A request reading chunks."""

    WAITING = "waiting"
    READING = "reading"
    DONE = "done"


class ReadEvent(enum.StrEnum):
    """What happens to a read."""

    START = "start"
    FINISH = "finish"
    ABORT = "abort"


@define_tracker
class Read(Tracker[ReadState]):
    """One request's read: the chunks it pinned."""

    state: ReadState = ReadState.WAITING
    keys: tuple[int, ...] = ()


BUDGET = 4
"""The most chunks one read may pin."""


def within_budget(_read: Read, keys: object) -> bool:
    """The read pins at most `BUDGET` chunks."""
    return isinstance(keys, tuple) and len(keys) <= BUDGET


def remember(read: Read, keys: object) -> None:
    """The read owns the pins of `keys` until it ends."""
    if isinstance(keys, tuple):
        read.keys = keys


R, RE = ReadState, ReadEvent
READS: Table[ReadState, ReadEvent, object, Read] = Table(
    [
        Row(
            R.WAITING,
            RE.START,
            R.READING,
            after=(remember,),
            guard=within_budget,
        ),
        Row(R.WAITING, RE.ABORT, R.DONE),
        Row(R.READING, RE.FINISH, R.DONE),
        Row(R.READING, RE.ABORT, R.DONE),
    ],
    initial=R.WAITING,
    terminal={R.DONE},
    total_events={RE.ABORT},
    expected_refusals=[RE.START],  # over budget: the read waits
    name="reads",
    title="spill pool: one read",
)


@attrs.frozen
class Spill:
    """A spill job for the worker: the chunk and the epoch it was issued in."""

    key: int
    epoch: int


class SpillPool:
    """The two registries, one lock, and the composed steps."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # Every call below holds `self.lock`: the machines need no own.
        chunks = LifecycleMachine(CHUNKS, lock=self.lock, thread_safe=False)
        reads = LifecycleMachine(READS, lock=self.lock, thread_safe=False)
        self.chunks = Registry(chunks, Chunk, retire_at={C.ABSENT})
        self.reads = Registry(reads, Read)
        self.machines = (chunks, reads)

    def store(self, key: int) -> bool:
        """Cache `key` in RAM (False if it is cached already)."""
        with atomic(*self.machines):
            if key in self.chunks:
                return False
            self.chunks.get_or_create(key)
            return self.chunks.fire(key, CE.STORE)

    def start_read(self, req_id: str, keys: Sequence[int]) -> bool:
        """Pin every chunk of `keys` and start the read, or change nothing.

        False when a chunk is not cached or the read is over budget (an
        expected refusal): the pins taken so far are undone in the same
        atomic step.
        """
        with atomic(*self.machines):
            pinned: list[int] = []
            for key in keys:
                if key not in self.chunks or not self.chunks.fire(key, CE.PIN):
                    break
                pinned.append(key)
            else:
                self.reads.get_or_create(req_id)
                if self.reads.fire(req_id, RE.START, data=tuple(keys)):
                    return True
                self.reads.discard(req_id)
            for key in pinned:  # undo: the read never started
                self.chunks.fire(key, CE.UNPIN)
            return False

    def finish_read(self, req_id: str) -> None:
        """End a read and release its pins."""
        with atomic(*self.machines):
            read = self.reads.get(req_id)
            if read is None or not self.reads.fire(req_id, RE.FINISH):
                return
            for key in read.keys:
                self.chunks.fire(key, CE.UNPIN)

    def spill(self, key: int) -> Spill | None:
        """Start spilling `key`; None if it is pinned (declined) or absent."""
        with atomic(*self.machines):
            chunk = self.chunks.get(key)
            if chunk is None:
                return None
            outcome = self.chunks.machine.fire_outcome(chunk, CE.SPILL)
            return Spill(key, chunk.epoch) if outcome else None

    def spill_done(self, job: Spill, *, ok: bool) -> bool:
        """The worker's report; a cancelled spill's is stale (ignored)."""
        event = CE.SPILLED if ok else CE.SPILL_FAILED
        with atomic(*self.machines):
            return self.chunks.fire_if_tracked(job.key, event, epoch=job.epoch)

    def drop(self, key: int) -> bool:
        """Evict `key` (declined while pinned, skipped while spilling).

        An evicted chunk retires from the registry (``retire_at=``).
        """
        with atomic(*self.machines):
            chunk = self.chunks.get(key)
            if chunk is None or not self.chunks.machine.can_fire(
                chunk, CE.DROP
            ):
                return False
            return self.chunks.fire_on(chunk, CE.DROP)

    def check(self) -> list[str]:
        """Invariants, read atomically: pins match the reads in flight."""
        with atomic(*self.machines):
            pins: dict[int, int] = {}
            for read in self.reads:
                if read.state is R.READING:
                    for key in read.keys:
                        pins[key] = pins.get(key, 0) + 1
            return [
                f"chunk {c.req_id} in {c.state.name}: {c.readers} readers, "
                f"{pins.get(c.req_id, 0)} reads"
                for c in self.chunks
                if c.readers != pins.get(c.req_id, 0)
                or (c.readers and c.state is not C.RAM)
            ]


READ_ROUNDS = 2
"""Rounds a read lasts in `run`."""


def run(rounds: int = 300, keys: int = 12) -> dict[str, int]:
    """The scheduler loop on this thread, spills completed by a worker.

    Every round stores, reads, spills and drops a few chunks; the worker
    completes each spill (one in five fails).  Returns counters, the
    illegal orderings (0) and the invariant violations seen (0).
    """
    pool = SpillPool()
    jobs: queue.Queue[Spill | None] = queue.Queue()
    ignored = [0]

    def worker() -> None:
        done = 0
        while (job := jobs.get(timeout=30)) is not None:
            done += 1
            if not pool.spill_done(job, ok=done % 5 != 0):
                ignored[0] += 1  # cancelled by a read, or evicted since

    thread = threading.Thread(target=worker, name="spill-worker")
    thread.start()
    violations = 0
    started = 0
    try:
        for i in range(rounds):
            pool.store(i % keys)
            wanted = [(i + j) % keys for j in range(1 + i % 6)]
            if pool.start_read(f"r{i}", wanted):
                started += 1
            if (job := pool.spill((i * 7) % keys)) is not None:
                jobs.put(job)
            if i >= READ_ROUNDS:
                pool.finish_read(f"r{i - READ_ROUNDS}")
            pool.drop((i * 5) % keys)
            violations += len(pool.check())
    finally:
        jobs.put(None)
        thread.join(timeout=30)
    chunks, reads = pool.machines
    return {
        "reads_started": started,
        "declined": sum(chunks.guard_counts.values())
        + sum(reads.guard_counts.values()),
        "ignored_spill_reports": ignored[0],
        "live_chunks": len(pool.chunks),
        "illegal": chunks.illegal_total + reads.illegal_total,
        "violations": violations + len(pool.check()),
    }


if __name__ == "__main__":
    print(run())  # noqa: T201 - the example's output
