"""How whole KV blocks move between vLLM's KV cache and the store.

Both strategies answer one interface (`Transfer`): per block, did it move.

* `Direct`: the store reads and writes the KV tensors themselves (zero
  copy).  For KV caches in host memory, registered with the store once.
* `Staged`: blocks go through a staging buffer in host memory (pinned on
  CUDA) registered with the store once.  A save gathers its blocks into the
  buffer (device -> host) and puts from it; a load gets into the buffer and
  scatters from it (host -> device).  The gather/scatter code is one piece
  over a `DeviceOps`: `HostOps` for CPU tensors (what CI runs, so CPU tests
  exercise the very copy and ordering code the GPU runs) and `CudaOps`, a
  side stream ordered after the compute stream by CUDA events.

Ordering on CUDA:

* `layer_written(layer)` (from `save_kv_layer`) records an event on the
  current stream after the layer's compute; `fence()` (from
  `wait_for_save`) records one after the whole step and hands each save job
  a `CopyWaits`: per KV piece, its layer's event, or the step's when the layer
  reported nothing this step.  The save's side stream waits on the piece's
  event before copying it, and the host waits for the copies before the
  put reads the staging buffer.
* A load's scatter is waited for on the host before the job completes, so a
  request is reported as received only once its KV is in the device cache:
  every later kernel, on any stream, sees it.

Every store object is the concatenation of a block's pieces in layer order,
so both strategies store the same bytes under the same key.  No vLLM
import.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import attrs

from connector.worker.deadline import (
    RUN_COPY_RATIO,
    Deadline,
    LoadStaging,
    block_runs,
    copy_runs,
    typed_slots,
)
from connector.worker.pieces import (
    BlockStore,
    CopyWaits,
    DeviceOps,
    HeadSlice,
    HostMemory,
    Piece,
    Register,
    block_pieces,
    head_pieces,
    tensors_of,
)

if TYPE_CHECKING:
    import torch

DEFAULT_STAGING_BLOCKS: Final = 32
"""Blocks per staging buffer (one buffer for loads, one for saves)."""

LAYER_WAIT_S: Final = 60.0
"""Longest a layer-wise save waits for one layer's forward (then fails)."""


class LayerWaits:
    """A step's save fence, filled layer by layer as the forward ends each.

    The forward thread reports each layer (`written`, from
    `save_kv_layer`) and closes it with the step's fence (`close`, from
    `wait_for_save`); a save thread reads the per-piece marks in layer
    order (`marks`), each as soon as its layer is written, so it gathers
    layer i while the forward computes layer i+1.  A layer the forward
    did not report gets the step's mark once closed.  Each wait is
    bounded (`timeout_s`): past it `marks` raises `TimeoutError` (the
    save fails; nothing is put).

    Args:
        layers: Per KV piece, its layer's name.
        timeout_s: Longest wait for any one layer.
    """

    def __init__(
        self, layers: Sequence[str], timeout_s: float = LAYER_WAIT_S
    ) -> None:
        self._layers = tuple(layers)
        self._timeout_s = timeout_s
        self._marks: dict[str, Any] = {}
        self._fence: CopyWaits | None = None
        self._dropped = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._layers)

    @property
    def closed(self) -> bool:
        """Whether the step's forward ended (`close` ran)."""
        return self._fence is not None

    def written(self, layer: str, mark: Any) -> None:
        """`layer`'s KV is written (after `mark`, None: already done)."""
        with self._cond:
            self._marks[layer] = mark
            self._cond.notify_all()

    def close(self, fence: CopyWaits) -> None:
        """The forward ended: `fence` (per piece) covers every layer."""
        with self._cond:
            if self._fence is None:
                self._fence = tuple(fence) or (None,) * len(self._layers)
            self._cond.notify_all()

    def drop(self) -> None:
        """Give up (shutdown, sleep): a waiting `marks` raises now."""
        with self._cond:
            self._dropped = True
            self._cond.notify_all()

    def marks(self) -> Iterator[Any]:
        """Per piece in layer order, its mark once its layer is written.

        Raises:
            TimeoutError: a layer not written within `timeout_s`.
            RuntimeError: dropped before its layer was written.
        """
        for i, layer in enumerate(self._layers):
            end = time.monotonic() + self._timeout_s
            with self._cond:
                while layer not in self._marks and self._fence is None:
                    if self._dropped:
                        msg = f"layer {layer!r}: save dropped"
                        raise RuntimeError(msg)
                    left = end - time.monotonic()
                    if left <= 0:
                        msg = f"layer {layer!r} not written in time"
                        raise TimeoutError(msg)
                    self._cond.wait(left)
                if layer in self._marks:
                    mark = self._marks[layer]
                else:
                    assert self._fence is not None
                    mark = self._fence[i]
            yield mark


