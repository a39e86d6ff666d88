"""Cost of one lifecycle event, ours vs stock transitions vs a dict.

``python -m benchmarks.dispatch --json`` prints one JSON object, measured in
one run: medians over repeats of the same legal event sequence driven
through every variant, interleaved so machine noise hits all of them.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import logging
import statistics
import time
import tracemalloc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from transitions import Machine

from lifecycle import (
    LifecycleMachine,
    Registry,
    Row,
    Table,
    Tracker,
    define_tracker,
)
from lifecycle.kv import TABLE, Event, KVTracker, State
from lifecycle.testing import stock_trigger

E = Event
# One request's life through the table: 10 legal events, with callbacks.
CYCLE = (
    E.LOOKUP,
    E.ALLOC_LOCAL,
    E.SAVE_ISSUED,
    E.SAVE_DONE,
    E.PREEMPT,
    E.RESET,
    E.LOOKUP,
    E.ALLOC_LOCAL,
    E.RESUME,
    E.FINISH,
)


class UState(enum.Enum):
    """A user's own state enum (plain `Enum`, Python-level hash)."""

    WAITING = enum.auto()
    RECEIVING = enum.auto()
    RUNNING = enum.auto()
    ABORTED = enum.auto()
    DONE = enum.auto()


class UEvent(enum.Enum):
    """A user's own event enum."""

    ALLOC = "alloc"
    RECEIVED = "received"
    ABORT = "abort"
    RETRY = "retry"
    FINISH = "finish"


@define_tracker
class UTracker(Tracker[UState]):
    """A user's tracker."""

    state: UState = UState.WAITING
    blocks: list[int] = attrs.field(factory=list)
    attempts: int = 0


def _release(tracker: UTracker, _data: object = None) -> None:
    tracker.blocks.clear()


def _attempt(tracker: UTracker, _data: object = None) -> None:
    tracker.attempts += 1


def _can_retry(tracker: UTracker, _data: object = None) -> bool:
    return tracker.attempts < 1_000_000


US, UE = UState, UEvent
USER_TABLE = Table(
    [
        Row(US.WAITING, UE.ALLOC, US.RECEIVING),
        Row(US.WAITING, UE.FINISH, US.DONE),
        Row(US.RECEIVING, UE.RECEIVED, US.RUNNING),
        Row(US.RECEIVING, UE.ABORT, US.ABORTED, after=(_release,)),
        Row(US.RECEIVING, UE.FINISH, US.DONE, after=(_release,)),
        Row(US.RUNNING, UE.ABORT, US.ABORTED, after=(_release,)),
        Row(US.RUNNING, UE.FINISH, US.DONE, after=(_release,)),
        Row(
            US.ABORTED,
            UE.RETRY,
            US.WAITING,
            after=(_attempt,),
            guard=_can_retry,
        ),
        Row(US.ABORTED, UE.FINISH, US.DONE),
    ],
    initial=US.WAITING,
    terminal={US.DONE},
    total_events=(UE.FINISH,),
    name="user",
)
"""A user-defined table: callbacks, a guard, a non-terminal ABORTED."""
USER_CYCLE = (
    UE.ALLOC,
    UE.RECEIVED,
    UE.ABORT,
    UE.RETRY,
    UE.ALLOC,
    UE.RECEIVED,
    UE.ABORT,
    UE.RETRY,
    UE.ALLOC,
    UE.FINISH,
)


@attrs.define(slots=True, eq=False)
class _Plain:
    req_id: str
    state: State = State.NEW


class _Model:
    """A plain object for the machine-per-model variant."""

    def __init__(self) -> None:
        self.state = State.NEW


def _timed(run: Callable[[], int]) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        n = run()
        return (time.perf_counter() - start) / n * 1e6
    finally:
        gc.enable()


def _fired(
    machine: LifecycleMachine[Any, Any, Any, Any],
    trackers: list[Any],
    cycle: tuple[Any, ...],
    method: str = "fire",
) -> Callable[[], int]:
    """Each tracker through `cycle` by `machine.<method>`, from the initial.

    `method` is `fire` (the bool) or `fire_outcome` (what happened).
    """
    initial = machine.table.initial

    def run() -> int:
        fire = getattr(machine, method)
        for t in trackers:
            t.state = initial
            for e in cycle:
                fire(t, e)
        return len(trackers) * len(cycle)

    return run


def _dict_moves(
    table: Table[Any, Any, Any, Any],
    trackers: list[Any],
    cycle: tuple[Any, ...],
) -> Callable[[], int]:
    """The same walk through a plain (state, event) -> state dict."""
    dests = {(r.source, r.event): r.dest for r in table.rows}
    initial = table.initial

    def run() -> int:
        for t in trackers:
            t.state = initial
            for e in cycle:
                dest = dests.get((t.state, e))
                if dest is not None:
                    t.state = dest
        return len(trackers) * len(cycle)

    return run


