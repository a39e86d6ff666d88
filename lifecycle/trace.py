"""Lifecycle traces: a bounded JSONL record of every event, and its replay.

A `TraceWriter` attached to a machine writes one JSON object per line for
every event the machine sees, applied or not::

    {"time": 1764680000.12, "req_id": "r1", "epoch": 0,
     "state": "SAVING", "event": "preempt", "outcome": "PREEMPTED"}

``state`` is the state the event arrived in (null for an id the registry
did not track), ``epoch`` the tracker's epoch after the event (a
preemption starts a new one), ``outcome`` the state the event led to, or
``"illegal"`` / ``"stale"`` (stale lines add ``job_epoch``, the
completion's epoch).
Lines with a ``"meta"`` key mark a session start (``"start"``, with the
traced table's ``table`` name and ``fingerprint``) and how many events a
full trace dropped (``"dropped"``).

`replay` feeds a trace through a fresh, non-strict machine of the same
table, one session at a time, and rebuilds each request's path, its first
illegal ordering, and the machine's transition, illegal and stale counts,
so an incident can be explained without the engine.  A trace recorded with
another table (another fingerprint) is refused (`TableMismatchError`).

The writer never does file I/O on the event path: observers run under the
machine's lock, so they only queue lines; a background thread writes them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any, BinaryIO, Final

import attrs

from lifecycle.errors import LifecycleError
from lifecycle.machine import LifecycleMachine
from lifecycle.registry import Registry
from lifecycle.table import Table, event_name
from lifecycle.tracker import Tracker

log: Final = logging.getLogger("lifecycle.trace")

DEFAULT_MAX_EVENTS: Final = 1_000_000
ILLEGAL: Final = "illegal"
STALE: Final = "stale"
UNKNOWN: Final = "unknown"
"""How an untracked request's state is spelled in counts keys."""

_Q: Final = '"'


AnyMachine = LifecycleMachine[Any, Any, Any]


def _state_name(state: enum.Enum | None) -> str:
    return UNKNOWN if state is None else state.name


def _json_int(value: int | None) -> str:
    return "null" if value is None else str(int(value))


# Replayed illegal orderings are reported, not logged again.
_REPLAY_LOG: Final = logging.getLogger("lifecycle.trace.replay")
_REPLAY_LOG.setLevel(logging.CRITICAL)


