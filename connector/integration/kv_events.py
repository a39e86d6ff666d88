"""The store's records as vLLM KV-cache events, and the hits' cache tier.

With ``--kv-events-config`` (vLLM's `KVEventsConfig`,
``enable_kv_cache_events``), vLLM's scheduler takes the connector's events
every step (`take_events`) and publishes them with its own GPU block
events, in one `KVEventBatch`, to its publisher (ZMQ on a chosen
endpoint).  The store's events are:

- `BlockStored` when a save settled ok on every rank: the run's block
  hashes, its parent hash, its token ids, the block size, the KV cache
  group and ``medium`` = the configured store medium (``kv_events_medium``,
  default ``"MOONCAKE"``), so a router tells the shared store from the
  instance's own GPU blocks (``medium="GPU"``);
- `BlockRemoved` (same medium and group) when a load of those blocks
  failed: the store no longer serves them;
- `AllBlocksCleared` when the store was wiped.

Hashes go through vLLM's `maybe_convert_block_hash`, so they match the
GPU events byte for byte (or as 64-bit ints under
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

Hits: every external token comes from the Mooncake pool, which is host
DRAM (`CacheHitSource.HOST`): vLLM counts them under
``vllm:prompt_tokens_cached_by_source{source="host"}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    ExternalBlockHash,
    maybe_convert_block_hash,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.scheduler.events import Cleared, Removed, Stored

if TYPE_CHECKING:
    from collections.abc import Iterable

    from connector.scheduler.events import Record

#: Where the connector's external hits come from: the store's DRAM pool.
HIT_SOURCE: Final = CacheHitSource.HOST


def hit_sources(num_external_tokens: int) -> dict[CacheHitSource, int]:
    """vLLM's per-tier split of a request's external hit (only non-zero)."""
    if num_external_tokens <= 0:
        return {}
    return {HIT_SOURCE: num_external_tokens}


def _external(block_hash: bytes) -> ExternalBlockHash:
    """The hash as vLLM publishes its own (bytes, or an int if asked)."""
    return maybe_convert_block_hash(BlockHash(block_hash))


def vllm_events(records: Iterable[Record], medium: str) -> list[KVCacheEvent]:
    """The records as vLLM's KV-cache events, in order."""
    out: list[KVCacheEvent] = []
    for record in records:
        if isinstance(record, Stored):
            parent = record.parent
            out.append(
                BlockStored(
                    block_hashes=[_external(h) for h in record.hashes],
                    parent_block_hash=None
                    if parent is None
                    else _external(parent),
                    token_ids=list(record.token_ids),
                    block_size=record.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=record.group,
                )
            )
        elif isinstance(record, Removed):
            out.append(
                BlockRemoved(
                    block_hashes=[_external(h) for h in record.hashes],
                    medium=medium,
                    group_idx=record.group,
                )
            )
        elif isinstance(record, Cleared):
            out.append(AllBlocksCleared())
    return out
