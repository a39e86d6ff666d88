"""Must FAIL `mypy --strict`, exactly on the lines marked ``# E:``:
issue 34's new API rejects keys, states and events of other tables."""

from __future__ import annotations

from examples.spill_pool import (
    CHUNKS,
    READS,
    Chunk,
    ChunkEvent,
    ReadEvent,
    ReadState,
)
from lifecycle import LifecycleMachine, Registry

chunks = LifecycleMachine(CHUNKS)
blocks = Registry(chunks, Chunk)
blocks.fire_outcome("1", ChunkEvent.PIN)  # E: Argument 1 to "fire_outcome" of "Registry" has incompatible type "str"; expected "int"
chunks.fire_outcome(Chunk(1), ReadEvent.START)  # E: Argument 2 to "fire_outcome" of "LifecycleMachine" has incompatible type "ReadEvent"; expected "ChunkEvent"
Registry(chunks, Chunk, retire_at={ReadState.WAITING})  # E: Cannot infer value of type parameter "S" of "Registry"
LifecycleMachine(READS, lock=3)  # E: Argument "lock" to "LifecycleMachine" has incompatible type "int"; expected "RLock | None"
