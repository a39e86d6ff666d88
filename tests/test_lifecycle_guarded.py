"""Guarded alternatives, refusals, cyclic tables and sound identity.

A reference-counted cache slot: ``unpin`` decides its next state from
the count (guarded alternatives of one (state, event)), it cycles forever
(``terminal=()``), and its keys are ints.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from typing import Any

import attrs
import pytest

from lifecycle import (
    GuardRefused,
    IllegalTransition,
    InvalidTable,
    LifecycleMachine,
    ReentrantFire,
    Registry,
    Row,
    Table,
    Tracker,
    define_tracker,
    render,
)
from lifecycle import registry as registry_module
from lifecycle.testing import check_row, fire_stock, table_tests
from lifecycle.trace import TraceWriter, replay_file, summarize


class Slot(enum.Enum):
    FREE = "free"
    PINNED = "pinned"
    CACHED = "cached"


class SlotEvent(enum.Enum):
    PIN = "pin"
    UNPIN = "unpin"
    EVICT = "evict"


@define_tracker
class SlotTracker(Tracker[Slot, int]):
    state: Slot = Slot.FREE
    readers: int = 0


def add_reader(tracker: SlotTracker, _data: object) -> None:
    tracker.readers += 1


def drop_reader(tracker: SlotTracker, _data: object) -> None:
    tracker.readers -= 1


def others_remain(tracker: SlotTracker, _data: object) -> bool:
    return tracker.readers > 1


def last_reader(tracker: SlotTracker, _data: object) -> bool:
    return tracker.readers == 1


def no_readers(tracker: SlotTracker, _data: object) -> bool:
    return tracker.readers == 0


R, V = Slot, SlotEvent
ROWS = (
    Row(R.FREE, V.PIN, R.PINNED, after=(add_reader,)),
    Row(R.PINNED, V.PIN, R.PINNED, after=(add_reader,)),
    # Guarded alternatives: the count chooses the next state.
    Row(
        R.PINNED, V.UNPIN, R.PINNED, after=(drop_reader,), guard=others_remain
    ),
    Row(R.PINNED, V.UNPIN, R.CACHED, after=(drop_reader,), guard=last_reader),
    Row(R.CACHED, V.PIN, R.PINNED, after=(add_reader,)),
    Row(R.CACHED, V.EVICT, R.FREE, guard=no_readers),
)
SLOTS: Table[Slot, SlotEvent] = Table(
    ROWS, initial=R.FREE, terminal=(), name="slot"
)


def pinned_by(readers: int) -> Any:
    """A set-up: the tracker holds `readers` readers."""

    def setup(tracker: SlotTracker, _row: object) -> None:
        tracker.readers = readers

    return setup


SETUPS = {ROWS[2]: pinned_by(2), ROWS[3]: pinned_by(1)}


def _machine(**kw: Any) -> LifecycleMachine[Slot, SlotEvent, SlotTracker]:
    return LifecycleMachine(SLOTS, **kw)


class TestGuardedAlternatives:
    def test_the_first_matching_guard_wins(self) -> None:
        registry = Registry(_machine(), SlotTracker)
        slot = registry.get_or_create(7)
        registry.fire(7, V.PIN)
        registry.fire(7, V.PIN)
        assert registry.fire(7, V.UNPIN)
        assert (slot.state, slot.readers) == (R.PINNED, 1)
        assert registry.fire(7, V.UNPIN)  # the last reader: cached
        assert (slot.state, slot.readers) == (R.CACHED, 0)
        counts = registry.machine.transition_counts()
        assert (counts[ROWS[2]], counts[ROWS[3]]) == (1, 1)

    def test_an_unguarded_last_row_is_the_fallback(self) -> None:
        def never(_t: object, _d: object) -> bool:
            return False

        table: Table[Slot, SlotEvent] = Table(
            [
                Row(R.FREE, V.PIN, R.CACHED, guard=never),
                Row(R.FREE, V.PIN, R.PINNED),
                Row(R.PINNED, V.EVICT, R.FREE),
                Row(R.CACHED, V.EVICT, R.FREE),
            ],
            initial=R.FREE,
            terminal=(),
        )
        machine: LifecycleMachine[Slot, SlotEvent] = LifecycleMachine(table)
        tracker = SlotTracker(1)
        assert machine.fire(tracker, V.PIN)
        assert tracker.state is R.PINNED

    def test_the_stock_path_chooses_the_same_row(self) -> None:
        machine = _machine()
        for readers, want in ((3, R.PINNED), (1, R.CACHED), (0, None)):
            fast = SlotTracker(1, state=R.PINNED, readers=readers)
            stock = SlotTracker(1, state=R.PINNED, readers=readers)
            assert machine.fire(fast, V.UNPIN) == fire_stock(
                machine, stock, V.UNPIN
            )
            assert attrs.asdict(fast) == attrs.asdict(stock)
            if want is not None:
                assert fast.state is want


class TestRefusals:
    def test_counted_logged_at_a_bounded_rate_never_illegal(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        machine = _machine()
        tracker = SlotTracker(3, state=R.PINNED, readers=0)
        with caplog.at_level(logging.INFO, logger="lifecycle"):
            for _ in range(5):
                assert not machine.fire(tracker, V.UNPIN)
        assert machine.guard_counts[(R.PINNED, V.UNPIN)] == 5
        assert machine.illegal_total == 0
        records = [r for r in caplog.records if hasattr(r, "lifecycle")]
        assert len(records) == 1  # rate-limited
        fields = records[0].lifecycle
        assert "refused by every guard" in records[0].getMessage()
        assert (fields["table"], fields["state"], fields["event"]) == (
            "slot",
            "PINNED",
            "unpin",
        )

    def test_strict_mode_raises_naming_the_rows_tried(self) -> None:
        machine = _machine(strict=True)
        tracker = SlotTracker(3, state=R.PINNED, readers=0)
        with pytest.raises(GuardRefused) as info:
            machine.fire(tracker, V.UNPIN)
        exc = info.value
        assert (exc.state, exc.event, exc.req_id, exc.table) == (
            R.PINNED,
            V.UNPIN,
            3,
            "slot",
        )
        assert exc.rows == (ROWS[2], ROWS[3])
        assert "PINNED --unpin--> CACHED" in str(exc)
        assert tracker.state is R.PINNED

    def test_traced_and_replayed(self, tmp_path: Any) -> None:
        machine = _machine()
        registry = Registry(machine, SlotTracker)
        path = tmp_path / "t.jsonl"
        writer = TraceWriter.open(path)
        writer.attach(machine)
        registry.get_or_create(1)
        registry.fire(1, V.PIN)
        registry.fire(1, V.UNPIN)
        registry.fire(1, V.EVICT)
        registry.fire(1, V.PIN)
        registry.fire(1, V.UNPIN)
        registry.get(1).readers = 1  # type: ignore[union-attr]
        registry.fire(1, V.EVICT)  # refused: a reader
        writer.close()
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        events = [x for x in lines if "meta" not in x]
        assert events[-1]["outcome"] == "refused"
        assert events[-1]["table"] == "slot"
        result = replay_file(path, table=SLOTS)
        assert result.divergences == []
        assert summarize(result.machine) == summarize(machine)
        assert summarize(machine)["refused"] == {"CACHED/evict": 1}


class TestValidation:
    def test_an_unguarded_row_shadows_later_ones(self) -> None:
        with pytest.raises(InvalidTable) as info:
            Table(
                [
                    *ROWS[:2],
                    Row(R.PINNED, V.UNPIN, R.PINNED),
                    ROWS[3],
                    *ROWS[4:],
                ],
                initial=R.FREE,
                terminal=(),
            )
        assert info.value.kinds == {"shadowed-row"}
        (problem,) = info.value.problems
        assert problem.rows == (Row(R.PINNED, V.UNPIN, R.PINNED), ROWS[3])
        assert "shadows `PINNED --unpin--> CACHED`" in problem.detail

    def test_two_unguarded_rows_are_still_duplicates(self) -> None:
        with pytest.raises(InvalidTable) as info:
            Table(
                [*ROWS, Row(R.FREE, V.PIN, R.CACHED)],
                initial=R.FREE,
                terminal=(),
            )
        assert info.value.kinds == {"duplicate-row"}


class TestCyclicTables:
    def test_no_terminal_state_is_valid_when_nothing_dead_ends(self) -> None:
        assert SLOTS.terminal == frozenset()
        assert SLOTS.fingerprint

    def test_a_dead_end_is_reported(self) -> None:
        with pytest.raises(InvalidTable) as info:
            Table(
                [*ROWS[:4], Row(R.CACHED, V.PIN, R.CACHED)],
                initial=R.FREE,
                terminal=(),
            )
        assert info.value.kinds == {"dead-end"}
        assert "CACHED" in str(info.value)

    def test_trackers_of_a_cyclic_table_stay_registered(self) -> None:
        registry = Registry(_machine(), SlotTracker)
        registry.get_or_create(5)
        for event in (V.PIN, V.UNPIN, V.EVICT, V.PIN):
            assert registry.fire(5, event)
        assert 5 in registry


TestSlotTable = table_tests(
    SLOTS, SlotTracker, setups=SETUPS, examples=50, key=1
)


class TestGeneratedTestsReachGuardedRows:
    def test_without_a_set_up_the_failure_names_the_row(self) -> None:
        with pytest.raises(AssertionError) as info:
            check_row(ROWS[2], SLOTS, SlotTracker, key=1)
        assert "guarded row `PINNED --unpin--> PINNED`" in str(info.value)
        assert "setups=" in str(info.value)

    def test_a_set_up_that_picks_another_row_fails_too(self) -> None:
        with pytest.raises(AssertionError, match="another alternative"):
            check_row(
                ROWS[2], SLOTS, SlotTracker, {ROWS[2]: pinned_by(1)}, key=1
            )

    def test_a_row_every_guard_refuses_fails_too(self) -> None:
        with pytest.raises(AssertionError) as info:
            check_row(
                ROWS[2], SLOTS, SlotTracker, {ROWS[2]: pinned_by(0)}, key=1
            )
        assert "`PINNED --unpin--> PINNED`" in str(info.value)
        assert "the event was refused" in str(info.value)

    def test_with_a_set_up_the_row_applies(self) -> None:
        check_row(ROWS[2], SLOTS, SlotTracker, SETUPS, key=1)
        check_row(ROWS[3], SLOTS, SlotTracker, SETUPS, key=1)

    def test_a_factory_of_another_table_fails_once_and_clearly(self) -> None:
        from lifecycle.kv import KVTracker  # noqa: PLC0415

        with pytest.raises(TypeError, match="not in the initial state"):
            table_tests(SLOTS, KVTracker, setups=SETUPS)


class TestRenderersShowGuards:
    def test_dot_mermaid_and_markdown(self) -> None:
        assert "unpin [others_remain] / drop_reader" in render.to_dot(SLOTS)
        assert "unpin [last_reader]" in render.to_mermaid(SLOTS)
        md = render.to_markdown(SLOTS)
        assert (
            md.splitlines()[0] == "| From | Event | Guard | To | Callbacks |"
        )
        assert "| PINNED | `unpin` | `last_reader` | CACHED |" in md


class TestIdentity:
    def test_the_factorys_default_state_must_be_the_initial_one(self) -> None:
        @define_tracker
        class Elsewhere(Tracker[Slot, int]):
            state: Slot = Slot.CACHED

        with pytest.raises(TypeError, match=r"starts in <Slot\.CACHED"):
            Registry(_machine(), Elsewhere)

    def test_a_factory_function_is_checked_at_its_first_tracker(self) -> None:
        def elsewhere(key: int) -> SlotTracker:
            return SlotTracker(key, state=Slot.PINNED)

        registry = Registry(_machine(), elsewhere)
        with pytest.raises(TypeError, match="initial state of table 'slot'"):
            registry.get_or_create(1)

    def test_the_base_tracker_starts_in_the_initial_state(self) -> None:
        registry = Registry(
            LifecycleMachine(SLOTS.without_callbacks()), Tracker
        )
        tracker = registry.get_or_create(("tenant", 3))
        assert tracker.state is Slot.FREE
        assert registry.fire(("tenant", 3), V.PIN)

    def test_any_hashable_key(self) -> None:
        registry = Registry(_machine(), Tracker)
        for key in (1, ("a", 2), frozenset({3})):
            registry.get_or_create(key)
            assert key in registry
        with pytest.raises(TypeError, match="hashable"):
            Tracker(["unhashable"], Slot.FREE)  # type: ignore[misc]

    def test_a_reused_key_continues_the_epochs(self) -> None:
        from lifecycle.kv import TABLE, Event, KVTracker, State  # noqa: PLC0415

        registry = Registry(LifecycleMachine(TABLE), KVTracker)
        first = registry.get_or_create("r")
        registry.fire("r", Event.ALLOC_EXTERNAL)
        old_load = first.epoch
        registry.fire("r", Event.FINISH)
        registry.fire("r", Event.LOAD_DONE)  # DRAINING ends ABORTED
        assert "r" not in registry
        second = registry.get_or_create("r")  # the id is reused
        registry.fire("r", Event.ALLOC_EXTERNAL)
        assert second.epoch > old_load
        # The first incarnation's load completes late: stale, not applied.
        assert not registry.fire("r", Event.LOAD_DONE, epoch=old_load)
        assert second.state is State.LOADING
        assert registry.machine.stale_counts[(State.LOADING, Event.LOAD_DONE)]
        assert registry.fire("r", Event.LOAD_DONE, epoch=second.epoch)

    def test_restarting_epochs_is_explicit(self) -> None:
        registry = Registry(_machine(), SlotTracker, continue_epochs=False)
        registry.get_or_create(1).epoch = 4
        registry.discard(1)
        assert registry.get_or_create(1).epoch == 0

    def test_remembered_keys_are_bounded(self, monkeypatch: Any) -> None:
        monkeypatch.setattr(registry_module, "RETIRED_KEYS", 2)
        registry = Registry(_machine(), SlotTracker)
        for key in range(4):
            registry.get_or_create(key).epoch = 10 + key
            registry.discard(key)
        assert len(registry._retired) == 2
        # Evicted keys start above every epoch they could have had.
        assert registry.get_or_create(0).epoch == 12
        assert registry.get_or_create(3).epoch == 14
        assert registry.get_or_create(99).epoch == 12

    def test_concurrent_creation_gives_one_tracker(self) -> None:
        def slow(key: int) -> SlotTracker:
            time.sleep(0.01)  # every thread is inside the factory at once
            return SlotTracker(key)

        registry = Registry(_machine(), slow)
        seen: list[SlotTracker] = []
        barrier = threading.Barrier(8)

        def create() -> None:
            barrier.wait()
            seen.append(registry.get_or_create(42))

        threads = [threading.Thread(target=create) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(t) for t in seen}) == 1


class TestSurface:
    def test_counters_are_read_only(self) -> None:
        machine = _machine()
        machine.fire(SlotTracker(1), V.EVICT)
        assert machine.illegal_counts[(R.FREE, V.EVICT)] == 1
        assert machine.illegal_counts.total() == 1
        with pytest.raises(TypeError):
            machine.illegal_counts[(R.FREE, V.EVICT)] = 0  # type: ignore[index]
        with pytest.raises(AttributeError):
            machine.illegal_counts = {}  # type: ignore[misc]

    def test_an_observer_that_fires_gets_a_clear_error(self) -> None:
        machine = _machine()
        other = SlotTracker(2)

        def observer(*_: object) -> None:
            machine.fire(other, V.PIN)

        machine.add_observer(observer)
        with pytest.raises(ReentrantFire, match="from inside a transition"):
            machine.fire(SlotTracker(1), V.PIN)
        machine.remove_observer(observer)
        assert machine.fire(other, V.PIN)  # the lock was released

    def test_a_callback_that_fires_gets_it_too(self) -> None:
        holder: list[LifecycleMachine[Slot, SlotEvent]] = []

        def refire(tracker: SlotTracker, _data: object) -> None:
            holder[0].fire(tracker, V.PIN)

        table: Table[Slot, SlotEvent] = Table(
            [
                Row(R.FREE, V.PIN, R.PINNED, after=(refire,)),
                Row(R.PINNED, V.EVICT, R.FREE),
            ],
            initial=R.FREE,
            terminal=(),
            states=(R.FREE, R.PINNED),
        )
        holder.append(LifecycleMachine(table))
        tracker = SlotTracker(1)
        with pytest.raises(ReentrantFire):
            holder[0].fire(tracker, V.PIN)
        assert tracker.state is R.FREE  # restored

    def test_errors_and_log_records_name_the_table(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with pytest.raises(IllegalTransition) as info:
            _machine(strict=True).fire(SlotTracker(1), V.EVICT)
        assert info.value.table == "slot"
        assert str(info.value).startswith("table slot: ")
        with caplog.at_level(logging.WARNING, logger="lifecycle"):
            _machine().fire(SlotTracker(1), V.EVICT)
        (record,) = [r for r in caplog.records if hasattr(r, "lifecycle")]
        assert record.lifecycle["table"] == "slot"
        assert "table=slot" in record.getMessage()