def _dict_same_work(
    trackers: list[KVTracker], cycle: tuple[Event, ...]
) -> Callable[[], int]:
    """A hand-written dict dispatcher doing what `fire` does, per event.

    What a connector without the library would write for the same legal
    walk: one ``on_event(tracker, event, data)`` call per event, an
    event -> state -> (dest, callbacks, row) dict, the table's own
    callback functions called in order, a count per row, and a count per
    illegal (state, event).  The fair baseline for `fire` (`dict_us`
    moves states only; the previous baseline inlined the callbacks and
    counted nothing, which no connector with metrics does).
    """
    # Nested dicts, event first: no (state, event) tuple built per event,
    # the layout a careful hand-writer picks (and `fire` uses).
    rows: dict[Event, dict[State, tuple[State, tuple[Any, ...], int]]] = {
        e: {} for e in TABLE.events
    }
    for i, r in enumerate(TABLE.rows):
        rows[r.event].setdefault(r.source, (r.dest, TABLE.callbacks(r), i))
    counts = [0] * len(TABLE.rows)
    illegal: Counter[tuple[State, Event]] = Counter()
    new = State.NEW

    def on_event(t: KVTracker, e: Event, data: object = None) -> bool:
        source = t.state
        try:
            dest, callbacks, index = rows[e][source]
        except KeyError:
            illegal[(source, e)] += 1
            return False
        t.state = dest
        for callback in callbacks:
            callback(t, data)
        counts[index] += 1
        return True

    def run() -> int:
        for t in trackers:
            t.state = new
            for e in cycle:
                on_event(t, e)
        return len(trackers) * len(cycle)

    return run


class Tier(enum.Enum):
    """A tiered block: the event's data chooses the alternative."""

    NEW = "new"
    GPU = "gpu"
    CPU = "cpu"
    SSD = "ssd"


class TierEvent(enum.Enum):
    """Place a block (data: the tier asked for) or evict it."""

    PLACE = "place"
    EVICT = "evict"


@define_tracker
class TierTracker(Tracker[Tier]):
    """A block's tracker."""

    state: Tier = Tier.NEW
    moves: int = 0


def _to_gpu(_tracker: TierTracker, data: object) -> bool:
    return data == "gpu"


def _to_cpu(_tracker: TierTracker, data: object) -> bool:
    return data == "cpu"


def _moved(tracker: TierTracker, _data: object) -> None:
    tracker.moves += 1


TIER_TABLE = Table(
    [
        Row(Tier.NEW, TierEvent.PLACE, Tier.GPU, guard=_to_gpu),
        Row(Tier.NEW, TierEvent.PLACE, Tier.CPU, guard=_to_cpu),
        Row(Tier.NEW, TierEvent.PLACE, Tier.SSD, after=(_moved,)),
        Row(Tier.GPU, TierEvent.EVICT, Tier.NEW),
        Row(Tier.CPU, TierEvent.EVICT, Tier.NEW),
        Row(Tier.SSD, TierEvent.EVICT, Tier.NEW, after=(_moved,)),
    ],
    initial=Tier.NEW,
    terminal=(),
    name="tiers",
)
"""Guarded alternatives chosen by the event's data (the last unguarded)."""
TIER_CYCLE: tuple[tuple[TierEvent, object], ...] = (
    (TierEvent.PLACE, "gpu"),
    (TierEvent.EVICT, None),
    (TierEvent.PLACE, "cpu"),
    (TierEvent.EVICT, None),
    (TierEvent.PLACE, "ssd"),
    (TierEvent.EVICT, None),
)


def _fired_with_data(
    machine: LifecycleMachine[Any, Any, Any], n: int
) -> Callable[[], int]:
    """`fire` with data: the alternative is chosen by the data."""
    trackers = [TierTracker(f"b{i}") for i in range(n)]

    def run() -> int:
        fire = machine.fire
        for t in trackers:
            for e, data in TIER_CYCLE:
                fire(t, e, data=data)
        return n * len(TIER_CYCLE)

    return run


def _stock_with_data(
    machine: LifecycleMachine[Any, Any, Any], n: int
) -> Callable[[], int]:
    """transitions' own trigger with the same data (its guards choose)."""
    events = {e: stock_trigger(machine, e) for e in TierEvent}
    trackers = [TierTracker(f"b{i}") for i in range(n)]

    def run() -> int:
        for t in trackers:
            for e, data in TIER_CYCLE:
                events[e](t, data)
        return n * len(TIER_CYCLE)

    return run


def _illegal(
    machine: LifecycleMachine[State, Event, Any, Any], n: int
) -> Callable[[], int]:
    trackers = [KVTracker(f"r{i}") for i in range(n)]

    def run() -> int:
        fire = machine.fire
        for t in trackers:
            for _ in range(10):
                fire(t, E.LOAD_DONE)
        return n * 10

    return run


def _stock(
    machine: LifecycleMachine[State, Event, Any, Any], n: int
) -> Callable[[], int]:
    events = {e: stock_trigger(machine, e) for e in Event}

    trackers = [KVTracker(f"r{i}") for i in range(n)]

    def run() -> int:
        for t in trackers:
            t.state = State.NEW
            for e in CYCLE:
                events[e](t)
        return n * len(CYCLE)

    return run


