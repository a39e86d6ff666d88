"""Replay of a lifecycle trace: paths, first illegal ordering, counts.

`replay` feeds a trace written by `TraceWriter` through a fresh,
non-strict machine of each traced table, one session at a time, and
rebuilds each request's path, its first illegal ordering, and the
machines' transition, illegal, stale and refused counts, so an incident
can be explained without the engine.  A trace of several tables (a request
and a block lifecycle) replays across them (``tables=``).  A trace
recorded with another table of the same name (another fingerprint) is
refused (`TableMismatchError`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import attrs

from lifecycle.machine import LifecycleMachine
from lifecycle.registry import Registry
from lifecycle.table import Table, event_name
from lifecycle.trace.writer import (
    ILLEGAL,
    REFUSED,
    STALE,
    AnyMachine,
    TableMismatchError,
    TraceError,
    _state_name,
    summarize,
)
from lifecycle.tracker import Tracker

# Replayed illegal orderings are reported, not logged again.
_REPLAY_LOG: Final = logging.getLogger("lifecycle.trace.replay")
_REPLAY_LOG.setLevel(logging.CRITICAL)


@attrs.frozen
class Record:
    """One parsed event line.

    Attributes:
        line: 1-based line number in the trace.
        time: When the event was fired (seconds since the epoch).
        table: The name of the table the event belongs to.
        req_id: The request.
        epoch: The tracker's epoch after the event, None for an
            untracked id.
        state: The state the event arrived in, None for an untracked id.
        event: The event.
        outcome: The state it led to, or `ILLEGAL` / `STALE` / `REFUSED`.
        job_epoch: A stale completion's epoch.
    """

    line: int
    time: float
    table: str
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
        declined: The table's expected refusals, (state, event) pairs:
            drawn ``[declined <event>]``, other refusals
            ``[refused <event>]`` (an outcome, never a state).
    """

    req_id: str
    session: int
    steps: list[Record] = attrs.Factory(list)
    first_illegal: Record | None = None
    declined: frozenset[tuple[Any, Any]] = frozenset()

    @property
    def illegal(self) -> int:
        """Illegal events of this request."""
        return sum(r.outcome == ILLEGAL for r in self.steps)

    @property
    def stale(self) -> int:
        """Stale completions of this request."""
        return sum(r.outcome == STALE for r in self.steps)

    def path(self) -> str:
        """``NEW -lookup-> NEW -alloc_local-> SAVING ...``, runs folded.

        Events not applied are bracketed where they happened:
        ``[illegal e]``, ``[stale e]``, ``[refused e]``, ``[declined e]``.
        """
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
            if step.outcome in {ILLEGAL, STALE, REFUSED}:
                kind = (
                    "declined"
                    if (step.state, step.event) in self.declined
                    else step.outcome
                )
                parts.append(f"[{kind} {event_name(step.event)}]")
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
    """A trace replayed through its tables.

    Attributes:
        machine: The fresh machine of the first table every event of
            that table was replayed on; its counts are the trace's counts.
        machines: One such machine per table, by table name (``machine``
            among them).
        requests: Per request, in order of first appearance (ids that
            recur in later sessions get ``"<session>:<req_id>"``; an id
            reused in one session after its tracker ended gets
            ``"<req_id>#<n>"`` for its n-th lifecycle; ids of any table
            but the first are prefixed ``"<table>:"``).
        events: Event lines replayed.
        sessions: Session starts seen.
        dropped: Events a full trace did not record.
        divergences: Where the replay had to resynchronise.
        malformed: Line numbers that were not valid trace lines (a table
            replay was not given is one).
    """

    machine: AnyMachine
    machines: dict[str, AnyMachine] = attrs.Factory(dict)
    requests: dict[str, RequestReplay] = attrs.Factory(dict)
    events: int = 0
    sessions: int = 0
    dropped: int = 0
    divergences: list[Divergence] = attrs.Factory(list)
    malformed: list[int] = attrs.Factory(list)

    def summary(self) -> dict[str, Any]:
        """Everything as JSON-ready data (``python -m lifecycle replay``).

        ``transitions``, ``illegal``, ``stale`` and ``refused`` are the
        first table's and match `summarize` of the machine that wrote the
        trace; ``tables`` holds the same four for every table by name.
        The layout is documented in the API reference.
        """
        return {
            "events": self.events,
            "sessions": self.sessions,
            "dropped": self.dropped,
            "divergences": len(self.divergences),
            "malformed_lines": self.malformed,
            **summarize(self.machine),
            "tables": {n: summarize(m) for n, m in self.machines.items()},
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
        several = len(self.machines) > 1
        for name, machine in self.machines.items():
            counts = summarize(machine)
            for title in ("transitions", "illegal", "stale", "refused"):
                if title == "refused" and not counts[title]:
                    continue
                label = f"{name} {title}" if several else title
                out.append(f"\n{label}:")
                width = max((len(k) for k in counts[title]), default=0)
                rows = sorted(counts[title].items())
                out.extend(f"  {k:<{width}}  {n}" for k, n in rows)
                if not rows:
                    out.append("  none")
        return "\n".join(out) + "\n"


def parse(
    text: str,
    line: int,
    table: Table[Any, Any, Any, Any],
    tables: dict[str, Table[Any, Any, Any, Any]] | None = None,
) -> Record | dict[str, Any]:
    """One trace line: a `Record`, or the dict of a ``meta`` line.

    The line's ``table`` field picks its table among `tables` (by name);
    a line without one (an older trace) belongs to `table`.

    Raises:
        ValueError: the line is not a trace line.
        KeyError: it names a table, state or event it cannot be read with.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        msg = "not a JSON object"
        raise ValueError(msg)  # noqa: TRY004 - a format error, not a type
    if "meta" in data:
        return data
    name = data.get("table", table.name)
    if name != table.name:
        table = (tables or {})[name]
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
        table=table.name,
        req_id=req_id,
        epoch=None if epoch is None else int(epoch),
        state=None if state is None else table.state_named(state),
        event=table.event_named(data["event"]),
        outcome=outcome,
        job_epoch=None if job_epoch is None else int(job_epoch),
    )


class _TableReplayer:
    """Feeds one table's records through a fresh registry."""

    def __init__(self, table: Table[Any, Any, Any, Any], prefix: str) -> None:
        # Callbacks stay out and guards become routes: a trace records
        # each event's outcome and epoch, not the data callbacks need.
        machine: AnyMachine = LifecycleMachine(
            table.without_callbacks(), logger=_REPLAY_LOG
        )
        self.table = table
        self.machine = machine
        self.result = Replay(machine)  # the shared one, set by _Replayer
        self.prefix = prefix
        self.registry: Registry[Any, Any, Tracker[Any, Any], Any] = Registry(
            machine, Tracker
        )
        self.open: dict[str, RequestReplay] = {}
        # Ended this session: late events for the id (untracked) still
        # belong to them; a new tracker for the id starts a new path.
        self.ended: dict[str, RequestReplay] = {}
        self.lives: dict[str, int] = {}

    def new_session(self) -> None:
        for req_id in list(self.open):
            self.registry.discard(req_id)
        self.open.clear()
        self.ended.clear()
        self.lives.clear()

    def request(self, r: Record) -> RequestReplay:
        req_id = r.req_id
        request = self.open.get(req_id)
        if request is None and r.state is None:
            request = self.ended.get(req_id)
        if request is None:
            self.ended.pop(req_id, None)
            session = max(self.result.sessions, 1)
            life = self.lives[req_id] = self.lives.get(req_id, 0) + 1
            key = self.prefix + req_id + (f"#{life}" if life > 1 else "")
            if key in self.result.requests:
                key = f"{session}:{key}"
            request = RequestReplay(
                req_id, session, declined=self.table.expected_refusals
            )
            self.result.requests[key] = request
            self.open[req_id] = request
        return request

    def _end(self, req_id: str) -> None:
        """The id's tracker ended: its next tracker is a new request."""
        request = self.open.pop(req_id, None)
        if request is not None:
            self.ended[req_id] = request

    def record(self, r: Record) -> None:  # noqa: C901 - one case per outcome
        self.result.events += 1
        request = self.request(r)
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
        if r.outcome == REFUSED:
            # No state routes there: every route refuses, as the guards did.
            self.registry.fire_on(tracker, r.event, data=REFUSED)
            replayed = tracker.state.name
            if not self.machine.guard_counts.get((r.state, r.event)):
                self._diverged(r, replayed)
            return
        try:
            route: object = self.table.state_named(r.outcome)
        except KeyError:
            route = None
        applied = self.registry.fire_on(tracker, r.event, data=route)
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
        if tracker.state in self.table.terminal:
            self._end(r.req_id)

    def _tracker(self, r: Record) -> Tracker[Any, Any]:
        """The replayed tracker, resynchronised to the recorded state."""
        tracker = self.registry.get_or_create(r.req_id)
        if tracker.state is not r.state and r.state is not None:
            self._diverged(r, tracker.state.name)
            tracker.state = r.state
        epoch = r.epoch or 0
        if r.outcome in {ILLEGAL, STALE, REFUSED} and tracker.epoch != epoch:
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


class _Replayer:
    """Routes records to their table's replayer; one session at a time."""

    def __init__(
        self, tables: list[Table[Any, Any, Any, Any]], path: str
    ) -> None:
        self.path = path
        self.tables = {t.name: t for t in tables}
        first = tables[0]
        self.first = first
        self.parts = {
            t.name: _TableReplayer(t, "" if t is first else f"{t.name}:")
            for t in tables
        }
        self.result = Replay(
            self.parts[first.name].machine,
            {name: part.machine for name, part in self.parts.items()},
        )
        for part in self.parts.values():
            part.result = self.result

    def meta(self, data: dict[str, Any]) -> None:
        name = data.get("table", self.first.name)
        found = data.get("fingerprint")
        table = self.tables.get(name)
        if table is None and data["meta"] == "start":
            table = self.first  # a single-table trace under another name
        if (
            found is not None
            and table is not None
            and found != table.fingerprint
        ):
            raise TableMismatchError(self.path, table.fingerprint, str(found))
        if data["meta"] == "start":
            self.result.sessions += 1
            for part in self.parts.values():
                part.new_session()
        elif data["meta"] == "dropped":
            self.result.dropped += int(data.get("dropped", 0))

    def record(self, r: Record) -> None:
        self.parts[r.table].record(r)


def replay(
    lines: Iterable[str],
    *,
    table: Table[Any, Any, Any, Any] | None = None,
    tables: Iterable[Table[Any, Any, Any, Any]] = (),
    path: str = "<lines>",
) -> Replay:
    """Replay trace lines through fresh, non-strict machines.

    `table` (default: the KV lifecycle, `lifecycle.kv.TABLE`) replays the
    lines that name it or no table; `tables` adds the other tables of a
    trace shared by several lifecycles.  Malformed lines (a line cut short
    by a crash, say, or a table, state or event not given) are listed in
    `Replay.malformed` and skipped.

    Raises:
        TableMismatchError: the trace names a table's name with another
            fingerprint.
    """
    if table is None:
        from lifecycle.kv import TABLE  # noqa: PLC0415 - the default only

        table = TABLE
    every = [table, *(t for t in tables if t.name != table.name)]
    replayer = _Replayer(every, path)
    by_name = replayer.tables
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            parsed = parse(text, number, table, by_name)
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
