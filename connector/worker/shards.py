"""Moving a rank's head shards: one store object per slice of KV heads.

The head-sharded store layout (`connector.parallel`) stores a block as
several objects, one per slice of KV heads.  `head_pieces` views one slice
of every layer's block; `Sharded` moves a rank's slices together, one
transfer each.  No vLLM import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Protocol

from connector.errors import ConfigError
from connector.worker.deadline import Deadline, Runners, side_by_side
from connector.worker.lanes import Lane
from connector.worker.pieces import (
    BlockStore,
    CopyWaits,
    HeadSlice,
    HostMemory,
    Register,
    head_pieces,
)
from connector.worker.transfer import (
    LayerWise,
    SaveWaits,
    Transfer,
    filled_by_layer,
    open_transfer,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import torch

__all__ = [
    "HeadSlice",
    "ShardPlan",
    "Sharded",
    "group_lane",
    "head_pieces",
    "sharded_transfer",
]


class ShardPlan(Protocol):
    """What a rank's lanes read of its tensor-parallel plan.

    `connector.parallel.TPPlan` is one; the worker side does not import
    it (nor the store's keys), so it stays apart from the key layout.
    """

    @property
    def shared(self) -> bool:
        """Blocks are stored by head shard."""

    @property
    def writes(self) -> bool:
        """This rank puts its KV."""

    @property
    def local_heads(self) -> int:
        """KV heads in this rank's cache."""

    @property
    def shards_per_rank(self) -> int:
        """Store objects per block this rank holds."""

    @property
    def store_tp(self) -> int | None:
        """Head shards per stored block, or None (per rank)."""


class Sharded:
    """Several transfers over one block each: the head shards a rank holds.

    `save` and `load` take the keys shard-major (every block's key of the
    first shard, then of the second ...); a block moved when every shard
    of it did.  Saves follow the forward layer by layer (`layer_waits`)
    when every part's can (`waits_by_layer`).

    Args:
        parts: One transfer per head shard, in shard order.
    """

    def __init__(self, parts: Sequence[Transfer]) -> None:
        if not parts:
            msg = "no shard to move"
            raise ValueError(msg)
        self.parts = tuple(parts)
        self._runners: Runners | None = None

    @property
    def registered(self) -> tuple[int, ...]:
        """Every shard's registered addresses (load staging grows later)."""
        return tuple(a for p in self.parts for a in p.registered)

    @property
    def waits_by_layer(self) -> bool:
        """Whether every shard's save can follow the forward by layer."""
        return all(part.waits_by_layer for part in self.parts)

    def layer_written(self, layer: str) -> None:
        """Every shard's transfer marks the layer."""
        for part in self.parts:
            part.layer_written(layer)

    def layer_waits(self) -> tuple[SaveWaits, ...]:
        """One fence filled layer by layer per shard, in shard order.

        `fence` closes them all.

        Raises:
            TypeError: a shard's transfer cannot save layer-wise (check
                `waits_by_layer` first).
        """
        waits = []
        for part in self.parts:
            if not isinstance(part, LayerWise) or not part.waits_by_layer:
                msg = f"{type(part).__name__} cannot save layer by layer"
                raise TypeError(msg)
            waits.append(part.layer_waits())
        return tuple(waits)

    def drop_layer_waits(self) -> None:
        """Fail every shard's save still waiting on this step's layers."""
        for part in self.parts:
            if isinstance(part, LayerWise):
                part.drop_layer_waits()

    def close(self) -> None:
        """Stop the side-by-side moves' idle runner threads.

        A later move starts new ones.
        """
        if self._runners is not None:
            self._runners.close()

    def fence(self) -> CopyWaits:
        """One fence per shard."""
        return tuple(part.fence() for part in self.parts)

    def _split(self, keys: Sequence[str], count: int) -> list[Sequence[str]]:
        if len(keys) != count * len(self.parts):
            shards = len(self.parts)
            msg = f"{len(keys)} keys for {count} blocks of {shards} shards"
            raise ValueError(msg)
        return [
            keys[i * count : (i + 1) * count] for i in range(len(self.parts))
        ]

    def save(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        fence: CopyWaits,
    ) -> list[bool]:
        """Put every shard of every block.

        Given layer-wise fences (`layer_waits`), the shards save side by
        side (`_side_by_side`), so every shard's gather follows the forward
        (one after another, a shard would start only once the one before
        it had its last layer); the call returns once all ended and
        raises the first shard's error, if any.
        """
        fences = fence or ((),) * len(self.parts)
        saves = list(
            zip(
                self.parts,
                self._split(keys, len(block_ids)),
                fences,
                strict=True,
            )
        )
        if len(saves) > 1 and filled_by_layer(fences):
            got = self._side_by_side(
                [
                    functools.partial(part.save, store, k, block_ids, f)
                    for part, k, f in saves
                ],
                len(block_ids),
            )
        else:
            got = [part.save(store, k, block_ids, f) for part, k, f in saves]
        return [all(per_shard) for per_shard in zip(*got, strict=True)]

    def load(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline: Deadline | None = None,
    ) -> list[bool]:
        """Get every shard of every block, each shard by `deadline`.

        A load the forward waits for layer by layer (``by_layer``) reads
        its shards side by side, each in spans of layers where it can: a
        layer is landed once every shard wrote it (``deadline.writers``),
        so the first layer's wait is one span of each shard, not every
        shard whole.  Otherwise the shards are read one after another.
        """
        split = self._split(keys, len(block_ids))
        if deadline is not None and deadline.by_layer and len(self.parts) > 1:
            got = self._load_together(store, split, block_ids, deadline)
        else:
            got = [
                part.load(store, part_keys, block_ids, deadline)
                for part, part_keys in zip(self.parts, split, strict=True)
            ]
        return [all(flags) for flags in zip(*got, strict=True)]

    def _load_together(
        self,
        store: BlockStore,
        split: list[Sequence[str]],
        block_ids: Sequence[int],
        deadline: Deadline,
    ) -> list[list[bool]]:
        """Every shard's load at once, each bounded by `deadline`."""
        deadline.writers = len(self.parts)
        return self._side_by_side(
            [
                functools.partial(part.load, store, k, block_ids, deadline)
                for part, k in zip(self.parts, split, strict=True)
            ],
            len(block_ids),
            bound=deadline,
        )

    def _side_by_side(
        self,
        moves: Sequence[Callable[[], list[bool]]],
        count: int,
        *,
        bound: Deadline | None = None,
    ) -> list[list[bool]]:
        """Every shard's move at once (`side_by_side`).

        On this transfer's runner threads, made on first use.
        """
        if self._runners is None:
            self._runners = Runners("kv-lifecycle-shard")
        return side_by_side(
            self._runners, moves, [count] * len(moves), bound=bound
        )


def sharded_transfer(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    regions: Any,
    register: Register,
    plan: ShardPlan,
    *,
    staging_blocks: int | None = None,
    deadlines: bool = False,
    memory: HostMemory | None = None,
) -> Sharded:
    """One transfer per head shard the rank holds, memory registered once.

    Each shard's transfer is `open_transfer`'s, with `staging_blocks`
    (None: host caches zero copy), `deadlines` and `memory`.

    Raises:
        ConfigError: (``store_tp_size``) the KV blocks are not head-major.
    """
    per_shard = plan.local_heads // plan.shards_per_rank
    parts = []
    for index in range(plan.shards_per_rank):
        heads = HeadSlice(index * per_shard, per_shard, plan.local_heads)
        try:
            parts.append(
                open_transfer(
                    kv_caches,
                    num_blocks,
                    regions,
                    register=register,
                    heads=heads,
                    staging_blocks=staging_blocks,
                    deadlines=deadlines,
                    memory=memory,
                )
            )
        except ValueError as exc:
            key = "store_tp_size"
            raise ConfigError(key, plan.store_tp, str(exc)) from exc
    return Sharded(parts)


def group_lane(
    kv_caches: Mapping[str, torch.Tensor],
    num_blocks: int,
    regions: Any,
    *,
    register: Register,
    plan: ShardPlan,
    keys: Any,
    block_bytes: int,
    staging_blocks: int | None = None,
    deadlines: bool = False,
    memory: HostMemory | None = None,
) -> Lane:
    """How one KV cache group's blocks move on this rank.

    Head-sharded: one transfer per head shard the rank holds, `keys`
    shard-major (`connector.parallel.ShardKeys`).  Per rank: one transfer
    and the rank's scheme.  With `staging_blocks` (layer-wise saves),
    host caches are staged too, in that many blocks, so saves can follow
    the forward layer by layer.  A replica rank's lane does not write:
    its saves read no KV, so it is never staged for them (its loads stay
    zero copy on host caches).  With `deadlines`, remote loads land in
    staging memory first (`open_transfer`); with `memory` (a dummy
    client's), every block is staged in it.

    Raises:
        ConfigError: (``store_tp_size``) the KV blocks are not head-major.
    """
    transfer: Transfer
    if not plan.writes:
        staging_blocks = None
    if plan.shared:
        transfer = sharded_transfer(
            kv_caches,
            num_blocks,
            regions,
            register,
            plan,
            staging_blocks=staging_blocks,
            deadlines=deadlines,
            memory=memory,
        )
    else:
        transfer = open_transfer(
            kv_caches,
            num_blocks,
            regions,
            register=register,
            staging_blocks=staging_blocks,
            deadlines=deadlines,
            memory=memory,
        )
    return Lane(keys, transfer, block_bytes, writes=plan.writes)
