"""The KV request lifecycle, as one declarative transition table.

This module is the single source of truth.  The `transitions` machine
(`lifecycle.machine`), the typed event API, the diagrams in ``diagrams/``
and the generated transition-table tests are all derived from `TABLE`;
nothing about the lifecycle may be written anywhere else.  A transition
coded by hand outside the table is invisible to the diagrams, the tests and
the illegal-ordering policy, which is how the bugs this project exists for
were born.

Rules
-----
* One row per (state, event).  An event with no row for the tracker's
  current state is an *illegal ordering*: the tracker is left unchanged, the
  fire returns False, a counter keyed by (state, event) is incremented and
  one rate-limited structured record is logged.  Strict mode (tests) raises
  `IllegalTransition` instead.  Never an assert, never a crash.
* `finish` and `abort` are accepted from every non-terminal state: vLLM may
  end a request at any point, including before it was ever looked up, while
  its KV is arriving and after it was preempted with no blocks
  (vLLM #43281, #56780, vllm-ascend#3721).
* Terminal states (FINISHED, ABORTED) have no exits; the registry drops a
  tracker the moment it reaches one.
* Transfer and lookup completions carry the epoch they were issued in.  A
  completion from an older epoch is stale: it is counted and never reaches
  the table (vLLM #51637: request ids are reused after preemption).
* Callbacks are named in the row and run after the state change, in order;
  they may only touch the tracker and must not fire events.

Theory of operation
-------------------
NEW       The request is known (looked up, maybe repeatedly: vLLM calls
          `get_num_new_matched_tokens` every step while it waits for space).
          A store lookup runs off the scheduler thread; its answer arrives
          as `lookup_done`, fenced by the epoch it was started in, so a
          lookup that returns after a preemption is stale.  Accepted only
          where a request waits to be admitted (NEW, RESET).
LOADING   Blocks are allocated and external KV is being received into them
          (vLLM: WAITING_FOR_REMOTE_KVS).  Saves are illegal here, so a load
          and a save are never co-queued for one request (vLLM #43371).
SAVING    The request is running: its KV is computed on the device and full
          blocks are saved to the store.  (For a consumer the saves are
          skipped, but the state is the same: KV is being produced.)
PREEMPTED vLLM preempted the request and has already freed its blocks,
          possibly to another request in the same step.  The epoch is bumped
          at once, so no in-flight job of the old epoch can touch the new
          lifecycle; in-flight saves pin their own blocks (vLLM #52360).
RESET     The connector has cleared the tracker for re-admission: after a
          preemption, or after a failed load (vLLM keeps the valid prefix
          or frees everything and looks the request up again).  Lookups
          and allocations accumulate until vLLM schedules it again, and a
          resume *replaces* the block table (vLLM #46595, LMCache#2069).
DRAINING  Added for invariant 3 of the reference (vLLM #50984, #43226,
          local-inference-lab/vllm#191): vLLM finished a request while its
          KV was still arriving; it keeps the blocks until exactly one
          receive completion is reported, even on failure, so the tracker
          must outlive the finish until that completion.  It ends ABORTED:
          a request finished before its KV arrived never ran.
FINISHED  Ended normally (stop, length).  Terminal.
ABORTED   Ended by an abort or an error.  Terminal.

Invariants this table enforces by construction
----------------------------------------------
* finish/abort from anywhere non-terminal (validated when built).
* Every non-terminal state can reach a terminal one; nothing is unreachable;
  terminal states have no exits (validated when built).
* No save while loading; no resume unless running or reset.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from lifecycle.errors import InvalidTable, TableProblem
from lifecycle.states import TERMINAL, Event, State
from lifecycle.tracker import CALLBACKS


@attrs.frozen
class Row:
    """One legal transition: `event` in `source` moves to `dest`.

    Attributes:
        source: The state the event is accepted in.
        event: The event.
        dest: The state after the event (may equal `source`).
        after: Names of callbacks (see `lifecycle.tracker.CALLBACKS`) run
            after the state change, in order.
    """

    source: State
    event: Event
    dest: State
    after: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.source.name} --{self.event.value}--> {self.dest.name}"


S = State
E = Event

TRANSITIONS: Final[tuple[Row, ...]] = (
    # NEW: known, nothing allocated.  Lookups repeat while vLLM waits.
    Row(S.NEW, E.LOOKUP, S.NEW),
    Row(S.NEW, E.LOOKUP_DONE, S.NEW),
    Row(S.NEW, E.ALLOC_LOCAL, S.SAVING),
    Row(S.NEW, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.NEW, E.FINISH, S.FINISHED),
    Row(S.NEW, E.ABORT, S.ABORTED),
    # LOADING: external KV arriving into allocated blocks.
    Row(S.LOADING, E.ALLOC_LOCAL, S.LOADING),
    Row(S.LOADING, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.LOADING, E.LOAD_DONE, S.SAVING, after=("settle_load",)),
    Row(
        S.LOADING,
        E.LOAD_FAILED,
        S.RESET,
        after=("settle_load", "clear_progress"),
    ),
    Row(S.LOADING, E.FINISH, S.DRAINING),
    Row(S.LOADING, E.ABORT, S.DRAINING),
    # SAVING: running; full blocks are saved as they fill.
    Row(S.SAVING, E.ALLOC_LOCAL, S.SAVING),
    Row(S.SAVING, E.SAVE_ISSUED, S.SAVING),
    Row(S.SAVING, E.SAVE_DONE, S.SAVING),
    Row(S.SAVING, E.SAVE_FAILED, S.SAVING),
    Row(S.SAVING, E.RESUME, S.SAVING),
    Row(
        S.SAVING,
        E.PREEMPT,
        S.PREEMPTED,
        after=("bump_epoch", "release_blocks"),
    ),
    Row(S.SAVING, E.FINISH, S.FINISHED, after=("release_blocks",)),
    Row(S.SAVING, E.ABORT, S.ABORTED, after=("release_blocks",)),
    # PREEMPTED: blocks already freed by vLLM; old epoch fenced.
    Row(S.PREEMPTED, E.RESET, S.RESET, after=("clear_progress",)),
    Row(S.PREEMPTED, E.FINISH, S.FINISHED),
    Row(S.PREEMPTED, E.ABORT, S.ABORTED),
    # RESET: cleared, waiting to be re-admitted.
    Row(S.RESET, E.LOOKUP, S.RESET),
    Row(S.RESET, E.LOOKUP_DONE, S.RESET),
    Row(S.RESET, E.ALLOC_LOCAL, S.RESET),
    Row(S.RESET, E.ALLOC_EXTERNAL, S.LOADING),
    Row(S.RESET, E.RESUME, S.SAVING),
    Row(S.RESET, E.FINISH, S.FINISHED, after=("release_blocks",)),
    Row(S.RESET, E.ABORT, S.ABORTED, after=("release_blocks",)),
    # DRAINING: finished by vLLM, exactly one receive completion owed.
    Row(S.DRAINING, E.LOAD_DONE, S.ABORTED, after=("settle_load",)),
    Row(S.DRAINING, E.LOAD_FAILED, S.ABORTED, after=("settle_load",)),
    Row(S.DRAINING, E.FINISH, S.DRAINING),
    Row(S.DRAINING, E.ABORT, S.DRAINING),
    # FINISHED and ABORTED: terminal, no rows.
)


class Table:
    """A validated, frozen transition table.

    Building a `Table` validates it: every defect is collected and reported
    together in one `InvalidTable` whose problems name the offending rows.

    Args:
        rows: The transitions.
        states: Every declared state, in display order.
        initial: The state new trackers start in.
        terminal: States that end a lifecycle.
        total_events: Events every non-terminal state must accept.
        callbacks: Callback names rows may use.
    """

    __slots__ = (
        "_by_key",
        "callbacks",
        "initial",
        "rows",
        "states",
        "terminal",
        "total_events",
    )

    def __init__(
        self,
        rows: Iterable[Row],
        *,
        states: Iterable[State] = tuple(State),
        initial: State = State.NEW,
        terminal: Iterable[State] = TERMINAL,
        total_events: Iterable[Event] = (Event.FINISH, Event.ABORT),
        callbacks: Mapping[str, object] = CALLBACKS,
    ) -> None:
        self.rows: tuple[Row, ...] = tuple(rows)
        self.states: tuple[State, ...] = tuple(states)
        self.initial = initial
        self.terminal: frozenset[State] = frozenset(terminal)
        self.total_events: tuple[Event, ...] = tuple(total_events)
        self.callbacks: frozenset[str] = frozenset(callbacks)
        problems = self._problems()
        if problems:
            raise InvalidTable(problems)
        self._by_key: dict[tuple[State, Event], Row] = {
            (r.source, r.event): r for r in self.rows
        }

    def get(self, state: State, event: Event) -> Row | None:
        """The row for `event` in `state`, or None if it is illegal there."""
        return self._by_key.get((state, event))

    def events_from(self, state: State) -> tuple[Event, ...]:
        """The events accepted in `state`, in table order."""
        return tuple(r.event for r in self.rows if r.source is state)

    def dest(self, state: State, event: Event) -> State | None:
        """Where `event` in `state` leads, or None if it is illegal there."""
        row = self._by_key.get((state, event))
        return None if row is None else row.dest

    # -- validation -------------------------------------------------------

    def _problems(self) -> tuple[TableProblem, ...]:
        problems: list[TableProblem] = []
        declared = set(self.states)
        problems += self._declaration_problems(declared)
        problems += self._row_problems(declared)
        if not any(p.kind == "unknown-state" for p in problems):
            problems += self._graph_problems()
        return tuple(problems)

    def _declaration_problems(
        self, declared: set[State]
    ) -> list[TableProblem]:
        problems = []
        if self.initial not in declared:
            problems.append(
                TableProblem(
                    "unknown-state",
                    f"initial state {self.initial.name} is not declared",
                )
            )
        problems.extend(
            TableProblem(
                "unknown-state", f"terminal state {s.name} is not declared"
            )
            for s in sorted(self.terminal - declared, key=_order)
        )
        return problems

    def _row_problems(self, declared: set[State]) -> list[TableProblem]:
        problems = []
        seen: dict[tuple[State, Event], Row] = {}
        for row in self.rows:
            unknown = [s for s in (row.source, row.dest) if s not in declared]
            if unknown:
                names = ", ".join(s.name for s in unknown)
                problems.append(
                    TableProblem(
                        "unknown-state",
                        f"row `{row}` uses undeclared state {names}",
                        (row,),
                    )
                )
            key = (row.source, row.event)
            if key in seen:
                problems.append(
                    TableProblem(
                        "duplicate-row",
                        f"rows `{seen[key]}` and `{row}` share "
                        f"({row.source.name}, {row.event.value})",
                        (seen[key], row),
                    )
                )
            else:
                seen[key] = row
            if row.source in self.terminal:
                problems.append(
                    TableProblem(
                        "terminal-exit",
                        f"row `{row}` leaves terminal state {row.source.name}",
                        (row,),
                    )
                )
            problems.extend(
                TableProblem(
                    "unknown-callback",
                    f"row `{row}` names unknown callback {name!r}",
                    (row,),
                )
                for name in row.after
                if name not in self.callbacks
            )
        for state in self.states:
            if state in self.terminal:
                continue
            accepted = {r.event for r in self.rows if r.source is state}
            problems.extend(
                TableProblem(
                    "missing-total-event",
                    f"non-terminal state {state.name} does not accept "
                    f"`{event.value}`",
                )
                for event in self.total_events
                if event not in accepted
            )
        return problems

    def _graph_problems(self) -> list[TableProblem]:
        problems = []
        reachable = _closure({self.initial}, self._successors())
        for state in self.states:
            if state not in reachable:
                into = tuple(r for r in self.rows if r.dest is state)
                problems.append(
                    TableProblem(
                        "unreachable-state",
                        f"state {state.name} cannot be reached from "
                        f"{self.initial.name}"
                        + (
                            f" (rows into it: "
                            f"{', '.join(f'`{r}`' for r in into)})"
                            if into
                            else ""
                        ),
                        into,
                    )
                )
        reaches_end = _closure(set(self.terminal), self._predecessors())
        for state in self.states:
            if state not in reaches_end:
                out = tuple(r for r in self.rows if r.source is state)
                problems.append(
                    TableProblem(
                        "no-way-out",
                        f"non-terminal state {state.name} cannot reach a "
                        f"terminal state (its rows: "
                        f"{', '.join(f'`{r}`' for r in out) or 'none'})",
                        out,
                    )
                )
        return problems

    def _successors(self) -> dict[State, set[State]]:
        succ: dict[State, set[State]] = {s: set() for s in self.states}
        for r in self.rows:
            succ[r.source].add(r.dest)
        return succ

    def _predecessors(self) -> dict[State, set[State]]:
        pred: dict[State, set[State]] = {s: set() for s in self.states}
        for r in self.rows:
            pred[r.dest].add(r.source)
        return pred


def _order(state: State) -> int:
    return list(State).index(state)


def _closure(start: set[State], edges: dict[State, set[State]]) -> set[State]:
    seen = set(start)
    todo = deque(start)
    while todo:
        for nxt in edges.get(todo.popleft(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


TABLE: Final[Table] = Table(TRANSITIONS)
"""The request KV lifecycle, validated at import."""
