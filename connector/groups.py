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

* **Recurrent state** (``MambaSpec`` in ``mamba_cache_mode="align"``:
  Mamba 1/2, gated DeltaNet, linear attention, short convolutions): one
  block per boundary holds the whole state after the prefix that ends
  there, and a hit needs exactly that one block.  vLLM keeps a state only
  at the block-aligned positions it checkpoints and hands the connector
  each one, with its exact block id, in
  ``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``
  (an align-mode state table is not append-only: interior states are
  nulled and freed, so a state is never read positionally).  A save
  stores each state handed off in its range under the key of the prefix
  ending at that boundary (`StateOffer`); a load fills the one block the
  request resumes from, ``hit - 1``, which is where vLLM allocates it.

Successive saves of a request end where the previous one started, so
their windows tile: the store holds a window at every boundary a save
ended on (each step's chunk end and the prompt's last full block).

A lookup's hit (`KVGroups.hit_blocks`) is the longest prefix every group
can serve, by vLLM 0.33's ``HybridKVCacheCoordinator`` rule: the full
attention groups' common leading run is the bound (full attention is
downward-closed), then every sliding-window group cuts it to the longest
prefix whose window it holds and every recurrent group to the last
boundary whose state it holds (``MambaManager.find_longest_cache_hit``),
repeated until no group cuts it further.

Not supported (refused): recurrent state without align mode (vLLM keeps
only the running state, of no position a later request could resume
from), or with speculative state blocks, chunked-local, cross, sink or
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
    "StateOffer",
    "sliding_hit",
    "state_hit",
]

NULL_BLOCK: Final = 0
"""vLLM's null block id: a skipped (freed) sliding-window position."""


class GroupKind(enum.Enum):
    """What a KV cache group holds."""

    FULL = "full_attention"
    SLIDING = "sliding_window"
    STATE = "mamba"
    """Recurrent state (Mamba, gated DeltaNet, ...), in align mode."""


_KINDS: Final = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.SLIDING,
    "SlidingWindowMLASpec": GroupKind.SLIDING,
    "MambaSpec": GroupKind.STATE,
}
_NAMES: Final = {
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "CrossAttentionSpec": "cross_attention",
    "EncoderOnlyAttentionSpec": "encoder_only_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "CircularBufferSpec": "circular_buffer",
    "RSWASpec": "rswa",
}
SUPPORTED: Final = (
    "full_attention, sliding_window, mamba (mamba_cache_mode='align')"
)
"""The group kinds the connector saves and loads."""


@attrs.frozen
class KVGroup:
    """One KV cache group.

    Attributes:
        index: vLLM's group id (also the key's ``g<group>``).
        kind: Full attention, sliding window or recurrent state.
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
        """The first block of ``[start, end)`` this group loads."""
        if self.kind is GroupKind.SLIDING:
            return max(start, end - self.window_blocks)
        if self.kind is GroupKind.STATE:
            return max(start, end - 1)
        return start


def _kind_name(spec: Any) -> str:
    name = type(spec).__name__
    kind = _KINDS.get(name)
    return kind.value if kind else _NAMES.get(name, name)


def _refusal(index: int, kind: GroupKind | None, spec: Any) -> str | None:
    """Why group `index` cannot be served, or None."""
    if kind is None:
        return f"group {index} is {_kind_name(spec)}"
    if not getattr(spec, "prefix_cacheable", True):
        return f"group {index} opts out of prefix caching"
    if getattr(spec, "extra_retained_tokens", 0):
        return f"group {index} retains extra tokens below its window"
    if kind is GroupKind.STATE:
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            return (
                f"group {index} is mamba with mamba_cache_mode={mode!r}, "
                "not 'align' (no state of a reusable position is kept)"
            )
        if getattr(spec, "num_speculative_blocks", 0):
            return (
                f"group {index} is mamba with speculative state blocks "
                "(speculative decoding)"
            )
    return None


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


def state_hit(present: Sequence[bool], limit: int) -> int:
    """Longest hit <= `limit` blocks a recurrent-state group can serve.

    vLLM 0.33's ``MambaManager.find_longest_cache_hit``: the last boundary
    whose state is stored (a state needs no block before it), else 0.
    """
    for i in range(min(limit, len(present)) - 1, -1, -1):
        if present[i]:
            return i + 1
    return 0


@attrs.frozen
class StateOffer:
    """A recurrent state vLLM handed the connector to save.

    Attributes:
        group: The recurrent group.
        block_id: The exact block holding the state (pinned by the save).
        boundary: Prefix tokens the state follows; block-aligned.
    """

    group: int
    block_id: int
    boundary: int


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
            why = _refusal(i, kind, spec)
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
        others = [
            (g, p)
            for g, p in zip(self.groups, present, strict=True)
            if g.kind is not GroupKind.FULL
        ]
        while others:
            before = limit
            for group, flags in others:
                if group.kind is GroupKind.SLIDING:
                    limit = sliding_hit(flags, limit, group.window_blocks)
                else:
                    limit = state_hit(flags, limit)
            if limit == before:
                break
        return limit

    @property
    def has_state(self) -> bool:
        """Whether a group holds recurrent state (saved from offers)."""
        return any(g.kind is GroupKind.STATE for g in self.groups)

    def pairs(
        self,
        tables: Sequence[Sequence[int]],
        start: int,
        end: int,
        states: Sequence[StateOffer] | None = None,
    ) -> list[tuple[int, int, int]]:
        """(group, block id, block index) moved for blocks ``[start, end)``.

        Full-attention groups move every block; sliding-window groups
        only the window ending at `end`, never the null block (a
        position vLLM skipped).  Recurrent groups: a load (`states` None)
        moves the one block the request resumes from, ``end - 1``, even
        the null block (which the worker never fills, so the load fails
        rather than resume without its state); a save moves the `states`
        handed off at boundaries in ``(start, end]``, each under the
        index of the block ending there, never positionally.
        """
        out: list[tuple[int, int, int]] = []
        for group, table in zip(self.groups, tables, strict=False):
            kind = group.kind
            if kind is GroupKind.STATE:
                out.extend(self._state_pairs(group, table, start, end, states))
                continue
            out.extend(
                (group.index, table[i], i)
                for i in range(group.first_block(start, end), end)
                if i < len(table)
                and not (kind is GroupKind.SLIDING and table[i] == NULL_BLOCK)
            )
        return out

    @staticmethod
    def _state_pairs(
        group: KVGroup,
        table: Sequence[int],
        start: int,
        end: int,
        states: Sequence[StateOffer] | None,
    ) -> list[tuple[int, int, int]]:
        if end <= start:
            return []
        if states is None:
            block = table[end - 1] if end - 1 < len(table) else NULL_BLOCK
            return [(group.index, block, end - 1)]
        bs = group.block_size
        return [
            (group.index, s.block_id, s.boundary // bs - 1)
            for s in states
            if s.group == group.index
            and s.block_id != NULL_BLOCK
            and s.boundary % bs == 0
            and start * bs < s.boundary <= end * bs
        ]
