"""Admission lookups off the scheduler thread.

vLLM's scheduler thread schedules every request of the engine, so the
connector never asks the store from it.  The scheduler half *starts* a
lookup (`AsyncLookups.start`), answers vLLM ``None`` ("cannot tell yet"),
and at the end of the step hands every lookup started in it to one
background thread as one batch (`dispatch`): one store call for the whole
step.  A burst is sent in chunks of `CHUNK` as each fills, so the store
answers while the step is still being scheduled.  The thread only fills
in `PendingLookup.found` and marks it done;
the scheduler half takes the answer on its own thread in a later call and
turns it into the lifecycle's ``lookup_done`` event.

Bounds: a lookup not done by its deadline is never waited for (the
scheduler half answers 0 and the request computes locally); the thread
skips lookups whose deadline passed before it got to them, so a stalled
master costs one stalled store call, not one per queued lookup.

No vLLM import, no store import: the store is reached through
`BatchLookup`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs

log: Final = logging.getLogger(__name__)
#: Longest the scheduler thread waits for the lookup thread to signal
#: that it took the GIL (`AsyncLookups.handoff`, a burst's chunk).
HANDOFF_S: Final = 0.0001
#: Most lookups in one store call: a burst is asked for in chunks, so the
#: first answers arrive early and the lookup thread holds the GIL for
#: well under a millisecond at a time.
CHUNK: Final = 256
#: A store call of the lookup thread running this long means the master
#: is slow or gone: the scheduler half stops waiting for answers
#: (`AsyncLookups.stalled`) until the call returns.
STALLED_S: Final = 0.05


class BatchLookup(Protocol):
    """Answers, for many prefixes at once, how much of each is stored."""

    def hit_blocks_many(
        self, prefixes: Sequence[Sequence[bytes]]
    ) -> list[int]:
        """Leading stored blocks of each prefix, in one store call."""


class HitLookup(Protocol):
    """Answers how much of a prefix the store holds."""

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `block_hashes` are stored."""


@attrs.frozen
class _OneByOne:
    """A `BatchLookup` over a lookup that only answers one prefix."""

    lookup: HitLookup

    def hit_blocks_many(
        self, prefixes: Sequence[Sequence[bytes]]
    ) -> list[int]:
        return [self.lookup.hit_blocks(p) for p in prefixes]


@attrs.frozen
class _NoLookup:
    """Answers every prefix with a miss (after the half was dropped)."""

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> int:
        del block_hashes
        return 0


NO_LOOKUP: Final = _NoLookup()


def batching(lookup: Any) -> BatchLookup:
    """`lookup` itself if it answers many prefixes at once, else a wrapper."""
    if hasattr(lookup, "hit_blocks_many"):
        return lookup  # type: ignore[no-any-return]
    return _OneByOne(lookup)


@attrs.define(slots=True, eq=False)
class PendingLookup:
    """One lookup as the lookup thread sees it: a message and its answer.

    Where the lookup stands (asked, answered, dropped) is the state of
    its tracker (`connector.scheduler.admission`); this record only
    carries the question and, once `done`, the answer.

    Attributes:
        req_id: The request.
        tracker: The lookup's tracker (None in tests of this module).
        epoch: The tracker's epoch while it waits for this answer: once
            the tracker moved on (superseded, dropped), the answer is
            stale and the thread skips it if it has not asked yet.
        hashes: The block hashes asked about.
        deadline: Clock time past which nobody waits for it.
        batch: `AsyncLookups.batches` when it started (sent at the end
            of that step, as batch number `batch + 1`).
        key: What the answer is about, for the tracker (the scheduler
            half's (request epoch, blocks asked)).
        at: Clock time it started (`deadline` less the timeout).
        found: Leading blocks stored (valid once `done`).
        done: Set by the lookup thread once `found` is final.
        expired: The thread skipped it (deadline passed, never sent).
        taken: The scheduler half took the answer (scheduler thread).
    """

    req_id: str
    tracker: Any
    epoch: int
    hashes: tuple[bytes, ...]
    deadline: float
    batch: int = 0
    key: tuple[int, int] = (-1, -1)
    at: float = 0.0
    found: int = 0
    done: bool = False
    expired: bool = False
    taken: bool = False

    @property
    def stale(self) -> bool:
        """Its tracker moved on: nobody will take the answer."""
        tracker = self.tracker
        return tracker is not None and tracker.epoch != self.epoch

    @property
    def asked(self) -> int:
        """Blocks asked about."""
        return len(self.hashes)


