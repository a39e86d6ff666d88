"""Lifecycle traces: a bounded JSONL record of every event, and its counts.

A `TraceWriter` attached to one or more machines writes one JSON object
per line for every event they see, applied or not::

    {"time": 1764680000.12, "table": "lifecycle", "req_id": "r1",
     "epoch": 0, "state": "SAVING", "event": "preempt",
     "outcome": "PREEMPTED"}

``table`` names the machine's table (several lifecycles can share one
trace), ``state`` is the state the event arrived in (null for an id the
registry did not track), ``epoch`` the tracker's epoch after the event (a
preemption starts a new one), ``outcome`` the state the event led to, or
``"illegal"`` / ``"stale"`` / ``"refused"`` (every guard said no; stale
lines add ``job_epoch``, the completion's epoch).  A key that is not a
string is written as its ``str``.
Lines with a ``"meta"`` key mark a session start (``"start"``, with the
first traced table's ``table`` name and ``fingerprint``), each further
table attached (``"table"``, with its ``table`` and ``fingerprint``) and
how many events a full trace dropped (``"dropped"``).

`lifecycle.trace.replayer` reads such a trace back (`replay`,
`replay_file`); `summarize` gives a live machine's counts in the same
keys.

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
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path
from typing import Any, BinaryIO, Final

import attrs

from lifecycle.errors import LifecycleError
from lifecycle.machine import LifecycleMachine
from lifecycle.table import Table, event_name
from lifecycle.tracker import Tracker

log: Final = logging.getLogger("lifecycle.trace")

DEFAULT_MAX_EVENTS: Final = 1_000_000
ILLEGAL: Final = "illegal"
STALE: Final = "stale"
REFUSED: Final = "refused"
UNKNOWN: Final = "unknown"
"""How an untracked request's state is spelled in counts keys."""

_Q: Final = '"'


AnyMachine = LifecycleMachine[Any, Any, Any, Any]


def _state_name(state: enum.Enum | None) -> str:
    return UNKNOWN if state is None else state.name


def _json_int(value: int | None) -> str:
    return "null" if value is None else str(int(value))


@attrs.define(auto_exc=True, slots=False)
class TraceError(LifecycleError):
    """A trace could not be opened or read.

    Attributes:
        path: The trace file.
        reason: What went wrong.
    """

    path: str
    reason: str

    def __str__(self) -> str:
        return f"trace {self.path}: {self.reason}"


_HASH_SPACE: Final = 1 << 64


def _digest(req_id: object, key: bytes | None) -> bytes:
    return hashlib.blake2b(
        str(req_id).encode(), digest_size=8, key=key or b""
    ).digest()


def hash_req_id(req_id: object, key: bytes) -> str:
    """How a `TraceWriter` with ``id_key=key`` writes `req_id`."""
    return "h:" + _digest(req_id, key).hex()


@attrs.define(auto_exc=True, slots=False)
class TableMismatchError(TraceError):
    """A trace was recorded with another table than the one replaying it.

    Attributes:
        expected: The replaying table's fingerprint.
        found: The trace's fingerprint.
    """

    expected: str
    found: str
    reason: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.reason = (
            f"recorded with table fingerprint {self.found}, replaying with "
            f"{self.expected}: pass the right table (--table MODULE:NAME)"
        )


# -- writing ---------------------------------------------------------------


class TraceWriter:
    """Writes every event of the machines it is attached to, bounded.

    One writer may trace machines of several tables (a request lifecycle
    and a block lifecycle, say): each line names its table, and
    `lifecycle.trace.replay` replays them together (``tables=``).

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
        # (machine, transition observer, reject observer) per attach.
        self._machines: list[tuple[AnyMachine, Any, Any]] = []
        self._tables: dict[str, Table[Any, Any, Any, Any]] = {}
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

        Machines of several tables may be attached; their lines carry
        their table's name.

        Raises:
            ValueError: a machine of another table with the same name is
                attached (their lines could not be told apart).
        """
        table = machine.table
        known = self._tables.get(table.name)
        if known is None:
            first = not self._tables
            self._tables[table.name] = table
            if first:
                self._start(table)
            else:
                self._meta(
                    {
                        "meta": "table",
                        "table": table.name,
                        "fingerprint": table.fingerprint,
                    }
                )
        elif known.fingerprint != table.fingerprint:
            msg = (
                f"trace {self.name} records a table {table.name} "
                f"({known.fingerprint}); cannot attach a machine of another "
                f"table with that name ({table.fingerprint})"
            )
            raise ValueError(msg)
        on_transition, on_rejected = self._observers_for(table.name)
        machine.add_observer(on_transition)
        machine.add_reject_observer(on_rejected)
        self._machines.append((machine, on_transition, on_rejected))

    def _observers_for(self, table: str) -> tuple[Any, Any]:
        prefix = f'"table":{_quote(table)},'
        event = self._event

        def on_transition(
            tracker: Tracker[Any, Any],
            source: enum.Enum,
            ev: enum.Enum,
            dest: enum.Enum,
        ) -> None:
            event(
                prefix,
                tracker.req_id,
                tracker.epoch,
                source.name,
                event_name(ev),
                dest.name,
            )

        def on_rejected(  # noqa: PLR0917 - the observer protocol
            req_id: object,
            epoch: int | None,
            state: enum.Enum | None,
            ev: enum.Enum,
            job_epoch: int | None,
            outcome: str,
        ) -> None:
            event(
                prefix,
                req_id,
                epoch,
                None if state is None else state.name,
                event_name(ev),
                outcome,
                job_epoch=job_epoch,
            )

        return on_transition, on_rejected

    def _start(self, table: Table[Any, Any, Any, Any] | None) -> None:
        record: dict[str, object] = {
            "meta": "start",
            "time": self._clock(),
            "pid": os.getpid(),
        }
        if table is not None:
            record |= {"table": table.name, "fingerprint": table.fingerprint}
        self._meta(record)

    def _event(  # noqa: PLR0917 - one flat, hot call
        self,
        prefix: str,
        req_id: object,
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
        if req_id.__class__ is not str:
            req_id = str(req_id)
        if self.written >= self.max_events:
            self._drop()
            return
        # State names are identifiers: only the id and the event need
        # escaping.  Hand-built: a third of the cost of json.dumps.
        line = (
            f'{{"time":{self._clock()!r},{prefix}"req_id":{_quote(req_id)},'
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
        for machine, on_transition, on_rejected in self._machines:
            machine.remove_observer(on_transition)
            machine.remove_observer(on_rejected)
        self._machines.clear()
        if not self._tables and not self.closed:
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

    ``transitions`` by row (``"SAVING --preempt--> PREEMPTED"``; guarded
    alternatives with one destination share a key), ``illegal``,
    ``stale`` and ``refused`` by `pair_key`.
    """
    illegal, stale = machine.rejected_counts()
    refused = machine.refused_counts()
    transitions: dict[str, int] = {}
    for row, n in zip(machine.table.rows, machine.row_counts(), strict=True):
        if n:
            transitions[str(row)] = transitions.get(str(row), 0) + n
    return {
        "transitions": transitions,
        "illegal": {pair_key(s, e): n for (s, e), n in illegal.items() if n},
        "stale": {pair_key(s, e): n for (s, e), n in stale.items() if n},
        "refused": {pair_key(s, e): n for (s, e), n in refused.items() if n},
    }
