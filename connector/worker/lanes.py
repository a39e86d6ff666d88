"""Lanes: how each KV cache group's blocks move on a worker.

A hybrid model's transfer job lists (group, block) pairs
(`connector.groups`); a worker moves each group's blocks through its own
lane: the group's store keys and a transfer over the group's layers.  A
model with one group has one lane.  No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from connector.metadata import JobKind, TransferJob

__all__ = ["Lane", "move_blocks"]


@attrs.frozen
class Lane:
    """How one KV cache group's blocks move on a worker.

    Attributes:
        keys: The group's store keys (its ``g<group>`` scheme).
        transfer: Moves the group's layers of a block.
        block_bytes: Bytes of one of the group's blocks (all its layers).
    """

    keys: Any
    transfer: Any
    block_bytes: int


def move_blocks(
    lanes: Sequence[Lane], store: Any, job: TransferJob, fences: Sequence[Any]
) -> list[bool]:
    """Run `job` group by group; one success flag per (group, block)."""
    flags = [False] * len(job.block_ids)
    positions: dict[int, list[int]] = {}
    for pos, group in enumerate(job.groups()):
        positions.setdefault(group, []).append(pos)
    for group, where in positions.items():
        lane = lanes[group]
        keys = lane.keys.keys([job.block_hashes[p] for p in where])
        ids = [job.block_ids[p] for p in where]
        if job.kind is JobKind.LOAD:
            got = lane.transfer.load(store, keys, ids)
        else:
            got = lane.transfer.save(store, keys, ids, fences[group])
        for pos, ok in zip(where, got, strict=True):
            flags[pos] = ok
    return flags