class TraceError(LifecycleError):
    """A trace could not be opened or read.

    Attributes:
        path: The trace file.
        reason: What went wrong.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"trace {path}: {reason}")


_HASH_SPACE: Final = 1 << 64


def _digest(req_id: str, key: bytes | None) -> bytes:
    return hashlib.blake2b(
        req_id.encode(), digest_size=8, key=key or b""
    ).digest()


def hash_req_id(req_id: str, key: bytes) -> str:
    """How a `TraceWriter` with ``id_key=key`` writes `req_id`."""
    return "h:" + _digest(req_id, key).hex()


class TableMismatchError(TraceError):
    """A trace was recorded with another table than the one replaying it.

    Attributes:
        expected: The replaying table's fingerprint.
        found: The trace's fingerprint.
    """

    def __init__(self, path: str, expected: str, found: str) -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            path,
            f"recorded with table fingerprint {found}, replaying with "
            f"{expected}: pass the right table (--table MODULE:NAME)",
        )


# -- writing ---------------------------------------------------------------


class TraceWriter:
    """Writes every event of the machines it is attached to, bounded.

    Thread safe.  Lines are batched and appended whole, with one
    ``write`` per batch on an ``O_APPEND`` file, so processes sharing a
    file never split each other's lines; a background thread writes the
    batch every `flush_interval` seconds, or at once when it is full, so a
    crash loses at most that much.  The event path (under the machine's
    lock) only queues lines: it never writes to the file.  The session's
    ``start`` line is written at the first `attach` and names the table.
    After `max_events` event lines it stops writing, logs one warning and
    counts the rest in `dropped`; `close` then appends a
    ``{"meta": "dropped"}`` line.

    Args:
        stream: An open binary stream (the writer closes it).
        max_events: Event lines to write at most (positive).
        flush_interval: Seconds between background flushes.
        clock: Wall-clock time for the ``time`` field.
        name: How the trace is named in log records.
        id_key: If set, request ids are written as ``"h:"`` plus a keyed
            BLAKE2b hash (8 bytes, hex) instead of in clear: a trace can be
            shared without the ids, and whoever holds the key can hash an
            id to find its lines (`hash_req_id`).  Replay works unchanged.
        sample: The fraction of requests traced (0 < sample <= 1).  The
            choice is a deterministic function of the request id (and the
            key), so a sampled request is traced whole and replays alike.

    Raises:
        ValueError: `max_events` or `sample` is out of range.
    """

    BATCH_LINES: Final = 512
    """Pending lines that trigger a write from the event path."""

    def __init__(
        self,
        stream: BinaryIO,
        *,
        max_events: int = DEFAULT_MAX_EVENTS,
        flush_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
        name: str = "<stream>",
        id_key: bytes | None = None,
        sample: float = 1.0,
    ) -> None:
        if type(max_events) is not int or max_events <= 0:
            msg = f"max_events must be a positive int, got {max_events!r}"
            raise ValueError(msg)
        if not 0.0 < sample <= 1.0:
            msg = f"sample must be in (0, 1], got {sample!r}"
            raise ValueError(msg)
        self.id_key = id_key
        self.sample = sample
        self._threshold = int(sample * _HASH_SPACE)
        self.max_events = max_events
        self.name = name
        self.written = 0
        self.dropped = 0
        self._stream: BinaryIO | None = stream
        self._clock = clock
        self._pending: list[str] = []
        self._lock = threading.Lock()  # the counters and the batch
        self._io_lock = threading.Lock()  # batches reach the file in order
        self._machines: list[AnyMachine] = []
        self._table: Table[Any, Any] | None = None
        # One bound method each, so `remove_observer` finds them again.
        self._on_transition = self.transition
        self._on_rejected = self.rejected
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_every,
            args=(flush_interval,),
            name="lifecycle-trace-flush",
            daemon=True,
        )
        self._flusher.start()

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> TraceWriter:
        """Append to the trace file at `path` (created if missing).

        Raises:
            TraceError: the file cannot be opened for writing.
        """
        try:
            stream = Path(path).open("ab", buffering=0)  # noqa: SIM115
        except OSError as exc:
            raise TraceError(str(path), exc.strerror or str(exc)) from exc
        return cls(stream, name=str(path), **kwargs)

    def attach(self, machine: AnyMachine) -> None:
        """Trace every event `machine` applies or refuses from now on.

        Raises:
            ValueError: another machine of a different table is attached.
        """
        table = machine.table
        if self._table is None:
            self._table = table
            self._start(table)
        elif table.fingerprint != self._table.fingerprint:
            msg = (
                f"trace {self.name} records table {self._table.name} "
                f"({self._table.fingerprint}); cannot attach a machine of "
                f"{table.name} ({table.fingerprint})"
            )
            raise ValueError(msg)
        machine.add_observer(self._on_transition)
        machine.add_reject_observer(self._on_rejected)
        self._machines.append(machine)

    def _start(self, table: Table[Any, Any] | None) -> None:
        record: dict[str, object] = {
            "meta": "start",
            "time": self._clock(),
            "pid": os.getpid(),
        }
        if table is not None:
            record |= {"table": table.name, "fingerprint": table.fingerprint}
        self._meta(record)

    def transition(
        self,
        tracker: Tracker[Any],
        source: enum.Enum,
        event: enum.Enum,
        dest: enum.Enum,
    ) -> None:
        """Observer: `event` moved `tracker` from `source` to `dest`."""
        self._event(
            tracker.req_id,
            tracker.epoch,
            source.name,
            event_name(event),
            dest.name,
        )

    def rejected(
        self,
        req_id: str,
        epoch: int | None,
        state: enum.Enum | None,
        event: enum.Enum,
        job_epoch: int | None,
    ) -> None:
        """Reject observer: `event` was illegal, or stale (`job_epoch`)."""
        self._event(
            req_id,
            epoch,
            None if state is None else state.name,
            event_name(event),
            ILLEGAL if job_epoch is None else STALE,
            job_epoch=job_epoch,
        )

    def _event(
        self,
        req_id: str,
        epoch: int | None,
        state: str | None,
        event: str,
        outcome: str,
        *,
        job_epoch: int | None = None,
    ) -> None:
        if self.id_key is not None or self.sample < 1.0:
            digest = _digest(req_id, self.id_key)
            if int.from_bytes(digest) >= self._threshold:
                return  # not sampled
            if self.id_key is not None:
                req_id = "h:" + digest.hex()
        if self.written >= self.max_events:
            self._drop()
            return
        # State names are identifiers: only the id and the event need
        # escaping.  Hand-built: a third of the cost of json.dumps.
        line = (
            f'{{"time":{self._clock()!r},"req_id":{_quote(req_id)},'
            f'"epoch":{_json_int(epoch)},'
            f'"state":{"null" if state is None else f"{_Q}{state}{_Q}"},'
            f'"event":{_quote(event)},"outcome":"{outcome}"'
            + ("}\n" if job_epoch is None else f',"job_epoch":{job_epoch}}}\n')
        )
        with self._lock:
            if self._stream is None:
                return
            if self.written >= self.max_events:
                self._drop_locked()
                return
            self.written += 1
            self._pending.append(line)
            full = len(self._pending) >= self.BATCH_LINES
        if full:
            self._wake.set()  # the flusher writes: no I/O under the lock

    def _drop(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._drop_locked()

    def _drop_locked(self) -> None:
        if not self.dropped:
            log.warning(
                "lifecycle trace %s is full (%d events): dropping the rest",
                self.name,
                self.max_events,
            )
        self.dropped += 1

    def _meta(self, record: dict[str, object]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._stream is not None:
                self._pending.append(line)
        self._wake.set()

    def flush(self) -> None:
        """Append the pending lines to the file, in one write."""
        with self._io_lock:
            with self._lock:
                stream, lines = self._stream, self._pending
                self._pending = []
            if stream is None or not lines:
                return
            try:
                stream.write("".join(lines).encode())
            except OSError as exc:  # a full disk must not stop the engine
                log.warning("lifecycle trace %s: %s", self.name, exc)

    def _flush_every(self, interval: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        """Detach, record the dropped count, flush and close; idempotent."""
        for machine in self._machines:
            machine.remove_observer(self._on_transition)
            machine.remove_observer(self._on_rejected)
        self._machines.clear()
        if self._table is None and not self.closed:
            self._start(None)  # never attached: still one session
        self._stop.set()
        self._wake.set()
        if self._flusher is not threading.current_thread():
            self._flusher.join()
        if self.dropped and not self.closed:
            self._meta({"meta": "dropped", "dropped": self.dropped})
        self.flush()
        with self._io_lock, self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    @property
    def closed(self) -> bool:
        """Whether `close` ran."""
        return self._stream is None


# -- counts ------------------------------------------------------------------


def pair_key(state: enum.Enum | None, event: enum.Enum) -> str:
    """``"STATE/event"``: how (state, event) counts are keyed in reports."""
    return f"{_state_name(state)}/{event_name(event)}"


def summarize(machine: AnyMachine) -> dict[str, dict[str, int]]:
    """A machine's non-zero counts, keyed as `Replay.summary` keys them.

    ``transitions`` by row (``"SAVING --preempt--> PREEMPTED"``),
    ``illegal`` and ``stale`` by `pair_key`.
    """
    illegal, stale = machine.rejected_counts()
    return {
        "transitions": {
            str(row): n for row, n in machine.transition_counts().items() if n
        },
        "illegal": {pair_key(s, e): n for (s, e), n in illegal.items() if n},
        "stale": {pair_key(s, e): n for (s, e), n in stale.items() if n},
    }


# -- replay ------------------------------------------------------------------


@attrs.frozen
class Record:
    """One parsed event line.

    Attributes:
        line: 1-based line number in the trace.
        time: When the event was fired (seconds since the epoch).
        req_id: The request.
        epoch: The tracker's epoch after the event, None for an
            untracked id.
        state: The state the event arrived in, None for an untracked id.
        event: The event.
        outcome: The state it led to, or `ILLEGAL` / `STALE`.
        job_epoch: A stale completion's epoch.
    """

    line: int
    time: float
    req_id: str
    epoch: int | None
    state: Any
    event: Any
    outcome: str
    job_epoch: int | None = None


@attrs.frozen
class Divergence:
    """Where replaying disagrees with what the trace recorded.

    The trace may start mid-request, have dropped events, or come from
    another table.  Replay resynchronises the tracker to the recorded
    state and epoch and goes on.

    Attributes:
        record: The line that disagreed.
        replayed: What the replay had (state or outcome).
    """

    record: Record
    replayed: str


@attrs.define
class RequestReplay:
    """One request's replayed lifecycle (within one session).

    Attributes:
        req_id: The request.
        session: The trace session (1-based) it ran in.
        steps: Its records, in order.
        first_illegal: Its first illegal event, if any.
    """

    req_id: str
    session: int
    steps: list[Record] = attrs.Factory(list)
    first_illegal: Record | None = None

    @property
    def illegal(self) -> int:
        """Illegal events of this request."""
        return sum(r.outcome == ILLEGAL for r in self.steps)

    @property
    def stale(self) -> int:
        """Stale completions of this request."""
        return sum(r.outcome == STALE for r in self.steps)

    def path(self) -> str:
        """``NEW -lookup-> NEW -alloc_local-> SAVING ...``, runs folded."""
        parts: list[str] = []
        start = self.steps[0].state if self.steps else None
        parts.append(_state_name(start))
        previous: tuple[str, str] | None = None
        repeat = 0
        for step in self.steps:
            key = (event_name(step.event), step.outcome)
            if key == previous:
                repeat += 1
                continue
            if repeat:
                parts[-1] += f" (x{repeat + 1})"
            previous, repeat = key, 0
            if step.outcome in {ILLEGAL, STALE}:
                parts.append(f"[{step.outcome} {event_name(step.event)}]")
            else:
                parts.append(f"-{event_name(step.event)}-> {step.outcome}")
        if repeat:
            parts[-1] += f" (x{repeat + 1})"
        return " ".join(parts)

    def as_json(self) -> dict[str, object]:
        """The request's entry in `Replay.summary`."""
        first = self.first_illegal
        return {
            "session": self.session,
            "path": self.path(),
            "events": len(self.steps),
            "illegal": self.illegal,
            "stale": self.stale,
            "first_illegal": None
            if first is None
            else {
                "line": first.line,
                "state": _state_name(first.state),
                "event": event_name(first.event),
                "epoch": first.epoch,
            },
        }


