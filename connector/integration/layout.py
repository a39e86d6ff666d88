"""What the facade reads off vLLM's config to build the halves' keys.

- `key_layout`: one KV cache group's block shape as a store key sees it;
- `Schemes`: the store key scheme of every (TP rank, KV cache group);
- `tp_rank`: this worker's tensor-parallel rank (an error, never a guess);
- `pipeline_size`: vLLM's pipeline-parallel size, refused unless 1.

vLLM objects are read by attribute; only `tp_rank` imports vLLM (late,
on a worker).
"""

from __future__ import annotations

from typing import Any

import attrs

from connector.errors import ParallelRankError, UnsupportedParallelism
from connector.store.keys import KeyLayout, KeyScheme

__all__ = ["Schemes", "key_layout", "pipeline_size", "tp_rank"]


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
        model: The model's name or path as configured (never shortened).
        tp_size: Tensor-parallel ranks.
        layouts: Per KV cache group (by index), its key layout.
        revision: The model revision (``""``: none configured).
        generation: The weights generation the keys name.
        pp_size: Pipeline-parallel stages.
    """

    namespace: str
    model: str
    tp_size: int
    layouts: tuple[KeyLayout, ...]
    revision: str = ""
    generation: str = ""
    pp_size: int = 1

    def scheme(self, rank: int, group: int = 0) -> KeyScheme:
        """The keys TP rank `rank` writes for KV cache group `group`."""
        return KeyScheme(
            namespace=self.namespace,
            model=self.model,
            revision=self.revision,
            generation=self.generation,
            tp_rank=rank,
            tp_size=self.tp_size,
            pp_rank=0,
            pp_size=self.pp_size,
            layout=self.layouts[group],
            kv_group=group,
        )

    def of_generation(self, generation: str) -> Schemes:
        """The same schemes under weights generation `generation`."""
        return attrs.evolve(self, generation=generation)

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


def tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank, as vLLM's TP group says.

    Raises:
        ParallelRankError: vLLM has no TP group in this process, or its
            rank is not below `tp_size` (guessing 0 would make every rank
            read and write rank 0's keys).
    """
    what = "tensor-parallel rank"
    try:
        from vllm.distributed import (  # noqa: PLC0415 - needs a worker
            get_tensor_model_parallel_rank,
        )

        rank = int(get_tensor_model_parallel_rank())
    except Exception as exc:
        reason = f"vLLM answered {type(exc).__name__}: {exc}"
        raise ParallelRankError(what, tp_size, reason) from exc
    if not 0 <= rank < tp_size:
        reason = f"vLLM answered rank {rank}"
        raise ParallelRankError(what, tp_size, reason)
    return rank


def pipeline_size(parallel: Any) -> int:
    """vLLM's pipeline-parallel size, refused unless 1.

    Raises:
        UnsupportedParallelism: ``pipeline_parallel_size`` > 1.
    """
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
    if pp_size != 1:
        reason = (
            "each pipeline stage holds the KV of its own layers, and the "
            "scheduler half sees one stage's layout, so a lookup could not "
            "tell whether every stage's blocks are stored; run with "
            "pipeline_parallel_size=1 (tensor parallelism is supported)"
        )
        setting = "pipeline_parallel_size"
        raise UnsupportedParallelism(setting, pp_size, reason)
    return pp_size
