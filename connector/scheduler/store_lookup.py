"""The admission lookup's store side: how much of each prefix is stored.

`StoreLookup` answers `connector.scheduler.lookup.BatchLookup` over the
store client's ``exists`` (one call per batch of prefixes), with one key
scheme per (KV cache group, TP shard): a block counts only if every shard
of every group holds it, and a hybrid model's hit is the longest prefix
every group can serve (`connector.groups.KVGroups.hit_blocks`).  It runs
on the lookup thread only.  No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from connector.groups import KVGroups
from connector.scheduler.lookup import leading_hits

__all__ = ["KeyMaker", "StoreLookup", "hybrid_hits"]


class KeyMaker(Protocol):
    """Turns block hashes into store keys (one TP shard, one group)."""

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """One key per hash."""


@attrs.frozen
class StoreLookup:
    """Asks the store how many leading blocks every TP shard holds.

    With several KV cache groups (`groups`, one scheme per shard and
    group, group-major), the hit is the longest prefix every group can
    serve (`KVGroups.hit_blocks`).
    """

    client: Any
    schemes: tuple[KeyMaker, ...]
    groups: KVGroups | None = None

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `block_hashes` every shard holds."""
        return self.hit_blocks_many([block_hashes])[0]

    def hit_blocks_many(
        self, prefixes: Sequence[Sequence[bytes]]
    ) -> list[int]:
        """Every prefix's hit, over every shard and group, in one call.

        Without hybrid groups a block shared by several prefixes is asked
        for once.
        """
        if self.groups is not None and self.groups.hybrid:
            hashes = [h for p in prefixes for h in p]
            if not hashes:
                return [0] * len(prefixes)
            keys = [k for s in self.schemes for k in s.keys(hashes)]
            flags = self.client.exists(keys).succeeded
            sizes = [len(p) for p in prefixes]
            return hybrid_hits(flags, sizes, len(self.schemes), self.groups)
        unique = list(dict.fromkeys(h for p in prefixes for h in p))
        if not unique:
            return [0] * len(prefixes)
        keys = [k for s in self.schemes for k in s.keys(unique)]
        codes = self.client.exists(keys).codes
        return leading_hits(prefixes, unique, codes, len(self.schemes))


def hybrid_hits(
    flags: Sequence[bool], sizes: Sequence[int], schemes: int, groups: KVGroups
) -> list[int]:
    """Per prefix, `KVGroups.hit_blocks` over group-major scheme flags."""
    total = sum(sizes)
    per_group = len(groups.groups)
    shards = schemes // per_group
    held = []  # per group: per hash, held by every shard
    for g in range(per_group):
        rows = [
            flags[(g * shards + r) * total : (g * shards + r + 1) * total]
            for r in range(shards)
        ]
        held.append([all(col) for col in zip(*rows, strict=True)])
    hits, start = [], 0
    for size in sizes:
        hits.append(groups.hit_blocks([h[start : start + size] for h in held]))
        start += size
    return hits