@attrs.define
class Replay:
    """A trace replayed through the table.

    Attributes:
        machine: The fresh machine every event was replayed on; its
            counts are the trace's counts.
        requests: Per request, in order of first appearance (ids that
            recur in later sessions get ``"<session>:<req_id>"``).
        events: Event lines replayed.
        sessions: Session starts seen.
        dropped: Events a full trace did not record.
        divergences: Where the replay had to resynchronise.
        malformed: Line numbers that were not valid trace lines.
    """

    machine: AnyMachine
    requests: dict[str, RequestReplay] = attrs.Factory(dict)
    events: int = 0
    sessions: int = 0
    dropped: int = 0
    divergences: list[Divergence] = attrs.Factory(list)
    malformed: list[int] = attrs.Factory(list)

    def summary(self) -> dict[str, Any]:
        """Everything as JSON-ready data (``python -m lifecycle replay``).

        ``transitions``, ``illegal`` and ``stale`` match `summarize` of
        the machine that wrote the trace.
        """
        return {
            "events": self.events,
            "sessions": self.sessions,
            "dropped": self.dropped,
            "divergences": len(self.divergences),
            "malformed_lines": self.malformed,
            **summarize(self.machine),
            "requests": {k: r.as_json() for k, r in self.requests.items()},
        }

    def render(self, req_id: str | None = None) -> str:
        """The human-readable report; only `req_id` if given."""
        head = (
            f"{self.events} events, {self.sessions} session(s), "
            f"{len(self.requests)} request(s), {self.dropped} dropped, "
            f"{len(self.divergences)} divergence(s)"
        )
        out = [head]
        if self.malformed:
            lines = ", ".join(map(str, self.malformed[:10]))
            out.append(f"malformed lines: {lines}")
        out.append("")
        for key, request in self.requests.items():
            if req_id is not None and request.req_id != req_id:
                continue
            out.append(f"{key}: {request.path()}")
            first = request.first_illegal
            if first is not None:
                out.append(
                    f"    first illegal ordering: line {first.line}: "
                    f"`{event_name(first.event)}` in "
                    f"{_state_name(first.state)} (epoch {first.epoch})"
                )
        for d in self.divergences[:20]:
            r = d.record
            out.append(
                f"divergence at line {r.line} ({r.req_id}): trace says "
                f"{_state_name(r.state)} -{event_name(r.event)}-> "
                f"{r.outcome}, replay had {d.replayed}"
            )
        counts = summarize(self.machine)
        for title in ("transitions", "illegal", "stale"):
            out.append(f"\n{title}:")
            width = max((len(k) for k in counts[title]), default=0)
            rows = sorted(counts[title].items())
            out.extend(f"  {k:<{width}}  {n}" for k, n in rows)
            if not rows:
                out.append("  none")
        return "\n".join(out) + "\n"