class AsyncLookups:
    """Batches one step's lookups into store calls on a thread.

    One call per `CHUNK` lookups: a step's lookups usually take one; a
    full chunk is sent by `queue` itself.

    Args:
        lookup: Returns the object that answers a batch; called at every
            batch, so the answering object may be swapped (tests do).
        timeout_s: How long a request may be held back for its lookup.
        threaded: Run batches on a daemon thread (the default).  False
            leaves them queued until `run_pending` (deterministic tests).
        clock: Monotonic seconds.
        handoff_s: Longest the scheduler thread waits for the lookup
            thread's signal after sending it work (0: never waits).

    Thread safety: `message`, `queue`, `start`, `dispatch`,
    `take_completed` and `close` are called from the scheduler thread
    only; the lookup thread only writes `found`, `done` and `expired` of
    queued lookups and appends them to the completed queue (a
    `collections.deque`, atomic under the GIL); it reads a lookup's
    tracker epoch only to skip a stale one.
    """

    def __init__(
        self,
        lookup: Callable[[], BatchLookup],
        *,
        timeout_s: float,
        threaded: bool = True,
        clock: Callable[[], float] = time.monotonic,
        handoff_s: float = HANDOFF_S,
        stalled_s: float = STALLED_S,
    ) -> None:
        self._lookup = lookup
        self.handoff_s = handoff_s
        self.stalled_s = stalled_s
        # When the lookup thread's store call in progress began (None:
        # none); written by the lookup thread only.
        self._call_began: float | None = None
        # Set by the lookup thread each time it holds the GIL for a
        # batch: before a store call, and once answers are posted.
        self._signal = threading.Event()
        self.timeout_s = timeout_s
        self.clock = clock
        self._batch: list[PendingLookup] = []
        self._queue: collections.deque[list[PendingLookup] | None] = (
            collections.deque()
        )
        self._completed: collections.deque[PendingLookup] = collections.deque()
        self._wake = threading.Condition(threading.Lock())
        self._idle = threading.Condition(threading.Lock())
        self._running = 0  # batches queued or executing
        self.batches = 0
        self._handoff_batch = -1
        self.store_calls = 0
        self.failures = 0
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._serve, name="kv-lookup", daemon=True
            )
            self._thread.start()

    # -- scheduler thread ---------------------------------------------------

    def message(
        self,
        req_id: str,
        tracker: Any,
        epoch: int,
        hashes: Sequence[bytes],
        key: tuple[int, int] = (-1, -1),
    ) -> PendingLookup:
        """A lookup starting now, not yet queued (see `queue`).

        `epoch` is the epoch `tracker` will have while it waits for this
        answer (see `PendingLookup.stale`).
        """
        now = self.clock()
        return PendingLookup(
            req_id,
            tracker,
            epoch,
            tuple(hashes),
            now + self.timeout_s,
            self.batches,
            key,
            now,
        )

    def start(
        self, req_id: str, tracker: Any, epoch: int, hashes: Sequence[bytes]
    ) -> PendingLookup:
        """`message` and `queue` in one."""
        pending = self.message(req_id, tracker, epoch, hashes)
        self.queue(pending)
        return pending

    def queue(self, pending: PendingLookup) -> None:
        """Queue `pending` into this step's batch (sent by `dispatch`)."""
        batch = self._batch
        batch.append(pending)
        if len(batch) >= CHUNK:
            # A burst: send what fills a store call now, and hand the
            # thread the GIL until it signals it is in the store call,
            # so the store answers while this step is still being
            # scheduled (else the thread waits for the 5 ms switch
            # interval).
            self.dispatch()
            self._yield()

    def dispatch(self) -> int:
        """Hand this step's lookups to the lookup thread; how many."""
        batch = self._batch
        if not batch:
            return 0
        self._batch = []
        self.batches += 1
        with self._idle:
            self._running += 1
        with self._wake:
            self._queue.append(batch)
            self._wake.notify()
        return len(batch)

    def handoff(self, pending: PendingLookup) -> bool:
        """Whether `pending` is done, after letting the lookup thread run.

        The thread needs the GIL to turn the store's answer into
        `found`; a scheduler thread busy in Python hands it over only
        every switch interval (5 ms), often after the next step asked.
        So, for a lookup already sent, hand the GIL over once per batch
        sent (once per step, plus once per chunk a burst sent early):
        wait for the thread's signal that it posted answers, at most
        `handoff_s`.  Never a wait on the store: a call still in flight
        holds no GIL and sends no signal, and the wait ends regardless.
        """
        if pending.done or self._thread is None:
            return pending.done
        if (
            self._handoff_batch == self.batches
            or pending.batch >= self.batches
        ):
            return False  # handed over this step already, or not sent
        self._handoff_batch = self.batches
        self._yield()
        return pending.done

    def wait(self, pending: PendingLookup, timeout_s: float) -> bool:
        """Send `pending` now if queued, and wait for its answer.

        At most `timeout_s` on the calling (scheduler) thread; whether it
        is done.  False at once without a lookup thread.
        """

        def done() -> bool:  # the lookup thread sets it meanwhile
            return pending.done

        if done():
            return True
        if self._thread is None or timeout_s <= 0:
            return False
        if pending.batch >= self.batches:  # still in this step's batch
            self.dispatch()
        end = time.perf_counter() + timeout_s
        signal = self._signal
        while not done():
            left = end - time.perf_counter()
            if left <= 0:
                return False
            signal.clear()  # then check: a signal after this is seen
            if done():
                break
            signal.wait(left)
        return True

    @property
    def stalled(self) -> bool:
        """Whether the lookup thread's store call has run `stalled_s`.

        A master that hangs holds that call for seconds: waiting for
        answers then only spends the scheduler thread's budget.
        """
        began = self._call_began
        return began is not None and time.monotonic() - began >= self.stalled_s

    def _yield(self) -> None:
        """Hand the GIL to the lookup thread until it signals, bounded."""
        if self._thread is None or self.handoff_s <= 0:
            return
        self._signal.clear()
        self._signal.wait(self.handoff_s)

    def take_completed(self) -> list[PendingLookup]:
        """Lookups the thread finished since the last call."""
        done = self._completed
        return [done.popleft() for _ in range(len(done))]

    def run_pending(self) -> int:
        """Run the queued batches on this thread (``threaded=False``)."""
        ran = 0
        while self._queue:
            batch = self._queue.popleft()
            if batch is not None:
                self._execute(batch)
                ran += 1
        return ran

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every dispatched batch ran, at most `timeout_s`.

        For tests and harnesses that want one answer per step; the
        connector itself never waits.
        """
        if self._thread is None:
            self.run_pending()
            return True
        end = time.monotonic() + timeout_s
        with self._idle:
            while self._running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def completed(self) -> int:
        """Lookups finished and not yet taken."""
        return len(self._completed)

    @property
    def queued(self) -> int:
        """Batches dispatched and not finished."""
        return self._running

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the lookup thread (bounded; a stalled call is left)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._wake:
            self._queue.append(None)
            self._wake.notify()
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    # -- lookup thread ------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                # Everything queued at once: after a stalled call, one
                # pass (and one store call) instead of one per step.
                batches = list(self._queue)
                self._queue.clear()
            merged = [p for b in batches if b is not None for p in b]
            self._execute(merged, len(batches))
            if None in batches:
                return

    def _execute(self, batch: list[PendingLookup], batches: int = 1) -> None:
        # Work goes in slices of `CHUNK`: between slices the GIL goes to
        # a scheduler thread that asked for it, instead of after the
        # interpreter's 5 ms switch interval (after a stalled call the
        # merged batch holds every step's lookups: thousands).
        try:
            live = []
            for start in range(0, len(batch), CHUNK):
                if start:
                    time.sleep(0)
                now = self.clock()
                for p in batch[start : start + CHUNK]:
                    if p.stale:  # nobody waits for it any more
                        p.done = True
                    elif p.deadline <= now:
                        p.expired = p.done = True
                        self._completed.append(p)
                    else:
                        live.append(p)
            for start in range(0, len(live), CHUNK):
                time.sleep(0)
                self._ask(live[start : start + CHUNK])
        finally:
            with self._idle:
                self._running -= batches
                self._idle.notify_all()

    def _ask(self, live: list[PendingLookup]) -> None:
        """One store call for `live`; each is done (0 found on error)."""
        self.store_calls += 1
        self._call_began = time.monotonic()
        self._signal.set()  # in the store call: the GIL is free again
        try:
            found = self._lookup().hit_blocks_many([p.hashes for p in live])
        except Exception:
            self.failures += 1
            log.warning("admission lookup failed", exc_info=True)
            found = [0] * len(live)
        finally:
            self._call_began = None
        for p, n in zip(live, found, strict=False):
            p.found = min(max(int(n), 0), p.asked)
            p.done = True
        self._completed.extend(live)
        self._signal.set()


def leading_hits(
    prefixes: Sequence[Sequence[bytes]],
    unique: Sequence[bytes],
    codes: Sequence[int],
    shards: int,
) -> list[int]:
    """Each prefix's leading run of blocks that every shard holds.

    `unique` lists each block hash of `prefixes` once (prefixes share
    blocks: a system prompt, a conversation's earlier turns); `codes`
    holds Mooncake's ``batch_is_exist`` answer (1 = stored) per (shard,
    unique hash), shard by shard.
    """
    n = len(unique)
    stored = {h for h, c in zip(unique, codes[:n], strict=True) if c == 1}
    for s in range(1, shards):
        shard = codes[s * n : (s + 1) * n]
        stored &= {h for h, c in zip(unique, shard, strict=True) if c == 1}
    hits = []
    for prefix in prefixes:
        hit = len(prefix)
        for j, block in enumerate(prefix):
            if block not in stored:
                hit = j
                break
        hits.append(hit)
    return hits
