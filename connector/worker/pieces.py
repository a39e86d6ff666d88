"""What every transfer path shares: a block's pieces, the store, devices.

The bottom of `connector.worker`: the layer-by-layer views of vLLM's KV
tensors (`Piece`, `block_pieces`), a head slice of them (`head_pieces`),
what a transfer needs of a store (`BlockStore`) and of a device
(`DeviceOps`).  The worker's modules import one way (pyproject.toml's
import contracts): ``side`` > ``shards`` > ``lanes`` > ``transfer`` >
``deadline`` > ``pieces``.  No vLLM import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchOutcome",
    "BlockStore",
    "CopyWaits",
    "DeviceOps",
    "HeadSlice",
    "Piece",
    "Register",
    "block_pieces",
    "head_pieces",
    "tensors_of",
]

_KV_HALVES: Final = 2  # K and V, on K/V-first layouts

CopyWaits = tuple[Any, ...]
"""Per KV piece, what its copy must wait for (None: nothing)."""


class BatchOutcome(Protocol):
    """Per-key success of one batch call."""

    @property
    def succeeded(self) -> list[bool]:
        """One flag per key."""


class BlockStore(Protocol):
    """What a transfer needs from a store client."""

    def put(self, keys: Sequence[str], regions: Any) -> BatchOutcome:
        """Save each key's region (existing keys keep their value)."""

    def get(self, keys: Sequence[str], regions: Any) -> BatchOutcome:
        """Load each key into its region."""


Register = Callable[[int, int], bool]
"""Registers ``(ptr, nbytes)`` with the store; False if already covered."""

HostMemory = Callable[[int], "torch.Tensor"]
"""Host memory of ``nbytes`` (flat uint8) the store can move blocks through.

Given when only such memory works (a dummy client's shared memory,
`StoreClient.staging_memory`): every transfer is then staged in it."""


@attrs.frozen
class Piece:
    """One layer's (or K/V half's) part of every block.

    Attributes:
        layer: The layer it belongs to.
        view: Blocks-first view ``[num_blocks, ...]`` of the KV tensor.
        nbytes: Bytes of one block's part.
    """

    layer: str
    view: torch.Tensor
    nbytes: int


def tensors_of(name: str, value: Any) -> list[torch.Tensor]:
    """A layer's KV tensor, or its recurrent state tensors, as a list.

    vLLM hands a recurrent-state layer (Mamba, gated DeltaNet, ...) its
    state as a list of blocks-first tensors (e.g. conv and SSM state),
    each a view over the group's shared block memory.
    """
    if isinstance(value, list | tuple):
        if not value:
            msg = f"layer {name!r} has no KV or state tensor"
            raise ValueError(msg)
        return list(value)
    return [value]


def block_pieces(kv_caches: Mapping[str, Any], num_blocks: int) -> list[Piece]:
    """Blocks-first views of vLLM's KV (and state) tensors, in layer order.

    A layer's value is one tensor (attention) or a list of state tensors
    (a recurrent layer), each ``[num_blocks, ...]``.

    Raises:
        ValueError: naming the layer whose shape is neither
            ``[num_blocks, ...]`` nor ``[2, num_blocks, ...]``, or whose
            blocks are not contiguous.
    """
    pieces: list[Piece] = []
    for name, value in kv_caches.items():
        for tensor in tensors_of(name, value):
            pieces.extend(_layer_pieces(name, tensor, num_blocks))
    devices = {p.view.device for p in pieces}
    if len(devices) > 1:
        msg = f"KV caches span several devices: {sorted(map(str, devices))}"
        raise ValueError(msg)
    return pieces


def _layer_pieces(
    name: str, tensor: torch.Tensor, num_blocks: int
) -> list[Piece]:
    shape = tuple(tensor.shape)
    if shape and shape[0] == num_blocks:
        halves = [tensor]
    elif len(shape) > 1 and shape[0] == _KV_HALVES and shape[1] == num_blocks:
        halves = [tensor[0], tensor[1]]
    else:
        msg = (
            f"KV cache for layer {name!r} has shape {shape}; "
            f"expected [{num_blocks}, ...] or [2, {num_blocks}, ...]"
        )
        raise ValueError(msg)
    pieces = []
    for half in halves:
        block = half[0]
        if not block.is_contiguous():
            msg = f"KV blocks of layer {name!r} are not contiguous"
            raise ValueError(msg)
        pieces.append(Piece(name, half, block.numel() * block.element_size()))
    return pieces


class DeviceOps(Protocol):
    """The device-specific half of staging: buffers, streams, events."""

    device: torch.device

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host ``uint8`` buffer the device copies to and from."""

    def record(self) -> Any:
        """A marker after the work queued so far on the current stream."""

    def side(self) -> contextlib.AbstractContextManager[None]:
        """Where this lane's copies are issued."""

    def wait(self, marker: Any) -> None:
        """Order the lane's later copies after `marker` (inside `side`)."""

    def sync(self) -> None:
        """Block the calling thread until the lane's copies are done."""


@attrs.frozen
class HeadSlice:
    """KV heads ``[first, first + count)`` of a rank's ``local`` heads."""

    first: int
    count: int
    local: int


def head_pieces(pieces: Sequence[Piece], heads: HeadSlice) -> list[Piece]:
    """The pieces' views of a slice of KV heads, in the same order.

    Needs head-major blocks: each piece ``[num_blocks, local heads, ...]``
    (vLLM's CPU and other HND layouts), so a head slice of a block is one
    contiguous range.

    Raises:
        ValueError: naming the layer whose blocks are not head-major.
    """
    out = []
    for piece in pieces:
        shape = tuple(piece.view.shape)
        if len(shape) < 3 or shape[1] != heads.local:  # noqa: PLR2004
            msg = (
                f"KV cache for layer {piece.layer!r} has blocks of shape "
                f"{shape[1:]}; sharing KV by head needs head-major blocks "
                f"[{heads.local} heads, ...]"
            )
            raise ValueError(msg)
        view = piece.view[:, heads.first : heads.first + heads.count]
        nbytes = piece.nbytes // heads.local * heads.count
        out.append(Piece(piece.layer, view, nbytes))
    return out