def parse(
    text: str, line: int, table: Table[Any, Any]
) -> Record | dict[str, Any]:
    """One trace line of `table`: a `Record`, or the dict of a ``meta`` line.

    Raises:
        ValueError: the line is not a trace line.
        KeyError: it names a state or event `table` does not have.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        msg = "not a JSON object"
        raise ValueError(msg)  # noqa: TRY004 - a format error, not a type
    if "meta" in data:
        return data
    state = data["state"]
    job_epoch = data.get("job_epoch")
    epoch = data["epoch"]
    req_id = data["req_id"]
    outcome = data["outcome"]
    if not isinstance(req_id, str) or not isinstance(outcome, str):
        msg = "req_id and outcome must be strings"
        raise ValueError(msg)  # noqa: TRY004 - a format error, not a type
    return Record(
        line=line,
        time=float(data["time"]),
        req_id=req_id,
        epoch=None if epoch is None else int(epoch),
        state=None if state is None else table.state_named(state),
        event=table.event_named(data["event"]),
        outcome=outcome,
        job_epoch=None if job_epoch is None else int(job_epoch),
    )


class _Replayer:
    """Feeds records through a fresh registry; one session at a time."""

    def __init__(self, table: Table[Any, Any], path: str) -> None:
        # Callbacks and guards stay out: a trace records each event's
        # outcome and epoch, not the tracker data callbacks need.
        machine: AnyMachine = LifecycleMachine(
            table.without_callbacks(), logger=_REPLAY_LOG
        )
        self.table = table
        self.path = path
        self.result = Replay(machine)
        initial = table.initial

        def factory(req_id: str) -> Tracker[Any]:
            return Tracker(req_id, initial)

        self.registry = Registry(self.result.machine, factory)
        self.open: dict[str, RequestReplay] = {}

    def meta(self, data: dict[str, Any]) -> None:
        found = data.get("fingerprint")
        if found is not None and found != self.table.fingerprint:
            raise TableMismatchError(
                self.path, self.table.fingerprint, str(found)
            )
        if data["meta"] == "start":
            self.result.sessions += 1
            for req_id in list(self.open):
                self.registry.discard(req_id)
            self.open.clear()
        elif data["meta"] == "dropped":
            self.result.dropped += int(data.get("dropped", 0))

    def request(self, req_id: str) -> RequestReplay:
        request = self.open.get(req_id)
        if request is None:
            session = max(self.result.sessions, 1)
            key = req_id
            if key in self.result.requests:
                key = f"{session}:{req_id}"
            request = RequestReplay(req_id, session)
            self.result.requests[key] = request
            self.open[req_id] = request
        return request

    def record(self, r: Record) -> None:
        self.result.events += 1
        request = self.request(r.req_id)
        request.steps.append(r)
        if r.outcome == ILLEGAL and request.first_illegal is None:
            request.first_illegal = r
        if r.state is None:
            self._untracked(r)
            return
        tracker = self._tracker(r)
        if r.outcome == STALE:
            stale_epoch = r.job_epoch
            if stale_epoch is None or stale_epoch == tracker.epoch:
                stale_epoch = tracker.epoch - 1
            self.registry.fire_on(tracker, r.event, epoch=stale_epoch)
            return
        applied = self.registry.fire_on(tracker, r.event)
        if applied:
            # The table's callbacks (not replayed) may start a new epoch.
            tracker.epoch = r.epoch or 0
        replayed = tracker.state.name if applied else ILLEGAL
        if replayed != r.outcome:
            self._diverged(r, replayed)
            try:
                tracker.state = self.table.state_named(r.outcome)
            except KeyError:
                return
            if tracker.state in self.table.terminal:
                self.registry.discard(r.req_id)

    def _tracker(self, r: Record) -> Tracker[Any]:
        """The replayed tracker, resynchronised to the recorded state."""
        tracker = self.registry.get_or_create(r.req_id)
        if tracker.state is not r.state and r.state is not None:
            self._diverged(r, tracker.state.name)
            tracker.state = r.state
        epoch = r.epoch or 0
        if r.outcome in {ILLEGAL, STALE} and tracker.epoch != epoch:
            self._diverged(r, f"epoch {tracker.epoch}")
            tracker.epoch = epoch
        return tracker

    def _untracked(self, r: Record) -> None:
        if self.registry.discard(r.req_id) is not None:
            self._diverged(r, "a live tracker")
        self.registry.fire(r.req_id, r.event)
        if r.outcome != ILLEGAL:
            self._diverged(r, ILLEGAL)

    def _diverged(self, r: Record, replayed: str) -> None:
        """Note one divergence per line (the first thing that differed)."""
        seen = self.result.divergences
        if not seen or seen[-1].record is not r:
            seen.append(Divergence(r, replayed))


def replay(
    lines: Iterable[str],
    *,
    table: Table[Any, Any] | None = None,
    path: str = "<lines>",
) -> Replay:
    """Replay trace lines through `table` on a fresh, non-strict machine.

    `table` defaults to the KV lifecycle (`lifecycle.kv.TABLE`).
    Malformed lines (a line cut short by a crash, say, or a state or event
    the table does not have) are listed in `Replay.malformed` and skipped.

    Raises:
        TableMismatchError: the trace names another table's fingerprint.
    """
    if table is None:
        from lifecycle.kv import TABLE  # noqa: PLC0415 - the default only

        table = TABLE
    replayer = _Replayer(table, path)
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            parsed = parse(text, number, table)
        except (ValueError, KeyError, TypeError):
            replayer.result.malformed.append(number)
            continue
        if isinstance(parsed, Record):
            replayer.record(parsed)
        else:
            replayer.meta(parsed)
    return replayer.result


def replay_file(path: str | os.PathLike[str], **kwargs: Any) -> Replay:
    """`replay` the trace file at `path`.

    Raises:
        TraceError: the file cannot be read.
    """
    try:
        with Path(path).open(encoding="utf-8") as stream:
            return replay(stream, path=str(path), **kwargs)
    except OSError as exc:
        raise TraceError(str(path), exc.strerror or str(exc)) from exc
