"""KV cache groups: what a hybrid model's KV looks like to the connector.

vLLM's hybrid KV cache manager (HMA) gives a model one *KV cache group*
per kind of attention (full attention, sliding window, Mamba state ...),
each with its own block table over one shared block pool.  The connector
moves (group, block) pairs: a store key carries its group (``g<group>``,
`connector.store.keys`), and a transfer job lists one group per block.

Supported group kinds (anything else is refused at start-up with
`UnsupportedKVGroups`, naming every group of the model):

* **Full attention** (``FullAttentionSpec``, ``MLAAttentionSpec``): every
  block of a prefix is saved and loaded.
* **Sliding window** (``SlidingWindowSpec``, ``SlidingWindowMLASpec``):
  only the ``window_blocks = ceil((sliding_window - 1) / block_size)``
  blocks that end at a prefix boundary matter for a hit there, exactly
  vLLM 0.33's ``SlidingWindowManager.find_longest_cache_hit``.  A save
  ending at block ``last`` stores the group's blocks in
  ``[last - window_blocks, last)`` (those vLLM still holds; a skipped
  block is the null block and is never read); a load fills the group's
  blocks in ``[hit - window_blocks, hit)``, which is what vLLM allocates
  there (it gives the skipped blocks before the window the null block).

Successive saves of a request end where the previous one started, so
their windows tile: the store holds a window at every boundary a save
ended on (each step's chunk end and the prompt's last full block).

A lookup's hit (`KVGroups.hit_blocks`) is the longest prefix every group
can serve, by vLLM 0.33's ``HybridKVCacheCoordinator`` rule: the full
attention groups' common leading run is the bound (full attention is
downward-closed), then every sliding-window group cuts it to the longest
prefix whose window it holds, repeated until no group cuts it further.

Not supported (refused): Mamba/SSM state groups (vLLM saves their state
only at block-aligned checkpoints of its own choosing; serving any other
position would restore wrong state), chunked-local, cross, sink or
circular-buffer attention, sliding windows with retained extra tokens,
groups that opt out of prefix caching, and groups of different block
sizes or whose block size is not the block-hash size (their block hashes
would not line up).

No vLLM import: specs are recognised by class name.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

import attrs

from connector.errors import UnsupportedKVGroups

__all__ = [
    "NULL_BLOCK",
    "GroupKind",
    "KVGroup",
    "KVGroups",
    "sliding_hit",
]

NULL_BLOCK: Final = 0
"""vLLM's null block id: a skipped (freed) sliding-window position."""


class GroupKind(enum.Enum):
    """What a KV cache group holds."""

    FULL = "full_attention"
    SLIDING = "sliding_window"


_KINDS: Final = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.SLIDING,
    "SlidingWindowMLASpec": GroupKind.SLIDING,
}
_NAMES: Final = {
    "MambaSpec": "mamba",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "CrossAttentionSpec": "cross_attention",
    "EncoderOnlyAttentionSpec": "encoder_only_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "CircularBufferSpec": "circular_buffer",
    "RSWASpec": "rswa",
}
SUPPORTED: Final = "full_attention, sliding_window"
"""The group kinds the connector saves and loads."""


@attrs.frozen
class KVGroup:
    """One KV cache group.

    Attributes:
        index: vLLM's group id (also the key's ``g<group>``).
        kind: Full attention or sliding window.
        block_size: Tokens per block.
        window_blocks: Blocks a sliding-window hit needs at its boundary
            (0 for full attention).
        layers: The group's layer names, in vLLM's order.
    """

    index: int
    kind: GroupKind
    block_size: int
    window_blocks: int = 0
    layers: tuple[str, ...] = ()

    def first_block(self, start: int, end: int) -> int:
        """The first block of ``[start, end)`` this group moves."""
        if self.kind is GroupKind.SLIDING:
            return max(start, end - self.window_blocks)
        return start


def _kind_name(spec: Any) -> str:
    name = type(spec).__name__
    kind = _KINDS.get(name)
    return kind.value if kind else _NAMES.get(name, name)


def sliding_hit(present: Sequence[bool], limit: int, need: int) -> int:
    """Longest hit <= `limit` blocks a sliding-window group can serve.

    vLLM 0.33's ``SlidingWindowManager.find_longest_cache_hit``: scan
    right to left for `need` contiguous stored blocks; without one, the
    stored run from block 0 is the hit.
    """
    run = 0
    for i in range(min(limit, len(present)) - 1, -1, -1):
        if present[i]:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run