SaveWaits = CopyWaits | LayerWaits
"""What a save waits for: the step's fence, or one filled layer by layer."""


def filled_by_layer(fence: Any) -> bool:
    """Whether a save's fence is filled layer by layer (`LayerWaits`).

    A head-sharded lane's fence holds one per shard: it is, if any is.
    """
    if isinstance(fence, LayerWaits):
        return True
    return isinstance(fence, tuple) and any(
        isinstance(f, LayerWaits) for f in fence
    )


@attrs.frozen
class Segment:
    """One blocks-first memory range: block `b` at `base + b * stride`."""

    base: int
    stride: int
    nbytes: int


@attrs.frozen
class KVLayout:
    """Where every block's bytes live, across all layers.

    Attributes:
        num_blocks: Blocks per layer.
        segments: Per layer (and per K/V half on K/V-first layouts), the
            range holding that layer's part of every block.
    """

    num_blocks: int
    segments: tuple[Segment, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer: one store object."""
        return sum(s.nbytes for s in self.segments)

    def pieces(
        self, block_ids: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Per block, the (addresses, sizes) of its pieces, in layer order."""
        sizes = [s.nbytes for s in self.segments]
        ptrs = [
            [s.base + b * s.stride for s in self.segments] for b in block_ids
        ]
        return ptrs, [sizes] * len(block_ids)

    @classmethod
    def from_tensors(
        cls, kv_caches: Mapping[str, Any], num_blocks: int
    ) -> KVLayout:
        """Read the layout off vLLM's per-layer KV tensors.

        Accepts blocks-first tensors (``[num_blocks, ...]``, CPU and
        FlashInfer/MLA layouts) and K/V-first ones (``[2, num_blocks,
        ...]``, FlashAttention).

        Raises:
            ValueError: naming the layer whose shape fits neither, or whose
                blocks are not contiguous.
        """
        return cls.of_pieces(block_pieces(kv_caches, num_blocks), num_blocks)

    @classmethod
    def of_pieces(cls, pieces: Sequence[Piece], num_blocks: int) -> KVLayout:
        """The layout of blocks-first piece views."""
        return cls(
            num_blocks,
            tuple(
                Segment(
                    base=p.view.data_ptr(),
                    stride=p.view.stride(0) * p.view.element_size(),
                    nbytes=p.nbytes,
                )
                for p in pieces
            ),
        )


class Transfer(Protocol):
    """Moves whole blocks between the KV cache and the store.

    `save` and `load` return one success flag per block and may run on any
    thread; `layer_written` and `fence` run on the forward's thread.
    """

    @property
    def registered(self) -> tuple[int, ...]:
        """Addresses registered with the store (to unregister)."""

    @property
    def waits_by_layer(self) -> bool:
        """Whether a save can follow the forward layer by layer.

        True: the transfer is a `LayerWise` one, whose `layer_waits`
        fence lets a save queued mid-forward gather each layer as soon as
        it is written.  False: a save reads every layer at once (zero
        copy), so queueing it before the forward ends gains nothing.
        """

    def layer_written(self, layer: str) -> None:
        """The forward wrote `layer`'s KV for this step (`save_kv_layer`)."""

    def fence(self) -> CopyWaits:
        """What this step's saves must wait for; starts the next step."""

    def save(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        fence: CopyWaits,
    ) -> list[bool]:
        """Store each block under its key, after `fence`."""

    def load(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline: Deadline | None = None,
    ) -> list[bool]:
        """Fill each block from its key; done (visible) on return.

        A block that did not arrive by `deadline` reads False, and
        nothing of it is written later.
        """


@runtime_checkable
class LayerWise(Transfer, Protocol):
    """A transfer whose saves can follow the forward layer by layer.

    `layer_waits` and `drop_layer_waits` run on the forward's thread;
    the fence `layer_waits` returns goes to `save` like `fence`'s.
    """

    def layer_waits(self) -> SaveWaits:
        """This step's save fence, filled as `layer_written` reports.

        `fence` closes it (a layer never reported gets the step's mark).
        """

    def drop_layer_waits(self) -> None:
        """Fail a save still waiting on this step's layers."""


class Direct:
    """Zero copy: the store reads and writes the (host) KV tensors.

    The layout holds only addresses: the tensors behind them must outlive
    every registration and transfer over them.  `memory` holds them for
    as long as this transfer lives (`open_transfer` passes the KV views);
    without it the caller keeps them alive.

    Args:
        layout: Where the blocks live (registered with the store).
        regions: Builds a store batch (`connector.store.Regions`).
        registered: Addresses registered for the layout.
        loads: Where loads land first when they have a deadline (a
            transfer given up must not write into the KV cache later);
            None: loads are zero copy too, and unbounded.
        memory: The tensors (or views) the layout points into, held.
    """

    def __init__(
        self,
        layout: KVLayout,
        regions: Any,
        registered: tuple[int, ...] = (),
        *,
        loads: LoadStaging | None = None,
        memory: tuple[Any, ...] = (),
    ) -> None:
        self.layout = layout
        self._regions = regions
        self._registered = registered
        self.loads = loads
        self.memory = memory

    @property
    def registered(self) -> tuple[int, ...]:
        """Addresses registered for the layout and the load staging."""
        staged = self.loads.registered if self.loads is not None else ()
        return self._registered + staged

    @property
    def waits_by_layer(self) -> bool:
        """False: the put reads every layer straight from the KV cache."""
        return False

    def layer_written(self, layer: str) -> None:
        """Nothing: host compute is done when the hook runs."""

    def fence(self) -> CopyWaits:
        """Nothing to wait for."""
        return ()

    def save(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        fence: SaveWaits,
    ) -> list[bool]:
        """Put the blocks straight from the KV tensors."""
        if isinstance(fence, LayerWaits):  # the put reads every layer
            for _ in fence.marks():
                pass
        regions = self._regions.pieces(*self.layout.pieces(block_ids))
        return store.put(keys, regions).succeeded

    def load(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline: Deadline | None = None,
    ) -> list[bool]:
        """Get the blocks into the KV tensors (through `loads` if set).

        With `loads`, the keys a get reads from this process's own
        segment (`local_reads`) are still got straight into the KV
        tensors: such a get is a memcpy done when it returns, and no
        peer's transport can write into the blocks after.  The load is
        claimed first (a load the watchdog took is not written); the
        other keys go through `loads`.
        """
        if self.loads is None:
            return self._get(store, keys, block_ids)
        local = local_reads(store, keys)
        if not any(local):
            return self.loads.load(store, keys, block_ids, deadline)
        if deadline is not None and not deadline.claim():
            return [False] * len(keys)
        if all(local):
            return self._get(store, keys, block_ids)
        flags = [False] * len(keys)
        near = [i for i, ok in enumerate(local) if ok]
        far = [i for i, ok in enumerate(local) if not ok]
        got_near = self._get(store, *_pick(keys, block_ids, near))
        got_far = self.loads.load(
            store, *_pick(keys, block_ids, far), deadline
        )
        for where, got in ((near, got_near), (far, got_far)):
            for i, ok in zip(where, got, strict=True):
                flags[i] = ok
        return flags

    def _get(
        self, store: BlockStore, keys: Sequence[str], block_ids: Sequence[int]
    ) -> list[bool]:
        regions = self._regions.pieces(*self.layout.pieces(block_ids))
        return store.get(keys, regions).succeeded


def local_reads(store: BlockStore, keys: Sequence[str]) -> list[bool]:
    """Per key, whether `store`'s get reads it from its own segment.

    False for every key when the store cannot tell (no ``local_reads``).
    """
    ask = getattr(store, "local_reads", None)
    if ask is None:
        return [False] * len(keys)
    found = ask(keys)
    return list(found) if len(found) == len(keys) else [False] * len(keys)


def _pick(
    keys: Sequence[str], block_ids: Sequence[int], where: list[int]
) -> tuple[list[str], list[int]]:
    return [keys[i] for i in where], [block_ids[i] for i in where]


class HostOps:
    """CPU tensors: copies are synchronous, nothing to order.

    Args:
        device: The KV cache's (host) device.
        memory: Where buffers come from (None: plain host memory).
    """

    def __init__(
        self, device: torch.device, memory: HostMemory | None = None
    ) -> None:
        self.device = device
        self.waits = 0  # markers waited on (the ordering code ran)
        self._memory = memory

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer (from `memory` if given)."""
        import torch

        if self._memory is not None:
            return self._memory(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def record(self) -> Any:
        """No marker: host work is complete when queued."""
        return None

    def side(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread itself."""
        return contextlib.nullcontext()

    def wait(self, marker: Any) -> None:
        """Counts the wait (nothing to wait for on the host)."""
        del marker
        self.waits += 1

    def sync(self) -> None:
        """Nothing: host copies are done on return."""


class CudaOps:
    """A side stream, ordered after the compute stream by CUDA events.

    Args:
        device: The CUDA device of the KV cache.
        memory: Where buffers come from (None: pinned host memory).
    """

    def __init__(
        self, device: torch.device, memory: HostMemory | None = None
    ) -> None:
        import torch

        self.device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._memory = memory

    def buffer(self, nbytes: int) -> torch.Tensor:
        """Pinned host memory, so copies are truly asynchronous.

        From `memory` when given (a dummy client's shared memory): not
        pinned, so its copies synchronise the side stream.
        """
        import torch

        if self._memory is not None:
            return self._memory(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def record(self) -> Any:
        """An event recorded on the caller's current stream.

        None while the stream is being captured into a CUDA graph: an
        event recorded then would not be re-recorded at replay.
        """
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield

    def side(self) -> contextlib.AbstractContextManager[None]:
        """The side stream as the current one, on the KV cache's device."""
        return self._side()

    def wait(self, marker: Any) -> None:
        """The side stream waits for the event (no host wait)."""
        if marker is not None:
            self._stream.wait_event(marker)

    def sync(self) -> None:
        """Wait on the host for everything queued on the side stream."""
        self._stream.synchronize()


@attrs.define(eq=False)
class _Lane:
    """One direction's staging buffer: `slots` whole blocks, contiguous."""

    ops: DeviceOps
    buffer: torch.Tensor  # uint8 [slots, block_bytes]
    layout: KVLayout
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    typed: tuple[torch.Tensor, ...] | None = None
    """`typed_slots` of `buffer`, made at the first host gather."""

    @property
    def slots(self) -> int:
        return self.layout.num_blocks


class Staged:
    """Blocks go through host staging buffers (pinned on CUDA).

    Args:
        pieces: Blocks-first views of the KV cache (`block_pieces`).
        regions: Builds a store batch (`connector.store.Regions`).
        ops: Builds one `DeviceOps` per lane (loads, saves).
        slots: Blocks per staging buffer; longer jobs go in chunks.
        register: Registers each staging buffer with the store, once.
    """

    def __init__(
        self,
        pieces: Sequence[Piece],
        regions: Any,
        ops: Callable[[], DeviceOps],
        *,
        slots: int = DEFAULT_STAGING_BLOCKS,
        register: Register,
    ) -> None:
        if slots <= 0:
            msg = f"staging slots must be positive, got {slots}"
            raise ValueError(msg)
        if not pieces:
            msg = "no KV cache to stage"
            raise ValueError(msg)
        self._pieces = tuple(pieces)
        self._regions = regions
        self.block_bytes = sum(p.nbytes for p in pieces)
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(offsets[-1] + p.nbytes)
        self._offsets = tuple(offsets)
        lane_ops = ops()
        buffer = lane_ops.buffer(slots * self.block_bytes)
        self._registered = (
            (buffer.data_ptr(),)
            if register(buffer.data_ptr(), buffer.numel())
            else ()
        )
        seg = Segment(buffer.data_ptr(), self.block_bytes, self.block_bytes)
        self._saves = _Lane(
            lane_ops,
            buffer.view(slots, self.block_bytes),
            KVLayout(slots, (seg,)),
        )
        self.loads = LoadStaging(
            pieces, regions, ops(), slots=slots, register=register
        )
        self._marks: dict[str, Any] = {}
        self._feed: LayerWaits | None = None

    @property
    def registered(self) -> tuple[int, ...]:
        """Addresses of the save buffer and the load buffers."""
        return self._registered + self.loads.registered

    @property
    def slots(self) -> int:
        """Blocks per staging buffer."""
        return self._saves.slots

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The KV cache's blocks-first piece views, in layer order."""
        return self._pieces

    @property
    def ops(self) -> tuple[DeviceOps, DeviceOps]:
        """The (load, save) lanes' device ops."""
        return self.loads.ops, self._saves.ops

    @property
    def waits_by_layer(self) -> bool:
        """True: a save gathers each layer once `layer_waits` has it."""
        return True

    # -- ordering (forward thread) ------------------------------------------

    def layer_written(self, layer: str) -> None:
        """Mark the end of `layer`'s compute on the current stream.

        No mark (None: host memory, or a CUDA graph being captured, whose
        replay runs no Python) leaves the layer to the step-wide one.
        """
        mark = self._saves.ops.record()
        if mark is not None:
            self._marks[layer] = mark
        if self._feed is not None:
            self._feed.written(layer, mark)

    def fence(self) -> CopyWaits:
        """Per piece, its layer's mark this step, else a step-wide one.

        Closes this step's `layer_waits`, if one was opened.
        """
        marks, self._marks = self._marks, {}
        step = self._saves.ops.record()
        fence = tuple(marks.get(p.layer, step) for p in self._pieces)
        if self._feed is not None:
            self._feed.close(fence)
            self._feed = None
        return fence

    def layer_waits(self) -> LayerWaits:
        """This step's fence, filled as `layer_written` reports layers.

        A save given it gathers each layer into staging as soon as the
        forward wrote it; `fence` closes it.  Layers reported before
        this call are in it already.
        """
        if self._feed is None:
            self._feed = LayerWaits([p.layer for p in self._pieces])
            for layer, mark in self._marks.items():
                self._feed.written(layer, mark)
        return self._feed

    def drop_layer_waits(self) -> None:
        """Fail a save still waiting on this step's layers (`LayerWaits`)."""
        if self._feed is not None:
            self._feed.drop()
            self._feed = None

    # -- transfers (any thread) ---------------------------------------------

    def save(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        fence: SaveWaits,
    ) -> list[bool]:
        """Gather into staging after `fence`, then put from it."""
        lane = self._saves
        flags: list[bool] = []
        for first in range(0, len(block_ids), lane.slots):
            chunk = list(block_ids[first : first + lane.slots])
            with lane.lock:
                self._gather(lane, chunk, fence)
                regions = self._slot_regions(lane, len(chunk))
                chunk_keys = keys[first : first + len(chunk)]
                flags += store.put(chunk_keys, regions).succeeded
        return flags

    def load(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline: Deadline | None = None,
    ) -> list[bool]:
        """Get into staging, then scatter the blocks that arrived in time."""
        return self.loads.load(store, keys, block_ids, deadline)

    def _slot_regions(self, lane: _Lane, count: int) -> Any:
        return self._regions.pieces(*lane.layout.pieces(range(count)))

    def _gather(self, lane: _Lane, chunk: list[int], fence: SaveWaits) -> None:
        """Copy `chunk`'s blocks into staging slots 0..k-1, then wait.

        Layer by layer, each piece after its layer's mark: with
        `LayerWaits`, as soon as the forward wrote that layer.  Runs of
        consecutive block ids (a prefill's) are copied as slices, one copy
        per run and piece; scattered ids, by one indexed gather per piece.
        """
        import torch

        ops, k = lane.ops, len(chunk)
        runs = block_runs(chunk)
        marks: Iterable[Any] = (
            fence.marks()
            if isinstance(fence, LayerWaits)
            else fence or (None,) * len(self._pieces)
        )
        if ops.device.type == "cpu" and not isinstance(fence, LayerWaits):
            for mark in marks:
                ops.wait(mark)  # every mark is in: wait them all, then copy
            self._gather_host(lane, runs)
            return
        rows = lane.buffer[:k]
        with ops.side():
            ids = None
            if len(runs) * RUN_COPY_RATIO > k:  # scattered: one gather
                ids = torch.tensor(chunk, dtype=torch.int64, device=ops.device)
            # Pack on the device (strided copies stay on the device), then
            # one contiguous copy into the pinned rows.
            same = rows.device == ops.device
            packed = (
                rows
                if same
                else torch.empty(
                    (k, self.block_bytes), dtype=torch.uint8, device=ops.device
                )
            )
            for piece, offset, mark in zip(
                self._pieces, self._offsets, marks, strict=True
            ):
                ops.wait(mark)
                columns = packed[:, offset : offset + piece.nbytes]
                if ids is not None:
                    part = piece.view.index_select(0, ids).reshape(k, -1)
                    columns.copy_(part.view(torch.uint8))
                    continue
                for first, row, n in runs:  # consecutive blocks: a slice
                    part = piece.view[first : first + n].reshape(n, -1)
                    columns[row : row + n].copy_(part.view(torch.uint8))
            if not same:
                rows.copy_(packed, non_blocking=True)
            ops.sync()

    def _gather_host(
        self, lane: _Lane, runs: list[tuple[int, int, int]]
    ) -> None:
        """`_gather` from a host KV cache, its marks waited: one call.

        Every slice copy (per run of consecutive ids, per piece) goes in
        one native call (`copy_runs`), as `LoadStaging`'s host scatter.
        """
        if lane.typed is None:
            lane.typed = typed_slots(lane.buffer, self._pieces, self._offsets)
        copy_runs(lane.typed, [p.view for p in self._pieces], runs)


def open_transfer(
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    regions: Any,
    *,
    register: Register,
    staging_blocks: int | None = None,
    deadlines: bool = False,
    heads: HeadSlice | None = None,
    memory: HostMemory | None = None,
) -> Transfer:
    """The transfer for these KV caches, with its memory registered.

    The transfer holds views of the KV tensors (their storage stays
    alive while it lives, even if the caller drops them).

    With `heads`, it moves that slice of every block's KV heads (one
    object of the head-sharded store layout, `head_pieces`).

    CUDA caches are staged through pinned host memory (the non-CUDA
    Mooncake wheel cannot register device memory); host caches are
    registered and moved zero-copy unless `staging_blocks` asks for
    staging (tests use it to run the staging code on CPU).  With
    `deadlines`, host caches keep zero-copy saves but load keys read
    from other segments through staging (`connector.worker.deadline`;
    keys held only in this process's segment stay zero-copy,
    `Direct.load`): a load given up at its deadline never writes into
    the KV cache.

    With `memory` (a dummy client's shared memory: the store can move
    blocks only through it), every cache is staged in buffers from it.

    Raises:
        ValueError: the KV tensors fit no known layout.
    """
    pieces = block_pieces(kv_caches, num_blocks)
    if heads is not None:
        pieces = head_pieces(pieces, heads)
    device = pieces[0].view.device if pieces else None
    if device is not None and device.type == "cuda":
        return Staged(
            pieces,
            regions,
            lambda: CudaOps(device, memory),
            slots=staging_blocks or DEFAULT_STAGING_BLOCKS,
            register=register,
        )
    if (staging_blocks is not None or memory is not None) and (
        device is not None
    ):
        return Staged(
            pieces,
            regions,
            lambda: HostOps(device, memory),
            slots=staging_blocks or DEFAULT_STAGING_BLOCKS,
            register=register,
        )
    registered = []
    for name, value in kv_caches.items():
        for tensor in tensors_of(name, value):
            storage = tensor.untyped_storage()
            if register(storage.data_ptr(), storage.nbytes()):
                registered.append(storage.data_ptr())
    loads = None
    if deadlines and device is not None:
        loads = LoadStaging(
            pieces,
            regions,
            HostOps(device),
            slots=DEFAULT_STAGING_BLOCKS,
            register=register,
        )
    return Direct(
        KVLayout.of_pieces(pieces, num_blocks),
        regions,
        tuple(registered),
        loads=loads,
        memory=tuple(p.view for p in pieces),
    )