def _per_model(n: int) -> Callable[[], int]:
    config = [
        {"trigger": r.event.value, "source": r.source, "dest": r.dest}
        for r in TABLE.rows
    ]

    pairs = []
    for _ in range(n):
        model = _Model()
        machine = Machine(
            model=model,
            states=list(TABLE.states),
            transitions=config,
            initial=State.NEW,
            auto_transitions=False,
        )
        pairs.append((model, machine))

    def run() -> int:
        for model, machine in pairs:
            model.state = State.NEW
            for e in CYCLE:
                machine.events[e.value].trigger(model)
        return n * len(CYCLE)

    return run


def _tracker_bytes(live: int) -> tuple[float, int]:
    """Bytes per live tracker in a registry, and how many survive a drop."""
    machine = LifecycleMachine(TABLE)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    registry = Registry(machine, KVTracker)
    for i in range(live):
        t = registry.get_or_create(f"req-{i:08d}")
        registry.fire_on(t, E.LOOKUP)
        registry.fire_on(t, E.ALLOC_LOCAL)
        t.block_ids.extend((i, i + 1))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    gc.disable()
    try:
        refs = [weakref.ref(t) for t in registry]
        del t
        for tracker in list(registry):
            registry.fire_on(tracker, E.FINISH)
        del tracker
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    return used / live, alive


def main() -> None:
    """Run the benchmark and print the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--live", type=int, default=100_000)
    args = parser.parse_args()
    logging.getLogger("lifecycle").setLevel(logging.CRITICAL)
    logging.getLogger("transitions").setLevel(logging.CRITICAL)
    machine = LifecycleMachine(TABLE)
    unlocked = LifecycleMachine(TABLE, thread_safe=False)
    tiers = LifecycleMachine(TIER_TABLE)
    n = args.requests

    def kv(n: int) -> list[Any]:
        return [KVTracker(f"r{i}") for i in range(n)]

    def user(n: int) -> list[Any]:
        return [UTracker(f"r{i}") for i in range(n)]

    variants = {
        "lifecycle_us": _fired(machine, kv(n), CYCLE),
        "lifecycle_unlocked_us": _fired(unlocked, kv(n), CYCLE),
        "lifecycle_illegal_us": _illegal(machine, n),
        "lifecycle_outcome_us": _fired(machine, kv(n), CYCLE, "fire_outcome"),
        "transitions_us": _stock(machine, n),
        "transitions_per_model_us": _per_model(max(n // 10, 50)),
        "dict_us": _dict_moves(
            TABLE, [_Plain(f"r{i}") for i in range(n)], CYCLE
        ),
        "dict_same_work_us": _dict_same_work(kv(n), CYCLE),
        "user_table_us": _fired(
            LifecycleMachine(USER_TABLE), user(n), USER_CYCLE
        ),
        "user_table_unlocked_us": _fired(
            LifecycleMachine(USER_TABLE, thread_safe=False),
            user(n),
            USER_CYCLE,
        ),
        "user_dict_us": _dict_moves(USER_TABLE, user(n), USER_CYCLE),
        "data_chosen_us": _fired_with_data(tiers, n),
        "data_chosen_unlocked_us": _fired_with_data(
            LifecycleMachine(TIER_TABLE, thread_safe=False), n
        ),
        "data_chosen_transitions_us": _stock_with_data(tiers, n),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            samples[name].append(_timed(run))
    result: dict[str, object] = {
        k: round(statistics.median(v), 3) for k, v in samples.items()
    }
    per_tracker, alive = _tracker_bytes(args.live)
    lc = statistics.median(samples["lifecycle_us"])
    result |= {
        "tracker_bytes": round(per_tracker, 1),
        "alive_after_drop": alive,
        "lifecycle_over_dict": round(
            lc / statistics.median(samples["dict_us"]), 2
        ),
        "unlocked_over_dict": round(
            statistics.median(samples["lifecycle_unlocked_us"])
            / statistics.median(samples["dict_us"]),
            2,
        ),
        "unlocked_over_dict_same_work": round(
            statistics.median(samples["lifecycle_unlocked_us"])
            / statistics.median(samples["dict_same_work_us"]),
            2,
        ),
        "outcome_over_fire": round(
            statistics.median(samples["lifecycle_outcome_us"]) / lc, 2
        ),
        "transitions_over_lifecycle": round(
            statistics.median(samples["transitions_us"]) / lc, 1
        ),
        "transitions_over_lifecycle_data_chosen": round(
            statistics.median(samples["data_chosen_transitions_us"])
            / statistics.median(samples["data_chosen_us"]),
            1,
        ),
        "user_unlocked_over_dict": round(
            statistics.median(samples["user_table_unlocked_us"])
            / statistics.median(samples["user_dict_us"]),
            2,
        ),
        "events_per_cycle": len(CYCLE),
        "repeats": args.repeats,
        "live_trackers": args.live,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>28}: {v}")


if __name__ == "__main__":
    main()
