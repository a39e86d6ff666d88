"""What the facade reads off vLLM's config to build the halves' keys.

- `key_layout`: one KV cache group's block shape as a store key sees it;
- `Schemes`: the store key scheme of every (TP rank, KV cache group);
- `tp_rank`: this worker's tensor-parallel rank.

vLLM objects are read by attribute; only `tp_rank` imports vLLM (late,
on a worker).
"""

from __future__ import annotations

from typing import Any

import attrs

from connector.store.keys import KeyLayout, KeyScheme

__all__ = ["Schemes", "key_layout", "tp_rank"]


def key_layout(kv_cache_config: Any, index: int = 0) -> KeyLayout:
    """The layout of KV cache group `index` (its spec over all its layers)."""
    group = kv_cache_config.kv_cache_groups[index]
    spec = group.kv_cache_spec
    layers = len(group.layer_names)
    return KeyLayout(
        dtype=str(spec.dtype).removeprefix("torch."),
        block_tokens=spec.block_size,
        block_bytes=spec.page_size_bytes * layers,
        detail=f"{layers}layers",
    )


@attrs.frozen
class Schemes:
    """Store key schemes of one model, per (TP rank, KV cache group).

    Attributes:
        namespace: The store namespace (`StoreConfig.namespace`).
        model: The model's name (the last part of its path).
        tp_size: Tensor-parallel ranks.
        layouts: Per KV cache group (by index), its key layout.
    """

    namespace: str
    model: str
    tp_size: int
    layouts: tuple[KeyLayout, ...]

    def scheme(self, rank: int, group: int = 0) -> KeyScheme:
        """The keys TP rank `rank` writes for KV cache group `group`."""
        return KeyScheme(
            namespace=self.namespace,
            model=self.model,
            tp_rank=rank,
            tp_size=self.tp_size,
            layout=self.layouts[group],
            kv_group=group,
        )

    def of_rank(self, rank: int) -> list[KeyScheme]:
        """One rank's scheme per group, by group index."""
        return [self.scheme(rank, g) for g in range(len(self.layouts))]

    def every_shard(self) -> tuple[KeyScheme, ...]:
        """Every (group, rank) scheme, group-major: what a lookup asks."""
        return tuple(
            self.scheme(r, g)
            for g in range(len(self.layouts))
            for r in range(self.tp_size)
        )


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 outside a TP worker)."""
    try:
        from vllm.distributed import (  # noqa: PLC0415 - needs a worker
            get_tensor_model_parallel_rank,
        )

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        return 0
