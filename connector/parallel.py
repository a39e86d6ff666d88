"""Tensor parallelism: which KV a rank holds, which keys it uses, who writes.

Two store layouts:

* **Per rank** (the default): one object per block and *KV shard*.  Ranks
  holding identical KV (``kv_replicas`` of them: GQA with more ranks than
  KV heads, or MLA, where every rank holds everything) share one key, and
  only the first rank of each replica set writes it; every rank reads it.
  Deployments of the same TP size share prefixes; MLA and single-KV-head
  models (one shard at any TP size) share across TP sizes too.
* **Shared by head shard** (``store_tp_size``, or the least common multiple
  of ``prefill_tp_sizes``): every block is stored as ``store_tp_size``
  objects, object ``s`` holding KV heads ``[s * h, (s + 1) * h)`` with
  ``h = num_kv_heads / store_tp_size``, over every layer.  A rank of an
  instance of TP size ``t`` (``t`` dividing ``store_tp_size``) holds
  ``store_tp_size / t`` consecutive objects, so instances of different TP
  sizes read each other's blocks, head slice by head slice.  The key
  fingerprint names the model's KV head count and the object's bytes, so
  different head counts, dtypes or block sizes never share a key.

No vLLM import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs

from connector.config import ParallelKVConfig
from connector.errors import ConfigError
from connector.store.keys import KeyLayout, KeyScheme

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "HEAD_SHARDED",
    "ParallelKVConfig",  # read in connector.config, re-exported
    "ShardKeys",
    "TPPlan",
]

HEAD_SHARDED: Final = "heads"
"""Marker of the head-sharded layout in a key's layout detail."""

_KEY: Final = "store_tp_size"


@attrs.frozen
class TPPlan:
    """One rank's place in a tensor-parallel instance.

    Attributes:
        tp_rank: This rank.
        tp_size: Ranks in the instance.
        num_kv_heads: The model's KV heads (all ranks together).
        replicated: Every rank holds all the KV (MLA).
        store_tp: Head shards per stored block (the shared layout), or
            None (per rank).

    Raises:
        ConfigError: ``store_tp`` does not divide the KV heads or is not a
            multiple of ``tp_size``.
    """

    tp_rank: int = 0
    tp_size: int = 1
    num_kv_heads: int = 1
    replicated: bool = False
    store_tp: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            msg = f"tp_rank {self.tp_rank} not in a TP size {self.tp_size}"
            raise ValueError(msg)
        if self.num_kv_heads <= 0:
            msg = f"num_kv_heads must be positive, got {self.num_kv_heads}"
            raise ValueError(msg)
        if not self.shared:
            return
        store_tp = self.store_tp or 1
        if store_tp % self.tp_size:
            reason = f"must be a multiple of the TP size {self.tp_size}"
            raise ConfigError(_KEY, store_tp, reason)
        if self.num_kv_heads % store_tp:
            reason = f"must divide the model's {self.num_kv_heads} KV heads"
            raise ConfigError(_KEY, store_tp, reason)

    @classmethod
    def of_vllm(
        cls, vllm_config: Any, rank: int, config: ParallelKVConfig
    ) -> TPPlan:
        """Rank `rank` of the instance `vllm_config` describes.

        Raises:
            ConfigError: as the constructor.
        """
        model = vllm_config.model_config
        return cls(
            tp_rank=rank,
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            num_kv_heads=int(model.get_total_num_kv_heads()),
            replicated=bool(getattr(model, "use_mla", False)),
            store_tp=config.shared_tp,
        )

    @property
    def plain(self) -> bool:
        """One object per block, put by this rank: no lane of its own."""
        return not self.shared and self.writes

    @property
    def shared(self) -> bool:
        """Whether blocks are stored by head shard.

        Replicated KV (MLA, one KV head) has one shard at any TP size and
        always uses the per-rank layout, which already shares it.
        """
        return self.store_tp is not None and not self.single_shard

    @property
    def single_shard(self) -> bool:
        """Every rank holds the same KV (MLA or a single KV head)."""
        return self.replicated or self.num_kv_heads == 1

    @property
    def kv_replicas(self) -> int:
        """Consecutive ranks holding identical KV (1: all distinct)."""
        if self.single_shard:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def writes(self) -> bool:
        """Whether this rank puts its KV: one rank per distinct shard."""
        return self.shared or self.tp_rank % self.kv_replicas == 0

    @property
    def local_heads(self) -> int:
        """KV heads in this rank's cache."""
        if self.single_shard:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def shards_per_rank(self) -> int:
        """Store objects per block this rank holds (1 per rank)."""
        return (self.store_tp or 1) // self.tp_size if self.shared else 1

    @property
    def store_shards(self) -> range:
        """The head shards this rank holds (shared layout)."""
        k = self.shards_per_rank
        return range(self.tp_rank * k, (self.tp_rank + 1) * k)

    def shard_layout(self, layout: KeyLayout) -> KeyLayout:
        """The fingerprint of one stored object, from this rank's block."""
        if not self.shared:
            return layout
        k = self.shards_per_rank
        detail = f"{layout.detail}.{HEAD_SHARDED}{self.num_kv_heads}"
        return attrs.evolve(
            layout, block_bytes=layout.block_bytes // k, detail=detail
        )

    def schemes(
        self, scheme: KeyScheme, *, ranks: Sequence[int] | None = None
    ) -> tuple[KeyScheme, ...]:
        """Key schemes of this rank's objects (one per head shard held).

        Args:
            scheme: The rank's per-rank scheme (its namespace, model,
                group and layout), tp fields ignored.
            ranks: Every rank's instead (a lookup asks for them all),
                each distinct key once.
        """
        if self.shared:
            store_tp = self.store_tp or 1
            every = ranks is not None
            shards = range(store_tp) if every else self.store_shards
            layout = self.shard_layout(scheme.layout)
            return tuple(
                attrs.evolve(
                    scheme,
                    tp_rank=s,
                    tp_size=store_tp,
                    kv_replicas=1,
                    layout=layout,
                )
                for s in shards
            )
        chosen = [self.tp_rank] if ranks is None else list(ranks)
        out: dict[str, KeyScheme] = {}
        for rank in chosen:
            one = attrs.evolve(
                scheme,
                tp_rank=rank,
                tp_size=self.tp_size,
                kv_replicas=self.kv_replicas,
            )
            out.setdefault(one.prefix, one)
        return tuple(out.values())


@attrs.frozen
class ShardKeys:
    """The keys of a rank's head shards, shard-major (`Sharded` order).

    ``attrs.evolve(keys, generation=g)`` re-keys every shard under the
    weights generation ``g``, as it does a `KeyScheme`.
    """

    schemes: tuple[KeyScheme, ...]
    generation: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.generation is not None:
            schemes = tuple(
                attrs.evolve(s, generation=self.generation)
                for s in self.schemes
            )
            object.__setattr__(self, "schemes", schemes)

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """Every shard's key of every block, shard by shard."""
        return [k for s in self.schemes for k in s.keys(block_hashes)]
