"""Loads with a deadline: the store only ever writes into staging memory.

A load's get runs on a runner thread into a host staging buffer that the
KV cache does not own; the loading thread waits for it until the load's
deadline.

* In time: the blocks that arrived are scattered into the KV cache on the
  loading thread, before the load is reported, and the buffer is reused.
* Late: every block of the chunk reads failed (vLLM recomputes them), and
  the buffer stays with the runner until the get returns, whenever that
  is; then it goes back to the pool, never read.  Mooncake's store waits
  up to 60 s for a transfer and then returns ``TRANSFER_FAIL`` without
  cancelling the transport, so a late transfer may still write after it
  was given up: only memory the KV cache does not own may receive it.

At most `max_buffers` buffers exist (one at first, more made and
registered while late gets hold the others); with every one held by a
late get, a load fails at once (`shed`) rather than wait behind them.
Runner threads are daemons, one per get in flight: a get that never
returns costs one parked thread and one buffer, never the loading thread.

A load of several chunks hands the next chunk's get to a runner before
it scatters the one that arrived (two buffers in use), so the copy into
the KV cache overlaps the store's next transfer.  A chunk that got no
buffer, or whose get passed the deadline, reads failed on its own.

Without a deadline a load runs inline on the calling thread (no hop).
Keys the store reads from this process's own segment skip staging
(``Direct.load`` in `connector.worker.transfer`): that get is a memcpy
over when it returns.  No vLLM import.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:
    import torch

    from connector.worker.pieces import BlockStore, DeviceOps, Piece

log: Final = logging.getLogger(__name__)

RUN_COPY_RATIO: Final = 4
"""Blocks are copied in by runs of consecutive ids (a slice copy each,
2-3x faster than an indexed copy on CPU) unless the runs are shorter than
this on average; then one indexed copy per piece."""
MAX_BUFFERS: Final = 4
"""Most staging buffers of one load path (late gets each hold one)."""

_OPEN, _CLAIMED, _EXPIRED = range(3)


@attrs.define(eq=False)
class Deadline:
    """A load's deadline, and who reports the load: exactly one side.

    The loading thread `claim`s the load before it writes into the KV
    cache (and, at the end, before it reports); the watchdog `expire`s
    it once `at` passed.  Whichever comes first wins; the other backs
    off, so a load reported failed by the watchdog is never written.
    """

    at: float
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _state: int = _OPEN

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """`seconds` from now."""
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        """Seconds until `at` (negative once passed)."""
        return self.at - time.monotonic()

    def claim(self) -> bool:
        """The loading thread will report this load (False: expired)."""
        with self._lock:
            if self._state == _EXPIRED:
                return False
            self._state = _CLAIMED
            return True

    def expire(self) -> bool:
        """The watchdog reports this load failed (False: claimed)."""
        with self._lock:
            if self._state == _CLAIMED:
                return False
            self._state = _EXPIRED
            return True

    @property
    def expired(self) -> bool:
        """Whether the watchdog took the load."""
        return self._state == _EXPIRED


@attrs.define(eq=False)
class _Call:
    """One get handed to a runner; settled by exactly one side."""

    fn: Callable[[], list[bool]]
    on_late_end: Callable[[], None]
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    done: threading.Event = attrs.field(factory=threading.Event)
    result: list[bool] | None = None
    error: BaseException | None = None
    finished: bool = False
    abandoned: bool = False

    def run(self) -> None:
        """On the runner: the get, then hand-back if it was given up."""
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported by `settle`
            self.error = exc
        with self.lock:
            self.finished = True
            late = self.abandoned
        self.done.set()
        if late:
            self.on_late_end()

    def settle(self, timeout_s: float) -> bool:
        """On the caller: whether the get ended in time (result readable).

        False gives it up: the runner calls `on_late_end` when it ends.
        """
        self.done.wait(max(timeout_s, 0.0))
        with self.lock:
            if self.finished:
                return True
            self.abandoned = True
            return False


@attrs.define(eq=False)
class _Ahead:
    """A chunk whose get was handed to a runner (or could not be)."""

    chunk: list[int]
    buffer: torch.Tensor | None = None
    call: _Call | None = None


class _Runners:
    """Daemon threads running `_Call`s; a new one when none is idle."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.threads = 0

    def submit(self, call: _Call) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self.threads += 1
            else:
                self._idle -= 1
        if spawn:
            threading.Thread(
                target=self._serve,
                name=f"{self._name}-{self.threads}",
                daemon=True,
            ).start()
        self._queue.put(call)

    def _serve(self) -> None:
        while (call := self._queue.get()) is not None:
            call.run()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Stop the idle runners (busy ones stop after their call)."""
        with self._lock:
            idle = self._idle
        for _ in range(idle):
            self._queue.put(None)


class LoadStaging:
    """The load path through host staging buffers, with deadlines.

    Args:
        pieces: Blocks-first views of the KV cache, in layer order.
        regions: Builds a store batch (`connector.store.Regions`).
        ops: The device half (copies, pinned buffers).
        slots: Blocks per buffer; longer loads go in chunks.
        register: Registers each buffer with the store, once.
        max_buffers: Most buffers made (see the module docstring).
    """

    def __init__(
        self,
        pieces: Sequence[Piece],
        regions: Any,
        ops: DeviceOps,
        *,
        slots: int,
        register: Callable[[int, int], bool],
        max_buffers: int = MAX_BUFFERS,
    ) -> None:
        if slots <= 0 or max_buffers <= 0:
            msg = f"slots and max_buffers must be positive: {slots}, {max_buffers}"  # noqa: E501
            raise ValueError(msg)
        self._pieces = tuple(pieces)
        self._regions = regions
        self.ops = ops
        self.slots = slots
        self.block_bytes = sum(p.nbytes for p in pieces)
        offsets = [0]
        for p in pieces[:-1]:
            offsets.append(offsets[-1] + p.nbytes)
        self._offsets = tuple(offsets)
        self._register = register
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._made = 0
        self._held_late = 0
        self._runners = _Runners("kv-lifecycle-get")
        #: Chunks given up at their deadline (their get still ran).
        self.late = 0
        #: Chunks failed at once: every buffer was held by a late get.
        self.shed = 0
        first = self._take()
        if first is not None:
            self._give(first)

    @property
    def registered(self) -> tuple[int, ...]:
        """Addresses of the buffers registered so far."""
        with self._lock:
            return tuple(self._registered)

    @property
    def held_late(self) -> int:
        """Buffers held by gets given up and not yet returned."""
        with self._lock:
            return self._held_late

    def load(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: Sequence[int],
        deadline: Deadline | None = None,
    ) -> list[bool]:
        """Fill each block from its key (False: not filled).

        A block not in by `deadline` (None: no bound), or of a load the
        watchdog took, is False and never written.
        """
        chunks: list[tuple[list[int], Sequence[str]]] = []
        for first in range(0, len(block_ids), self.slots):
            chunk = list(block_ids[first : first + self.slots])
            chunks.append((chunk, keys[first : first + len(chunk)]))
        flags: list[bool] = []
        if deadline is None:
            for chunk, chunk_keys in chunks:
                flags += self._chunk(store, chunk_keys, chunk)
            return flags
        ahead: _Ahead | None = None
        for chunk, chunk_keys in chunks:
            # The next chunk's get runs while this one is scattered.
            started = self._start(store, chunk_keys, chunk, deadline)
            if ahead is not None:
                flags += self._finish(ahead, deadline)
            ahead = started
        if ahead is not None:
            flags += self._finish(ahead, deadline)
        return flags

    def close(self) -> None:
        """Stop idle runner threads."""
        self._runners.close()

    # -- internals ----------------------------------------------------------

    def _chunk(
        self,
        store: BlockStore,
        keys: Sequence[str],
        chunk: list[int],
    ) -> list[bool]:
        """One chunk without a deadline: get inline, then scatter."""
        lent = self._lend(len(chunk))
        if lent is None:
            return [False] * len(chunk)
        buffer, regions = lent
        try:
            got = store.get(keys, regions).succeeded
            self._scatter(buffer, chunk, got)
        finally:
            self._give(buffer)
        return got

    def _lend(self, blocks: int) -> tuple[torch.Tensor, Any] | None:
        """A free buffer and the regions of its first `blocks` slots.

        None (counted in `shed`) when every buffer is held by a late get.
        """
        buffer = self._take()
        if buffer is None:
            self.shed += 1
            return None
        return buffer, self._regions.pieces(
            *_slot_pieces(buffer, self.block_bytes, blocks)
        )

    def _start(
        self,
        store: BlockStore,
        keys: Sequence[str],
        chunk: list[int],
        deadline: Deadline,
    ) -> _Ahead:
        """Hand one chunk's get to a runner (nothing if none can run)."""
        if deadline.left() <= 0:
            return _Ahead(chunk)
        lent = self._lend(len(chunk))
        if lent is None:
            return _Ahead(chunk)
        buffer, regions = lent
        call = _Call(
            lambda: store.get(keys, regions).succeeded,
            lambda: self._give(buffer, late=True),
        )
        self._runners.submit(call)
        return _Ahead(chunk, buffer, call)

    def _finish(self, ahead: _Ahead, deadline: Deadline) -> list[bool]:
        """Wait for a started chunk until the deadline; scatter it."""
        chunk, buffer, call = ahead.chunk, ahead.buffer, ahead.call
        failed = [False] * len(chunk)
        if buffer is None or call is None:
            return failed
        if not call.settle(deadline.left()):
            with self._lock:
                self.late += 1
                self._held_late += 1
            log.warning(
                "load of %d block(s) passed its deadline; recomputed",
                len(chunk),
            )
            return failed
        try:
            if call.error is not None:
                raise call.error
            got = call.result or failed
            if any(got) and not deadline.claim():
                return failed  # the watchdog reported it: write nothing
            self._scatter(buffer, chunk, got)
        finally:
            self._give(buffer)
        return got

    def _take(self) -> torch.Tensor | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made >= self.max_buffers:
                return None
            self._made += 1
        try:
            buffer = self.ops.buffer(self.slots * self.block_bytes)
            if self._register(buffer.data_ptr(), buffer.numel()):
                with self._lock:
                    self._registered.append(buffer.data_ptr())
        except BaseException:
            with self._lock:
                self._made -= 1
            raise
        return buffer.view(self.slots, self.block_bytes)

    def _give(self, buffer: torch.Tensor, *, late: bool = False) -> None:
        with self._lock:
            self._free.append(buffer)
            if late:
                self._held_late -= 1

    def _scatter(
        self, buffer: torch.Tensor, chunk: list[int], got: list[bool]
    ) -> None:
        """Copy the staged blocks that arrived into the KV cache; wait."""
        import torch  # noqa: PLC0415 - torch only where blocks move

        slots = [i for i, ok in enumerate(got) if ok]
        if not slots:
            return
        ops = self.ops
        k = len(slots)
        targets = [chunk[i] for i in slots]
        runs = block_runs(targets)
        with ops.side():
            rows = buffer[: len(chunk)]
            if k < len(chunk):
                rows = rows[torch.tensor(slots, dtype=torch.int64)]
            packed = rows.to(ops.device, non_blocking=True)
            ids = None
            if len(runs) * RUN_COPY_RATIO > k:  # scattered: one gather
                ids = torch.tensor(
                    targets, dtype=torch.int64, device=ops.device
                )
            for piece, offset in zip(self._pieces, self._offsets, strict=True):
                view = piece.view
                # A strided view of each row's bytes of this piece (each
                # row's part is contiguous): one copy, no intermediate.
                part = (
                    packed[:, offset : offset + piece.nbytes]
                    .view(view.dtype)
                    .reshape(k, *view.shape[1:])
                )
                if ids is not None:
                    view.index_copy_(0, ids, part)
                    continue
                for target, row, n in runs:  # consecutive blocks: a slice
                    view[target : target + n].copy_(part[row : row + n])
            ops.sync()


def block_runs(targets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first target, first row, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for row, target in enumerate(targets):
        if runs and runs[-1][0] + runs[-1][2] == target:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((target, row, 1))
    return runs


def _slot_pieces(
    buffer: torch.Tensor, block_bytes: int, count: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(addresses, sizes) of slots 0..count-1, one piece each."""
    base = buffer.data_ptr()
    return (
        [[base + i * block_bytes] for i in range(count)],
        [[block_bytes]] * count,
    )
