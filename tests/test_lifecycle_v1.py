"""Issue 34 (lifecycle 1.0): generated tests, refusals, outcomes, threads.

A small tiered cache of our own drives every point: a block is placed
hot when there is room, else cold (the unguarded last alternative), and
only cold blocks spill to disk.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
import threading
import time
from typing import Any

import pytest

from lifecycle import (
    GuardRefused,
    IllegalTransition,
    InvalidTable,
    LifecycleMachine,
    Registry,
    Row,
    Table,
    Tracker,
    atomic,
    define_tracker,
)
from lifecycle.testing import check_row, table_tests
from lifecycle.trace import TraceWriter, replay_file


class Tier(enum.Enum):
    NEW = "new"
    HOT = "hot"
    COLD = "cold"
    DISK = "disk"
    GONE = "gone"


class TierEvent(enum.Enum):
    PLACE = "place"
    SPILL = "spill"
    DROP = "drop"


@define_tracker
class Block(Tracker[Tier, int]):
    state: Tier = Tier.NEW
    room: int = 1


def has_room(block: Block, _data: object) -> bool:
    return block.room > 0


T, V = Tier, TierEvent
PLACE_HOT = Row(T.NEW, V.PLACE, T.HOT, guard=has_room)
PLACE_COLD = Row(T.NEW, V.PLACE, T.COLD)  # the unguarded last alternative
TIERS: Table[Tier, TierEvent] = Table(
    [
        PLACE_HOT,
        PLACE_COLD,
        Row(T.COLD, V.SPILL, T.DISK),
        Row(T.HOT, V.DROP, T.GONE),
        Row(T.COLD, V.DROP, T.GONE),
        Row(T.DISK, V.DROP, T.GONE),
    ],
    initial=T.NEW,
    terminal={T.GONE},
    name="tiers",
)


def no_room(block: Block, _row: object) -> None:
    """A set-up: the hot tier is full, so the block goes cold."""
    block.room = 0


TestTiers = table_tests(
    TIERS, Block, setups={PLACE_COLD: no_room}, examples=30, key=1
)


class TestUnguardedLastAlternative:
    """Point 1: reachability through an unguarded last alternative."""

    def test_a_state_behind_it_is_reachable(self) -> None:
        # DISK is only reachable through NEW --place--> COLD.
        TestTiers().test_every_state_is_reachable()

    def test_its_failure_says_what_it_is_and_what_to_supply(self) -> None:
        with pytest.raises(AssertionError) as info:
            check_row(PLACE_COLD, TIERS, Block, key=1)
        text = str(info.value)
        assert "guarded row" not in text
        assert "unguarded last alternative `NEW --place--> COLD`" in text
        assert "every earlier alternative's guard refuse" in text
        assert "setups={<this row>:" in text

    def test_a_state_set_up_is_not_used_for_it(self) -> None:
        calls: list[Any] = []

        def room(block: Block, row: Any) -> None:
            calls.append(row)
            block.room = 1

        check_row(PLACE_HOT, TIERS, Block, {T.NEW: room}, key=1)
        with pytest.raises(AssertionError):
            check_row(PLACE_COLD, TIERS, Block, {T.NEW: room}, key=1)
        assert calls == [PLACE_HOT]

    def test_the_machine_applies_it_when_the_guard_refuses(self) -> None:
        machine: LifecycleMachine[Tier, TierEvent, Block] = LifecycleMachine(
            TIERS
        )
        block = Block(1, room=0)
        assert machine.fire(block, V.PLACE)
        assert block.state is T.COLD


class TestGeneratedTestsIgnoreLogging:
    """Point 7: check_case checks counters, not log records."""

    def test_logging_disabled_everywhere(self) -> None:
        from lifecycle.testing import check_case, matrix  # noqa: PLC0415

        illegal = [c for c in matrix(TIERS) if not c.legal]
        assert illegal
        logging.disable(logging.CRITICAL)
        try:
            for case in illegal:
                check_case(case, TIERS, Block, {PLACE_COLD: no_room}, key=1)
        finally:
            logging.disable(logging.NOTSET)

    def test_an_uncounted_illegal_event_still_fails(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from lifecycle.testing import Case, check_case  # noqa: PLC0415

        def quiet(_self: object, _tracker: object, _event: object) -> bool:
            return False

        monkeypatch.setattr(LifecycleMachine, "_illegal", quiet)
        with pytest.raises(AssertionError, match="illegal count not 1"):
            check_case(Case(T.GONE, V.DROP, None), TIERS, Block, key=1)


# -- point 2: expected refusals ---------------------------------------------


class Slot(enum.Enum):
    FREE = "free"
    USED = "used"
    IDLE = "idle"


class SlotEvent(enum.Enum):
    TAKE = "take"
    RELEASE = "release"
    EVICT = "evict"


@define_tracker
class SlotBlock(Tracker[Slot, int]):
    state: Slot = Slot.FREE
    readers: int = 0


def unused(block: SlotBlock, _data: object) -> bool:
    return block.readers == 0


def quota_left(_block: SlotBlock, data: object) -> bool:
    return data != "over quota"


L, LE = Slot, SlotEvent
SLOT_ROWS = [
    Row(L.FREE, LE.TAKE, L.USED, guard=quota_left),
    Row(L.USED, LE.RELEASE, L.IDLE),
    Row(L.IDLE, LE.TAKE, L.USED, guard=quota_left),
    Row(L.IDLE, LE.EVICT, L.FREE, guard=unused),
]
SLOTS: Table[Slot, SlotEvent] = Table(
    SLOT_ROWS,
    initial=L.FREE,
    terminal=(),
    name="slots",
    expected_refusals=[LE.EVICT],
)


class TestExpectedRefusals:
    def _strict(self) -> LifecycleMachine[Slot, SlotEvent, SlotBlock]:
        return LifecycleMachine(SLOTS, strict=True)

    def test_an_expected_refusal_is_counted_traced_not_raised(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        machine = self._strict()
        seen: list[tuple[Any, ...]] = []
        machine.add_reject_observer(lambda *r: seen.append(r))
        block = SlotBlock(1, state=L.IDLE, readers=2)
        with caplog.at_level(logging.INFO, logger="lifecycle"):
            assert machine.fire(block, LE.EVICT) is False
        assert block.state is L.IDLE
        assert machine.guard_counts[(L.IDLE, LE.EVICT)] == 1
        assert seen == [(1, 0, L.IDLE, LE.EVICT, None, "refused")]
        assert caplog.records == []  # DEBUG only: a normal outcome

    def test_other_refusals_still_raise_in_strict_mode(self) -> None:
        machine = self._strict()
        with pytest.raises(GuardRefused):
            machine.fire(SlotBlock(1), LE.TAKE, data="over quota")

    def test_the_pairs_are_resolved_from_events(self) -> None:
        assert SLOTS.expected_refusals == {(L.IDLE, LE.EVICT)}
        assert SLOTS.is_expected_refusal(L.IDLE, LE.EVICT)
        assert not SLOTS.is_expected_refusal(L.FREE, LE.TAKE)

    @pytest.mark.parametrize(
        "given",
        [
            [(L.USED, LE.RELEASE)],  # unguarded: never refused
            [(L.FREE, LE.EVICT)],  # no row
            [LE.RELEASE],  # no state where all its rows are guarded
        ],
        ids=["unguarded", "no-row", "event"],
    )
    def test_validated_when_the_table_is_built(self, given: Any) -> None:
        with pytest.raises(InvalidTable) as info:
            Table(
                SLOT_ROWS,
                initial=L.FREE,
                terminal=(),
                expected_refusals=given,
            )
        assert info.value.kinds == {"bad-expected-refusal"}

    def test_fingerprints_of_tables_without_them_do_not_change(self) -> None:
        plain = Table(SLOT_ROWS, initial=L.FREE, terminal=(), name="slots")
        assert plain.fingerprint != SLOTS.fingerprint
        assert SLOTS.without_callbacks().expected_refusals == {
            (L.IDLE, LE.EVICT)
        }

    def test_diagrams_show_a_declined_event_not_a_state(self) -> None:
        from lifecycle.render import (  # noqa: PLC0415
            to_dot,
            to_markdown,
            to_mermaid,
        )

        dot = to_dot(SLOTS)
        assert (
            '"IDLE" -> "IDLE" [label="evict (declined)", style=dotted' in dot
        )
        assert "note right of IDLE : evict may be declined" in to_mermaid(
            SLOTS
        )
        assert "Expected refusals" in to_markdown(SLOTS)
        assert "declined" not in to_dot(
            Table(SLOT_ROWS, initial=L.FREE, terminal=())
        )


TestSlots = table_tests(SLOTS, SlotBlock, examples=30, key=1)


# -- point 3: fire returns what happened -------------------------------------


class TestOutcome:
    def _machine(self, **kw: Any) -> LifecycleMachine[Tier, TierEvent, Block]:
        return LifecycleMachine(TIERS, **kw)

    def test_the_alternative_that_applied(self) -> None:
        machine = self._machine()
        hot = machine.fire_outcome(Block(1), V.PLACE)
        cold = machine.fire_outcome(Block(2, room=0), V.PLACE)
        assert hot
        assert cold
        assert (hot.kind, hot.source, hot.state, hot.row) == (
            "applied",
            T.NEW,
            T.HOT,
            PLACE_HOT,
        )
        assert (cold.state, cold.row) == (T.COLD, PLACE_COLD)

    def test_illegal_stale_failed_refused(self) -> None:
        machine = self._machine()
        block = Block(1)
        illegal = machine.fire_outcome(block, V.SPILL)
        assert not illegal
        assert (illegal.kind, illegal.source, illegal.row) == (
            "illegal",
            T.NEW,
            None,
        )
        assert machine.fire_outcome(block, V.PLACE, epoch=5).kind == "stale"

        def broken(_block: Block, _data: object) -> bool:
            raise RuntimeError

        table = Table(
            [Row(T.NEW, V.PLACE, T.HOT, guard=broken), *TIERS.rows[1:]],
            initial=T.NEW,
            terminal={T.GONE},
        )
        failed = LifecycleMachine(table).fire_outcome(Block(2), V.PLACE)
        assert (failed.kind, failed.state) == ("failed", T.NEW)
        slots: LifecycleMachine[Slot, SlotEvent, SlotBlock] = LifecycleMachine(
            SLOTS
        )
        declined = slots.fire_outcome(
            SlotBlock(3, state=L.IDLE, readers=1), LE.EVICT
        )
        assert (declined.kind, declined.expected) == ("refused", True)
        refused = slots.fire_outcome(SlotBlock(4), LE.TAKE, data="over quota")
        assert (refused.kind, refused.expected) == ("refused", False)

    def test_the_registry_drops_an_ended_tracker(self) -> None:
        registry = Registry(self._machine(), Block)
        registry.get_or_create(1)
        assert registry.fire_outcome(1, V.PLACE).state is T.HOT
        assert registry.fire_outcome(1, V.DROP).state is T.GONE
        assert 1 not in registry
        unknown = registry.fire_outcome(1, V.DROP)
        assert (unknown.kind, unknown.source) == ("illegal", None)

    def test_strict_mode_raises_the_same(self) -> None:
        with pytest.raises(IllegalTransition):
            self._machine(strict=True).fire_outcome(Block(1), V.SPILL)

    def test_each_outcome_is_its_own_event_across_threads(self) -> None:
        # Four threads fire on one block: reading tracker.state after
        # fire() could see another thread's move; an outcome cannot.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        machine: LifecycleMachine[Slot, SlotEvent, SlotBlock] = (
            LifecycleMachine(SLOTS)
        )
        block = SlotBlock(1)
        bad: list[Any] = []
        applied: list[int] = []

        def worker(events: tuple[SlotEvent, ...]) -> None:
            for _ in range(1500):
                for event in events:
                    out = machine.fire_outcome(block, event)
                    if out:
                        applied.append(1)  # atomic, unlike += 1
                        assert out.row is not None
                        if (out.row.source, out.row.dest) != (
                            out.source,
                            out.state,
                        ):
                            bad.append(out)

        cycles = [(LE.TAKE, LE.RELEASE), (LE.EVICT, LE.TAKE)]
        threads = [
            threading.Thread(target=worker, args=(cycles[n % 2],))
            for n in range(4)
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        finally:
            sys.setswitchinterval(interval)
        assert not bad, bad[:3]
        assert len(applied) == sum(machine.row_counts()) > 100


# -- point 5: composition across threads -------------------------------------


class Job(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"


class JobEvent(enum.Enum):
    START = "start"
    STOP = "stop"


@define_tracker
class JobTracker(Tracker[Job, int]):
    state: Job = Job.IDLE


def admitted(_job: JobTracker, data: object) -> bool:
    return data != "reject"


JOBS: Table[Job, JobEvent] = Table(
    [
        Row(Job.IDLE, JobEvent.START, Job.BUSY, guard=admitted),
        Row(Job.BUSY, JobEvent.STOP, Job.IDLE),
    ],
    initial=Job.IDLE,
    terminal=(),
    name="jobs",
    expected_refusals=[JobEvent.START],
)


def _composed_run(
    *, thread_safe: bool, hold: Any = None
) -> tuple[list[str], int]:
    """Four threads claim a slot and start a job on it, undoing the claim
    when the job refuses; a fifth checks "slot USED <=> job BUSY".

    Returns the violations seen and the composed steps that applied.
    """
    lock = threading.RLock()
    slots: LifecycleMachine[Slot, SlotEvent, SlotBlock] = LifecycleMachine(
        SLOTS, lock=lock, thread_safe=thread_safe
    )
    jobs: LifecycleMachine[Job, JobEvent, JobTracker] = LifecycleMachine(
        JOBS, lock=lock, thread_safe=thread_safe
    )
    together = hold or (lambda: atomic(slots, jobs))
    slot, job = SlotBlock(1), JobTracker(1)
    bad: list[str] = []
    done: list[int] = []
    stop = threading.Event()

    def holder(n: int) -> None:
        for i in range(300):
            with together():
                if not slots.fire(slot, LE.TAKE):
                    continue
                data = "reject" if (i + n) % 3 == 0 else None
                if not jobs.fire(job, JobEvent.START, data=data):
                    slots.fire(slot, LE.RELEASE)  # undo the claim
                    continue
            done.append(1)
            with together():
                jobs.fire(job, JobEvent.STOP)
                slots.fire(slot, LE.RELEASE)

    def checker() -> None:
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            with together():
                if (slot.state is L.USED) != (job.state is Job.BUSY):
                    bad.append(f"{slot.state.name}/{job.state.name}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        watch = threading.Thread(target=checker)
        watch.start()
        workers = [
            threading.Thread(target=holder, args=(n,)) for n in range(4)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=60)
        stop.set()
        watch.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    return bad, len(done)


class TestComposition:
    def test_a_shared_lock_makes_two_tables_atomic(self) -> None:
        bad, done = _composed_run(thread_safe=True)
        assert bad == []
        assert done > 0

    def test_unlocked_machines_are_safe_under_the_shared_lock(self) -> None:
        bad, done = _composed_run(thread_safe=False)
        assert bad == []
        assert done > 0

    def test_machines_with_their_own_locks_cannot_be_composed(self) -> None:
        with (
            pytest.raises(ValueError, match="one shared lock"),
            atomic(LifecycleMachine(SLOTS), LifecycleMachine(JOBS)),
        ):
            pass

    @pytest.mark.parametrize("held", ["atomic", "nothing"])
    def test_another_thread_never_sees_half_a_step(self, held: str) -> None:
        # Deterministic: the step pauses halfway (up to 0.3 s) for the
        # checker.  Under atomic() the checker waits for the whole step;
        # with nothing held (the control) it sees the slot claimed and
        # the job not started.
        lock = threading.RLock()
        slots: LifecycleMachine[Slot, SlotEvent, SlotBlock] = LifecycleMachine(
            SLOTS, lock=lock
        )
        jobs: LifecycleMachine[Job, JobEvent, JobTracker] = LifecycleMachine(
            JOBS, lock=lock
        )
        shared = held == "atomic"
        hold = (
            (lambda: atomic(slots, jobs)) if shared else contextlib.nullcontext
        )
        slot, job = SlotBlock(1), JobTracker(1)
        halfway, looked = threading.Event(), threading.Event()
        seen: list[tuple[Slot, Job]] = []

        def step() -> None:
            with hold():
                slots.fire(slot, LE.TAKE)
                halfway.set()
                looked.wait(0.3)
                jobs.fire(job, JobEvent.START)

        def check() -> None:
            halfway.wait(10)
            with hold():
                seen.append((slot.state, job.state))
            looked.set()

        threads = [threading.Thread(target=f) for f in (step, check)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        expected = (L.USED, Job.BUSY) if shared else (L.USED, Job.IDLE)
        assert seen == [expected]


# -- point 6: cyclic tables retire idle trackers -----------------------------


class TestRetireIdle:
    def test_a_cyclic_registry_stays_bounded(self) -> None:
        registry = Registry(
            LifecycleMachine(SLOTS), SlotBlock, retire_at={L.FREE}
        )
        for key in range(2000):
            registry.get_or_create(key)
            for event in (LE.TAKE, LE.RELEASE):
                assert registry.fire(key, event)
            if key % 2:
                assert registry.fire(key, LE.EVICT)  # back to FREE: idle
        assert len(registry) == 1000  # the IDLE ones, not all 2000
        assert all(t.state is L.IDLE for t in registry)

    def test_a_reused_key_continues_its_epochs(self) -> None:
        registry = Registry(
            LifecycleMachine(SLOTS), SlotBlock, retire_at={L.FREE}
        )
        first = registry.get_or_create(7)
        first.epoch = 4
        for event in (LE.TAKE, LE.RELEASE, LE.EVICT):
            assert registry.fire(7, event)
        assert 7 not in registry
        again = registry.get_or_create(7)
        assert again is not first
        assert again.epoch > 4
        assert registry.fire(7, LE.TAKE)
        assert not registry.fire(7, LE.RELEASE, epoch=4)  # the old job: stale

    def test_without_retire_at_every_tracker_stays(self) -> None:
        registry = Registry(LifecycleMachine(SLOTS), SlotBlock)
        for key in range(50):
            registry.get_or_create(key)
            for event in (LE.TAKE, LE.RELEASE, LE.EVICT):
                registry.fire(key, event)
        assert len(registry) == 50

    @pytest.mark.parametrize(
        ("table", "state", "why"),
        [
            (SLOTS, L.USED, "accepts other rows"),
            (TIERS, T.GONE, "is terminal"),
            (SLOTS, T.HOT, "not a state of the table"),
        ],
    )
    def test_only_states_equivalent_to_a_fresh_start(
        self, table: Any, state: Any, why: str
    ) -> None:
        with pytest.raises(ValueError, match=why):
            Registry(LifecycleMachine(table), Tracker, retire_at={state})


# -- point 9: replay ----------------------------------------------------------


class TestReplay:
    def test_a_refusal_is_not_drawn_as_a_state(self, tmp_path: Any) -> None:
        machine: LifecycleMachine[Slot, SlotEvent, SlotBlock] = (
            LifecycleMachine(SLOTS)
        )
        registry = Registry(machine, SlotBlock)
        path = tmp_path / "t.jsonl"
        writer = TraceWriter.open(path)
        writer.attach(machine)
        registry.get_or_create(1)
        registry.fire(1, LE.TAKE, data="over quota")  # refused
        registry.fire(1, LE.TAKE)
        registry.fire(1, LE.RELEASE)
        registry.get(1).readers = 1  # type: ignore[union-attr]
        registry.fire(1, LE.EVICT)  # declined: an expected refusal
        writer.close()
        path_text = replay_file(path, table=SLOTS).requests["1"].path()
        assert path_text == (
            "FREE [refused take] -take-> USED -release-> IDLE [declined evict]"
        )
        assert "-> refused" not in path_text

    def test_a_reused_id_is_a_new_path(self, tmp_path: Any) -> None:
        machine: LifecycleMachine[Tier, TierEvent, Block] = LifecycleMachine(
            TIERS
        )
        registry = Registry(machine, Block)
        path = tmp_path / "t.jsonl"
        writer = TraceWriter.open(path)
        writer.attach(machine)
        registry.get_or_create(1)
        registry.fire(1, V.PLACE)
        registry.fire(1, V.DROP)
        registry.fire(1, V.DROP)  # late: untracked, the first life's
        registry.get_or_create(1).room = 0
        registry.fire(1, V.PLACE)
        registry.fire(1, V.SPILL)
        writer.close()
        result = replay_file(path, table=TIERS)
        paths = {k: r.path() for k, r in result.requests.items()}
        assert paths == {
            "1": "NEW -place-> HOT -drop-> GONE [illegal drop]",
            "1#2": "NEW -place-> COLD -spill-> DISK",
        }
        assert result.divergences == []


# -- point 10: data-chosen alternatives against stock transitions -------------


def _wants(tier: str) -> Any:
    def guard(_block: Block, data: object) -> bool:
        return data == tier

    guard.__name__ = f"wants_{tier}"
    return guard


ROUTED: Table[Tier, TierEvent] = Table(
    [
        Row(T.NEW, V.PLACE, T.HOT, guard=_wants("hot")),
        Row(T.NEW, V.PLACE, T.COLD, guard=_wants("cold")),
        Row(T.NEW, V.PLACE, T.DISK),
        Row(T.HOT, V.DROP, T.NEW),
        Row(T.COLD, V.DROP, T.NEW),
        Row(T.DISK, V.DROP, T.NEW),
        Row(T.COLD, V.SPILL, T.DISK),
    ],
    initial=T.NEW,
    terminal=(),
    states=(T.NEW, T.HOT, T.COLD, T.DISK),
    name="routed",
)

TestRouted = table_tests(
    ROUTED,
    Block,
    setups={
        ROUTED.rows[0]: lambda _b, _r: "hot",
        ROUTED.rows[1]: lambda _b, _r: "cold",
        ROUTED.rows[2]: lambda _b, _r: "disk",
    },
    data=(None, "hot", "cold", "disk"),
    examples=60,
    key=1,
)


def test_the_benchmark_compares_the_same_data_chosen_walk() -> None:
    from benchmarks import dispatch  # noqa: PLC0415

    machine = LifecycleMachine(dispatch.TIER_TABLE)
    ours, stock = (
        dispatch._fired_with_data(machine, 3),
        dispatch._stock_with_data(machine, 3),
    )
    assert ours() == stock() == 3 * len(dispatch.TIER_CYCLE)
    # The stock trigger runs the same callbacks but counts nothing: every
    # row was applied once per tracker, by `fire`.
    assert machine.row_counts() == (3,) * len(dispatch.TIER_TABLE.rows)
