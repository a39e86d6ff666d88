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

A load the forward waits for layer by layer (``Deadline.by_layer``) is
read in spans of layers instead (`layer_spans`): one get session, one
ranged read per span, each span written as it lands and marked on the
deadline (`Deadline.wait_for_layer`), never while the watchdog took it.

Without a deadline a load runs inline on the calling thread (no hop).
Keys the store reads from this process's own segment skip staging
(``Direct.load`` in `connector.worker.transfer`): that get is a memcpy
over when it returns.  No vLLM import.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

from connector.errors import StoreError
from connector.store.faults import RateLimitedWarning

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
    """A load's deadline, its progress, and who reports it: one side.

    The loading thread `claim`s the load before it writes into the KV
    cache (and, at the end, before it reports); the watchdog `expire`s
    it once `at` passed.  Whichever comes first wins; the other backs
    off, so a load reported failed by the watchdog is never written.

    A load read layer by layer (`LoadStaging` with spans) writes each
    span between `begin_write` and `end_write` instead: the watchdog may
    still take it between two spans (never during one, of any writer),
    and a forward waiting for one layer (`wait_for_layer`) goes on once
    that layer `landed`, or once the load `finish`ed.  A layer is landed
    once each of its `writers` wrote it (the head shards a rank reads
    as separate objects, `connector.worker.shards.Sharded`).
    """

    at: float
    #: A forward waits for this load layer by layer (`wait_for_layer`):
    #: a staged load reads it in spans of layers (`LoadStaging`).
    by_layer: bool = attrs.field(default=False, kw_only=True)
    #: Transfers that each write part of every layer (one per head shard
    #: of the load); a layer landed once every one wrote it.
    writers: int = attrs.field(default=1, kw_only=True)
    _lock: threading.Condition = attrs.field(factory=threading.Condition)
    _state: int = _OPEN
    #: Spans being written now (by any writer): the watchdog waits.
    _writing: int = 0
    #: Per layer, the writers that wrote it so far.
    _written: collections.Counter[str] = attrs.field(
        factory=collections.Counter
    )
    #: Layers whose KV this load has written, every block of it.
    landed: set[str] = attrs.field(factory=set)
    _done: bool = False

    @classmethod
    def after(cls, seconds: float, *, by_layer: bool = False) -> Deadline:
        """`seconds` from now."""
        return cls(time.monotonic() + seconds, by_layer=by_layer)

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
        """The watchdog reports this load failed.

        False: claimed, or a span is being written (its loading thread
        reports the load, soon).
        """
        with self._lock:
            if self._state == _CLAIMED or self._writing:
                return False
            self._state = _EXPIRED
            self._lock.notify_all()
            return True

    @property
    def expired(self) -> bool:
        """Whether the watchdog took the load."""
        return self._state == _EXPIRED

    def begin_write(self) -> bool:
        """One span is about to be written (False: expired, write none)."""
        with self._lock:
            if self._state == _EXPIRED:
                return False
            self._writing += 1
            return True

    def end_write(self, layers: Iterable[str]) -> None:
        """The span this writer began last is written: its `layers` too."""
        with self._lock:
            self._writing = max(self._writing - 1, 0)
            for layer in layers:
                self._written[layer] += 1
                if self._written[layer] >= self.writers:
                    self.landed.add(layer)
            self._lock.notify_all()

    def finish(self) -> None:
        """The load ended (in, failed or given up): no layer waits more."""
        with self._lock:
            self._done = True
            self._lock.notify_all()

    def wait_for_layer(self, layer: str, timeout_s: float) -> bool:
        """Whether `layer` landed, or the load ended, within `timeout_s`."""
        with self._lock:
            return self._lock.wait_for(
                lambda: (
                    self._done
                    or layer in self.landed
                    or self._state == _EXPIRED
                ),
                max(timeout_s, 0.0),
            )


@attrs.define(eq=False)
class Call:
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
    call: Call | None = None


