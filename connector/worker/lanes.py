"""Lanes: how each KV cache group's blocks move on a worker.

A hybrid model's transfer job lists (group, block) pairs
(`connector.groups`); a worker moves each group's blocks through its own
lane: the group's store keys and a transfer over the group's layers.  A
model with one group has one lane.  No vLLM import.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from connector.groups import NULL_BLOCK
from connector.metadata import JobKind, TransferJob
from connector.worker.deadline import Runners, side_by_side
from connector.worker.transfer import filled_by_layer

if TYPE_CHECKING:
    from connector.worker.deadline import Deadline

__all__ = ["Lane", "move_blocks"]


@attrs.frozen
class Lane:
    """How one KV cache group's blocks move on a worker.

    Attributes:
        keys: The group's store keys (its ``g<group>`` scheme).
        transfer: Moves the group's layers of a block.
        block_bytes: Bytes of one of the group's blocks (all its layers).
        writes: Whether this rank puts the group's blocks.  False on a
            rank whose KV another rank holds identically and writes (a
            replica): its saves succeed without a put.
    """

    keys: Any
    transfer: Any
    block_bytes: int
    writes: bool = True


def move_blocks(
    lanes: Sequence[Lane],
    store: Any,
    job: TransferJob,
    fences: Sequence[Any],
    deadline: Deadline | None = None,
    *,
    runners: Runners | None = None,
) -> list[bool]:
    """Run `job` group by group; one success flag per (group, block).

    A load's blocks not in by `deadline` fail.  A hybrid load's pair
    naming vLLM's null block never moves: it reads as failed (a load
    into it would be a hit whose KV, or state, nobody restored).  A
    layer-wise save of several groups (their fences filled layer by
    layer) moves them side by side on `runners`, so each group's gather
    follows the forward, not only the first group's.
    """
    flags = [False] * len(job.block_ids)
    positions: dict[int, list[int]] = {}
    hybrid_load = job.kind is JobKind.LOAD and bool(job.group_ids)
    for pos, group in enumerate(job.groups()):
        if not (hybrid_load and job.block_ids[pos] == NULL_BLOCK):
            positions.setdefault(group, []).append(pos)
    moves = []
    wheres = []
    for group, where in positions.items():
        lane = lanes[group]
        if job.kind is JobKind.SAVE and not lane.writes:
            for pos in where:  # a replica: its writer puts these bytes
                flags[pos] = True
            continue
        keys = lane.keys.keys([job.block_hashes[p] for p in where])
        ids = [job.block_ids[p] for p in where]
        if job.kind is JobKind.LOAD:
            move = functools.partial(
                lane.transfer.load, store, keys, ids, deadline
            )
        else:
            move = functools.partial(
                lane.transfer.save, store, keys, ids, fences[group]
            )
        moves.append(move)
        wheres.append(where)
    together = (
        job.kind is JobKind.SAVE
        and len(moves) > 1
        and any(filled_by_layer(fences[group]) for group in positions)
    )
    if together and runners is not None:
        got = side_by_side(runners, moves, [len(w) for w in wheres])
    else:
        got = [move() for move in moves]
    for where, per_group in zip(wheres, got, strict=True):
        for pos, ok in zip(where, per_group, strict=True):
            flags[pos] = ok
    return flags