@attrs.frozen
class KVGroups:
    """The model's KV cache groups, as the connector moves them.

    Attributes:
        groups: One per vLLM KV cache group, in group-id order.
    """

    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, block_size: int) -> KVGroups:
        """One full-attention group (a model without hybrid KV)."""
        return cls((KVGroup(0, GroupKind.FULL, block_size),))

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> KVGroups:
        """Read vLLM's `KVCacheConfig`; refuse what cannot be served.

        Raises:
            UnsupportedKVGroups: naming every group's kind, when a group
                is of an unsupported kind or block sizes differ.
        """
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        kinds = tuple(f"{i}:{_kind_name(s)}" for i, s in enumerate(specs))
        groups = []
        for i, (group, spec) in enumerate(
            zip(kv_cache_config.kv_cache_groups, specs, strict=True)
        ):
            kind = _KINDS.get(type(spec).__name__)
            why = None
            if kind is None:
                why = f"group {i} is {_kind_name(spec)}"
            elif not getattr(spec, "prefix_cacheable", True):
                why = f"group {i} opts out of prefix caching"
            elif getattr(spec, "extra_retained_tokens", 0):
                why = f"group {i} retains extra tokens below its window"
            if kind is None or why is not None:
                raise UnsupportedKVGroups(kinds, SUPPORTED, why or "")
            window = 0
            if kind is GroupKind.SLIDING:
                window = -(-(spec.sliding_window - 1) // spec.block_size)
            groups.append(
                KVGroup(
                    i,
                    kind,
                    spec.block_size,
                    window,
                    tuple(group.layer_names),
                )
            )
        sizes = {g.block_size for g in groups}
        hashed = getattr(kv_cache_config, "hash_block_size", None)
        if len(sizes) > 1:
            why = f"block sizes differ ({sorted(sizes)})"
            raise UnsupportedKVGroups(kinds, SUPPORTED, why)
        if len(groups) > 1 and hashed and hashed not in sizes:
            why = f"block hashes cover {hashed} tokens, blocks {sizes.pop()}"
            raise UnsupportedKVGroups(kinds, SUPPORTED, why)
        return cls(tuple(groups))

    @property
    def hybrid(self) -> bool:
        """Whether there is more than one group."""
        return len(self.groups) > 1

    @property
    def one_full_group(self) -> bool:
        """Whether the only group is full attention, group 0 (no hybrid)."""
        only = self.groups[0]
        return (
            len(self.groups) == 1
            and only.kind is GroupKind.FULL
            and only.index == 0
        )

    @property
    def kinds(self) -> tuple[str, ...]:
        """``"<index>:<kind>"`` per group."""
        return tuple(f"{g.index}:{g.kind.value}" for g in self.groups)

    def hit_blocks(self, present: Sequence[Sequence[bool]]) -> int:
        """The longest prefix every group can serve, in blocks.

        Args:
            present: Per group, per block of the prefix asked, whether
                the store holds it (on every shard).
        """
        limit = min((len(p) for p in present), default=0)
        for group, flags in zip(self.groups, present, strict=True):
            if group.kind is GroupKind.FULL:
                run = 0
                while run < limit and flags[run]:
                    run += 1
                limit = run
        sliding = [
            (g.window_blocks, p)
            for g, p in zip(self.groups, present, strict=True)
            if g.kind is GroupKind.SLIDING
        ]
        while sliding:
            before = limit
            for need, flags in sliding:
                limit = sliding_hit(flags, limit, need)
            if limit == before:
                break
        return limit

    def pairs(
        self, tables: Sequence[Sequence[int]], start: int, end: int
    ) -> list[tuple[int, int, int]]:
        """(group, block id, block index) moved for blocks ``[start, end)``.

        Full-attention groups move every block; sliding-window groups
        only the window ending at `end`, never the null block (a
        position vLLM skipped).
        """
        out: list[tuple[int, int, int]] = []
        for group, table in zip(self.groups, tables, strict=False):
            sliding = group.kind is GroupKind.SLIDING
            out.extend(
                (group.index, table[i], i)
                for i in range(group.first_block(start, end), end)
                if i < len(table) and not (sliding and table[i] == NULL_BLOCK)
            )
        return out
