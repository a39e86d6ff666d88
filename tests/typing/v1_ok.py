"""Must pass `mypy --strict`: issue 34's new API keeps its types
(fire_outcome, expected refusals, atomic over shared locks, retire_at)."""

from __future__ import annotations

import threading
from typing import assert_type

from examples.spill_pool import (
    CHUNKS,
    READS,
    Chunk,
    ChunkEvent,
    ChunkState,
    Read,
    ReadEvent,
    ReadState,
)
from lifecycle import LifecycleMachine, Outcome, Registry, atomic

lock = threading.RLock()
chunks = LifecycleMachine(CHUNKS, lock=lock)
reads = LifecycleMachine(READS, lock=lock)
assert_type(chunks, LifecycleMachine[ChunkState, ChunkEvent, Chunk, object])
blocks = Registry(chunks, Chunk, retire_at={ChunkState.ABSENT})
with atomic(chunks, reads):
    outcome = chunks.fire_outcome(Chunk(1), ChunkEvent.STORE)
    assert_type(outcome, Outcome[ChunkState, ChunkEvent])
    assert_type(outcome.state, ChunkState | None)
    by_key = blocks.fire_outcome(1, ChunkEvent.PIN)
    assert_type(by_key, Outcome[ChunkState, ChunkEvent])
    started = Registry(reads, Read).fire_outcome(
        "r", ReadEvent.START, data=(1, 2)
    )
    assert_type(started.source, ReadState | None)
assert_type(CHUNKS.expected_refusals, frozenset[tuple[ChunkState, ChunkEvent]])
