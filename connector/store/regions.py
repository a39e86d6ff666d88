"""Registered-memory regions of a batch: one or more pieces per key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import (
    TYPE_CHECKING,
    TypeGuard,
)

import attrs

from connector.errors import (
    RegionError,
)

if TYPE_CHECKING:
    from collections.abc import Iterator


Region = tuple[int, int]
"""``(ptr, nbytes)`` of one contiguous piece of registered memory."""


@attrs.define(slots=True)
class Regions:
    """Memory for a batch: one contiguous region or a piece list per key.

    Treat it as immutable. (Not ``frozen``: a frozen init costs about
    0.4 us more, and regions are built on every transfer.)

    Build it with ``contiguous``/``blocks`` (fast path, one region per
    key, ``batch_put_from``/``batch_get_into``) or ``pieces``/``of``
    (adjacent pieces are coalesced; if every key ends up contiguous the
    fast path is used, else the ``*_multi_buffers`` calls).

    Attributes:
        ptrs: per key, the region's address (contiguous layout).
        sizes: per key, the object size in bytes.
        piece_ptrs: per key, the pieces' addresses (``None`` when
            contiguous).
        piece_sizes: per key, the pieces' sizes (``None`` when contiguous).
        nbytes: total bytes of the batch.
    """

    ptrs: list[int]
    sizes: list[int]
    piece_ptrs: list[list[int]] | None = None
    piece_sizes: list[list[int]] | None = None
    nbytes: int = 0

    @property
    def contiguous_layout(self) -> bool:
        """Whether every key is one contiguous region."""
        return self.piece_ptrs is None

    def __len__(self) -> int:
        return len(self.sizes)

    @classmethod
    def contiguous(cls, ptrs: list[int], sizes: list[int]) -> Regions:
        """One ``(ptrs[i], sizes[i])`` region per key (no copying).

        Raises:
            RegionError: lengths differ or a size is not positive.
        """
        if len(ptrs) != len(sizes):
            reason = f"{len(ptrs)} pointers but {len(sizes)} sizes"
            raise RegionError(None, reason)
        nbytes = sum(sizes)
        if sizes and min(sizes) <= 0:
            index = next(i for i, s in enumerate(sizes) if s <= 0)
            raise RegionError(index, f"size {sizes[index]} is not positive")
        return cls(ptrs, sizes, None, None, nbytes)

    @classmethod
    def blocks(
        cls, base_ptr: int, block_bytes: int, block_ids: Sequence[int]
    ) -> Regions:
        """Whole blocks ``block_ids`` of a blocks-first buffer at ``base_ptr``.

        The common KV layout: block ``b`` lives at
        ``base_ptr + b * block_bytes`` and is stored as one object.
        """
        if block_bytes <= 0:
            reason = f"block_bytes {block_bytes} is not positive"
            raise RegionError(None, reason)
        ptrs = [base_ptr + b * block_bytes for b in block_ids]
        return cls(ptrs, [block_bytes] * len(ptrs), None, None,
                   block_bytes * len(ptrs))  # fmt: skip

    @classmethod
    def pieces(
        cls,
        ptr_lists: Sequence[Sequence[int]],
        size_lists: Sequence[Sequence[int]],
    ) -> Regions:
        """Per key, the object is the concatenation of its pieces.

        Adjacent pieces (``ptr + size == next ptr``) are merged; when every
        key collapses to one region the contiguous fast path is used.

        Raises:
            RegionError: lengths differ, a key has no pieces, or a size is
                not positive.
        """
        if len(ptr_lists) != len(size_lists):
            reason = f"{len(ptr_lists)} piece lists but {len(size_lists)}"
            raise RegionError(None, reason + " size lists")
        all_ptrs: list[list[int]] = []
        all_sizes: list[list[int]] = []
        totals: list[int] = []
        single = True
        for index, (ptrs, sizes) in enumerate(
            zip(ptr_lists, size_lists, strict=True)
        ):
            merged_p, merged_s = _coalesce(index, ptrs, sizes)
            single = single and len(merged_p) == 1
            all_ptrs.append(merged_p)
            all_sizes.append(merged_s)
            totals.append(sum(merged_s))
        nbytes = sum(totals)
        if single:
            return cls([p[0] for p in all_ptrs], totals, None, None, nbytes)
        return cls([p[0] for p in all_ptrs], totals, all_ptrs, all_sizes,
                   nbytes)  # fmt: skip

    @classmethod
    def of(cls, regions: Sequence[Region | Sequence[Region]]) -> Regions:
        """From ``(ptr, size)`` or ``[(ptr, size), ...]`` per key.

        Raises:
            RegionError: an entry is neither form.
        """
        if all(_is_region(r) for r in regions):
            return cls.contiguous(
                [r[0] for r in regions],  # type: ignore[misc]
                [r[1] for r in regions],  # type: ignore[misc]
            )
        ptr_lists: list[list[int]] = []
        size_lists: list[list[int]] = []
        for index, region in enumerate(regions):
            if _is_region(region):
                ptr_lists.append([region[0]])
                size_lists.append([region[1]])
            elif all(_is_region(piece) for piece in region):
                ptr_lists.append([piece[0] for piece in region])  # type: ignore[index]
                size_lists.append([piece[1] for piece in region])  # type: ignore[index]
            else:
                reason = "expected (ptr, size) or a list of (ptr, size)"
                raise RegionError(index, reason)
        return cls.pieces(ptr_lists, size_lists)

    def select(self, indices: Sequence[int]) -> Regions:
        """The regions of the keys at ``indices``, in that order."""
        ptrs = [self.ptrs[i] for i in indices]
        sizes = [self.sizes[i] for i in indices]
        if self.piece_ptrs is None or self.piece_sizes is None:
            return Regions(ptrs, sizes, None, None, sum(sizes))
        piece_ptrs = [self.piece_ptrs[i] for i in indices]
        piece_sizes = [self.piece_sizes[i] for i in indices]
        return Regions(ptrs, sizes, piece_ptrs, piece_sizes, sum(sizes))

    def spans(self) -> Iterator[tuple[int, int, int]]:
        """``(key index, ptr, size)`` of every piece."""
        if self.piece_ptrs is None or self.piece_sizes is None:
            for index, (ptr, size) in enumerate(
                zip(self.ptrs, self.sizes, strict=True)
            ):
                yield index, ptr, size
            return
        for index, (ptrs, sizes) in enumerate(
            zip(self.piece_ptrs, self.piece_sizes, strict=True)
        ):
            for ptr, size in zip(ptrs, sizes, strict=True):
                yield index, ptr, size


def _is_region(value: object) -> TypeGuard[Region]:
    return (
        isinstance(value, tuple)
        and len(value) == 2  # noqa: PLR2004
        and isinstance(value[0], int)
        and isinstance(value[1], int)
    )


def _coalesce(
    index: int, ptrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int], list[int]]:
    if len(ptrs) != len(sizes):
        reason = f"{len(ptrs)} piece pointers but {len(sizes)} piece sizes"
        raise RegionError(index, reason)
    if not ptrs:
        raise RegionError(index, "no pieces")
    out_p = [ptrs[0]]
    out_s = [sizes[0]]
    for size in sizes:
        if size <= 0:
            raise RegionError(index, f"piece size {size} is not positive")
    for ptr, size in zip(ptrs[1:], sizes[1:], strict=True):
        if out_p[-1] + out_s[-1] == ptr:
            out_s[-1] += size
        else:
            out_p.append(ptr)
            out_s.append(size)
    return out_p, out_s


RegionsLike = Regions | Sequence[Region | Sequence[Region]]