class Runners:
    """Daemon threads running `Call`s; a new one when none is idle."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.threads = 0

    def submit(self, call: Call) -> None:
        """Run `call` on an idle runner, or a new one."""
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


JOIN_GRACE_S: Final = 1.0
"""How long past a load's deadline the moves run beside it are waited for
(each is bounded by the deadline; this covers a span's copy begun)."""


def side_by_side(
    runners: Runners,
    moves: Sequence[Callable[[], list[bool]]],
    sizes: Sequence[int],
    *,
    bound: Deadline | None = None,
) -> list[list[bool]]:
    """Run every move at once; per move its flags (`sizes`: how many).

    The first runs on the calling thread, the others on `runners`.
    Every one has ended before this returns (none still moves blocks
    the caller reports on), or with `bound`, passed it by `JOIN_GRACE_S`
    (a move that long late reads all False; a load is bounded by its
    deadline).  Then the first error, if any, is raised.
    """
    calls = [Call(move, _nothing) for move in moves[1:]]
    for call in calls:
        runners.submit(call)
    error: BaseException | None = None
    try:
        got = [moves[0]()]
    except BaseException as exc:  # noqa: BLE001 - raised below
        error, got = exc, [[False] * sizes[0]]
    for call, size in zip(calls, sizes[1:], strict=True):
        if bound is None:
            call.done.wait()
        if not call.settle(
            0.0 if bound is None else bound.left() + JOIN_GRACE_S
        ):
            got.append([False] * size)
            continue
        error = error or call.error
        got.append(call.result or [False] * size)
    if error is not None:
        raise error
    return got


def _nothing() -> None:
    """A move given up ends with nothing to hand back."""


@attrs.frozen
class LayerSpan:
    """Consecutive layers a layer-wise load reads in one ranged read.

    Attributes:
        pieces: Their pieces' indices (`block_pieces` order).
        start: Their first byte in a block's object.
        end: The byte after their last one.
        layers: Their names.
    """

    pieces: range
    start: int
    end: int
    layers: tuple[str, ...]


def layer_spans(
    pieces: Sequence[Piece], offsets: Sequence[int], block_bytes: int
) -> tuple[LayerSpan, ...]:
    """Spans of 1, 1, 2, 4, 8, ... layers, the last one up to the end.

    The first layer arrives after one small read, and each span is
    about as long as every layer before it together: while the forward
    computes those, the next span moves.  A model of L layers takes
    about log2(L) + 1 reads (6 for 32), not L, each costing the store's
    per-call overhead.  Empty (read whole) for fewer than two layers, or
    when a layer's pieces are not consecutive.
    """
    names: list[str] = []
    first: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if names and names[-1] == piece.layer:
            continue
        if piece.layer in first:
            return ()
        first[piece.layer] = i
        names.append(piece.layer)
    n = len(names)
    if n < 2:  # noqa: PLR2004 - one layer: one read
        return ()
    bounds = [0]
    size = 1
    while size < n:
        bounds.append(size)
        size *= 2
    bounds.append(n)
    spans = []
    for a, b in itertools.pairwise(bounds):
        lo = first[names[a]]
        hi = first[names[b]] if b < n else len(pieces)
        end = offsets[hi] if hi < len(pieces) else block_bytes
        spans.append(
            LayerSpan(range(lo, hi), offsets[lo], end, tuple(names[a:b]))
        )
    return tuple(spans)


class _Landed:
    """The spans a runner's get session read so far, for the loader."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._flags: list[list[bool]] = []
        self._closed = False
        #: The loader wants no more spans.
        self.stop = False

    def land(self, index: int, ok: list[bool]) -> bool:
        """On the runner: span `index` read; whether to read on."""
        del index
        with self._cond:
            self._flags.append(ok)
            self._cond.notify_all()
        return not self.stop

    def close(self) -> None:
        """On the runner: the session ended."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, index: int, timeout_s: float) -> list[bool] | None:
        """Span `index`'s per-key success, or None (late, or not read)."""
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._flags) > index or self._closed,
                max(timeout_s, 0.0),
            )
            return self._flags[index] if len(self._flags) > index else None


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
        self._spans = layer_spans(
            self._pieces, self._offsets, self.block_bytes
        )
        self._register = register
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._made = 0
        self._held_late = 0
        self._runners = Runners("kv-lifecycle-get")
        self._typed: dict[int, tuple[torch.Tensor, ...]] = {}
        #: Chunks given up at their deadline (their get still ran).
        self.late = 0
        #: Chunks failed at once: every buffer was held by a late get.
        self.shed = 0
        #: Chunks failed at once: a new buffer could not be made or the
        #: store refused its registration; the next load retries.
        self.refused = 0
        self._warn = RateLimitedWarning(log)
        #: Loads read in spans of layers (`layer_spans`).
        self.spanned = 0
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
        watchdog took, is False and never written.  A load a forward
        waits for layer by layer (``deadline.by_layer``) from a store
        that reads spans (``reads_spans``) is read in spans of layers
        (`layer_spans`), each written as it arrives and marked landed on
        the deadline, when its blocks fit the free buffers.
        """
        if (
            deadline is not None
            and deadline.by_layer
            and self._spans
            and block_ids
            and getattr(store, "reads_spans", False)
        ):
            spanned = self._load_spans(store, keys, list(block_ids), deadline)
            if spanned is not None:
                return spanned
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

    def _load_spans(
        self,
        store: BlockStore,
        keys: Sequence[str],
        block_ids: list[int],
        deadline: Deadline,
    ) -> list[bool] | None:
        """One get session over every block, written span by span.

        None (nothing started) when the blocks need more buffers than
        are free.  Each span is written between ``begin_write`` and
        ``end_write``; a span late by the deadline ends the load (every
        block False: vLLM recomputes the blocks, including the layers
        already written) and the buffers go back when the session ends.
        """
        n = len(block_ids)
        if deadline.left() <= 0:
            return [False] * n
        buffers = self._lend_all(-(-n // self.slots))
        if buffers is None:
            return None
        slots, size = self.slots, self.block_bytes
        ptrs = [
            buffers[i // slots].data_ptr() + (i % slots) * size
            for i in range(n)
        ]
        spans = [(span.start, span.end) for span in self._spans]
        landed = _Landed()
        get_spans = store.get_spans  # type: ignore[attr-defined]

        def read() -> list[bool]:
            try:
                result = get_spans(keys, ptrs, spans, landed.land)
                return list(result.succeeded)
            finally:
                landed.close()

        def give_late() -> None:
            for buffer in buffers:
                self._give(buffer, late=True)

        call = Call(read, give_late)
        self._runners.submit(call)
        self.spanned += 1
        ok = self._write_spans(buffers, block_ids, landed, deadline)
        landed.stop = True
        # Written in full, the session's end has the rest of the deadline;
        # given up, the runner is not waited for.
        late = ok is None
        settled = call.settle(0.0 if late else deadline.left())
        flags = [False] * n if ok is None else ok
        return self._end_spans(
            call, buffers, flags, late=late, settled=settled
        )

    def _end_spans(
        self,
        call: Call,
        buffers: list[torch.Tensor],
        ok: list[bool],
        *,
        late: bool,
        settled: bool,
    ) -> list[bool]:
        """A load read in spans ends: its buffers go back.

        Now, or when its session ends (`settled` False: held late).
        `late`: a span missed the deadline (`ok` is all False).
        """
        if settled:
            for buffer in buffers:
                self._give(buffer)
            if call.error is not None:
                raise call.error
            return ok
        with self._lock:  # the runner gives the buffers back at its end
            self._held_late += len(buffers)
            if late:
                self.late += 1
        if late:
            log.warning(
                "layer-wise load of %d block(s) passed its deadline; "
                "recomputed",
                len(ok),
            )
        return ok  # not late: only the session's end is

    def _lend_all(self, count: int) -> list[torch.Tensor] | None:
        """`count` free buffers, or None (and none taken)."""
        if count > self.max_buffers:
            return None
        buffers: list[torch.Tensor] = []
        while len(buffers) < count:
            buffer = self._borrow()
            if buffer is None:
                for taken in buffers:
                    self._give(taken)
                return None
            buffers.append(buffer)
        return buffers

    def _write_spans(
        self,
        buffers: list[torch.Tensor],
        block_ids: list[int],
        landed: _Landed,
        deadline: Deadline,
    ) -> list[bool] | None:
        """Write each span as it lands (None: one was late or unread)."""
        ok = [True] * len(block_ids)
        slots = self.slots
        for index, span in enumerate(self._spans):
            flags = landed.wait(index, deadline.left())
            if flags is None or deadline.left() <= 0:
                return None  # late: not even a span already read
            ok = [a and b for a, b in zip(ok, flags, strict=True)]
            if not any(ok):
                return ok
            if not deadline.begin_write():
                return [False] * len(ok)
            try:
                for c, buffer in enumerate(buffers):
                    lo = c * slots
                    self._scatter(
                        buffer,
                        block_ids[lo : lo + slots],
                        ok[lo : lo + slots],
                        span.pieces,
                    )
            finally:
                deadline.end_write(span.layers)
        return ok

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

        None when none can be had (see `_borrow`); counted in `shed` when
        every buffer is held by a late get.
        """
        buffer = self._borrow()
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
        call = Call(
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

    def _borrow(self) -> torch.Tensor | None:
        """`_take` for a load: None, not an error, if a new buffer fails.

        A new buffer the store refuses to register (its metadata server
        is down, as while the master restarts) or that cannot be made (a
        dummy client's shared memory used up) is counted in `refused`
        with one rate-limited WARNING; the load fails and vLLM recomputes,
        as for any store fault, and a later load makes a buffer again.
        """
        try:
            return self._take()
        except (StoreError, MemoryError) as error:
            with self._lock:
                self.refused += 1
            self._warn.note(
                "new-buffer",
                1,
                "a new load staging buffer could not be made or registered "
                "(%s); the load is recomputed and a later one tries again",
                error,
            )
            return None

    def _take(self) -> torch.Tensor | None:
        """A free buffer, or a new one registered (None: `max_buffers`).

        Raises:
            StoreError: the store refused the new buffer's registration.
        """
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
        self,
        buffer: torch.Tensor,
        chunk: list[int],
        got: list[bool],
        pieces: range | None = None,
    ) -> None:
        """Copy the staged blocks that arrived into the KV cache; wait.

        With `pieces`, only those pieces (a span of layers) are copied.
        """
        import torch  # noqa: PLC0415 - torch only where blocks move

        slots = [i for i, ok in enumerate(got) if ok]
        if not slots:
            return
        ops = self.ops
        chosen = range(len(self._pieces)) if pieces is None else pieces
        if ops.device.type == "cpu":
            self._scatter_host(buffer, chunk, slots, chosen)
            return
        k = len(slots)
        targets = [chunk[i] for i in slots]
        runs = block_runs(targets)
        lo = self._offsets[chosen[0]]
        hi = self._offsets[chosen[-1]] + self._pieces[chosen[-1]].nbytes
        with ops.side():
            rows = buffer[: len(chunk)]
            if k < len(chunk):
                rows = rows[torch.tensor(slots, dtype=torch.int64)]
            if (lo, hi) != (0, self.block_bytes):
                rows = rows[:, lo:hi]
            packed = rows.to(ops.device, non_blocking=True)
            ids = None
            if len(runs) * RUN_COPY_RATIO > k:  # scattered: one gather
                ids = torch.tensor(
                    targets, dtype=torch.int64, device=ops.device
                )
            for index in chosen:
                piece = self._pieces[index]
                offset = self._offsets[index] - lo
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

    def _scatter_host(
        self,
        buffer: torch.Tensor,
        chunk: list[int],
        slots: list[int],
        chosen: range,
    ) -> None:
        """`_scatter` into a host KV cache: one native call (`copy_runs`).

        Every copy of the chunk is a slice per run of slots and blocks,
        per piece; each buffer's typed views are made once
        (`_typed_slots`).
        """
        typed = self._typed_slots(buffer)
        copy_runs(
            [self._pieces[i].view for i in chosen],
            [typed[i] for i in chosen],
            slot_runs(slots, [chunk[i] for i in slots]),
        )

    def _typed_slots(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`typed_slots` of ``buffer``, cached by its address.

        Buffers live as long as this object.
        """
        key = buffer.data_ptr()
        typed = self._typed.get(key)
        if typed is None:
            typed = typed_slots(buffer, self._pieces, self._offsets)
            self._typed[key] = typed
        return typed


def typed_slots(
    buffer: torch.Tensor, pieces: Sequence[Piece], offsets: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """Each piece's view ``[slots, *block shape]`` of a staging buffer.

    ``buffer`` is ``uint8 [slots, block_bytes]``, each slot one block with
    its pieces at ``offsets``; slicing these views (``__getitem__``) keeps
    the GIL, so a copy over many slices can be one native call.
    """
    return tuple(
        buffer[:, offset : offset + piece.nbytes]
        .view(piece.view.dtype)
        .view(buffer.shape[0], *piece.view.shape[1:])
        for piece, offset in zip(pieces, offsets, strict=True)
    )


def copy_runs(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    runs: Sequence[tuple[int, int, int]],
) -> None:
    """Copy each run ``(s, d, n)`` of rows of every pair, in one call.

    Rows ``srcs[i][s : s + n]`` go into ``dsts[i][d : d + n]``.  One
    ``torch._foreach_copy_`` releases the GIL once; a ``copy_`` per slice
    released it per slice, and an engine's busy thread took it each time
    (3-7 ms per 16 MiB chunk in an engine against about 1 ms alone).
    The slices are ``__getitem__``, which keeps the GIL.
    """
    import torch  # noqa: PLC0415 - torch only where blocks move

    into: list[torch.Tensor] = []
    out_of: list[torch.Tensor] = []
    for dst, src in zip(dsts, srcs, strict=True):
        for s, d, n in runs:
            into.append(dst[d : d + n])
            out_of.append(src[s : s + n])
    torch._foreach_copy_(into, out_of)


def slot_runs(
    slots: Sequence[int], targets: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(first slot, first target, length) of each run where both step by 1."""
    runs: list[tuple[int, int, int]] = []
    for slot, target in zip(slots, targets, strict=True):
        if runs:
            first, start, n = runs[-1]
            if first + n == slot and start + n == target:
                runs[-1] = (first, start, n + 1)
                continue
        runs.append((slot, target, 1))
    return runs


def block_runs(targets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first target, first row, length) of each run of consecutive ids."""
    rows = range(len(targets))
    return [(t, r, n) for r, t, n in slot_runs(rows, targets)]


def _slot_pieces(
    buffer: torch.Tensor, block_bytes: int, count: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(addresses, sizes) of slots 0..count-1, one piece each."""
    base = buffer.data_ptr()
    return (
        [[base + i * block_bytes] for i in range(count)],
        [[block_bytes]] * count,
    )
