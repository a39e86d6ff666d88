"""The machine's behaviour: stories, policy, concurrency and memory."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref

import attrs
import pytest
from hypothesis import given, settings

from lifecycle import (
    IllegalTransition,
    LifecycleMachine,
    Registry,
    UnknownRequest,
)
from lifecycle.kv import TABLE, Event, State
from lifecycle.kv import KVTracker as Tracker
from lifecycle.testing import event_sequences, fire_stock
from lifecycle.testing import tracker_in as _tracker_in

E = Event


def tracker_in(state, machine):
    return _tracker_in(state, machine, Tracker)


def _drive(machine: LifecycleMachine, tracker: Tracker, *events: Event):
    return [machine.fire(tracker, e) for e in events]


class TestStories:
    def test_preempt_then_finish_is_legal(self) -> None:
        """vLLM #43281: finish after preemption never asserts."""
        machine = LifecycleMachine(TABLE, strict=True)
        t = Tracker("r")
        ok = _drive(
            machine, t, E.LOOKUP, E.ALLOC_LOCAL, E.PREEMPT, E.RESET, E.FINISH
        )
        assert all(ok)
        assert (t.state, t.epoch) == (State.FINISHED, 1)

    def test_abort_during_load_drains_until_the_load_settles(self) -> None:
        machine = LifecycleMachine(TABLE, strict=True)
        t = Tracker("r")
        _drive(machine, t, E.LOOKUP, E.ALLOC_EXTERNAL, E.ABORT)
        assert t.state is State.DRAINING
        assert machine.fire(t, E.ABORT)  # a repeated abort is harmless
        assert machine.fire(t, E.LOAD_FAILED)
        assert t.state is State.ABORTED

    def test_resume_after_reset(self) -> None:
        machine = LifecycleMachine(TABLE, strict=True)
        t = Tracker("r")
        _drive(machine, t, E.ALLOC_LOCAL, E.PREEMPT, E.RESET)
        assert _drive(machine, t, E.LOOKUP, E.LOOKUP, E.ALLOC_LOCAL)
        assert machine.fire(t, E.RESUME)
        assert t.state is State.SAVING

    def test_stale_completion_never_touches_the_new_epoch(self) -> None:
        """vLLM #51637: a job of epoch 0 completes after preemption."""
        machine = LifecycleMachine(TABLE, strict=True)
        t = Tracker("r")
        _drive(machine, t, E.ALLOC_LOCAL, E.SAVE_ISSUED, E.PREEMPT)
        _drive(machine, t, E.RESET, E.ALLOC_LOCAL, E.RESUME)
        assert not machine.fire(t, E.SAVE_DONE, epoch=0)
        assert machine.stale_counts[(State.SAVING, E.SAVE_DONE)] == 1
        assert machine.illegal_total == 0
        assert machine.fire(t, E.SAVE_DONE, epoch=1)


class TestPolicy:
    def test_illegal_is_a_counted_noop(self) -> None:
        machine = LifecycleMachine(TABLE)
        t = Tracker("r", num_tokens=5)
        before = attrs.asdict(t)
        assert machine.fire(t, E.LOAD_DONE) is False
        assert attrs.asdict(t) == before
        assert machine.illegal_counts == {(State.NEW, E.LOAD_DONE): 1}

    def test_strict_raises_with_data(self) -> None:
        machine = LifecycleMachine(TABLE, strict=True)
        t = Tracker("req-9")
        with pytest.raises(IllegalTransition) as info:
            machine.fire(t, E.SAVE_DONE)
        exc = info.value
        assert (exc.state, exc.event, exc.req_id, exc.epoch) == (
            State.NEW,
            E.SAVE_DONE,
            "req-9",
            0,
        )
        assert "`save_done` is not allowed in NEW (request req-9)" in str(exc)
        assert t.state is State.NEW

    def test_log_is_rate_limited_per_pair(self, caplog) -> None:
        machine = LifecycleMachine(TABLE, log_interval=3600)
        caplog.set_level(logging.WARNING, logger="lifecycle")
        for i in range(500):
            machine.fire(Tracker(f"r{i}"), E.LOAD_DONE)
        machine.fire(Tracker("x"), E.SAVE_DONE)
        records = [r for r in caplog.records if hasattr(r, "lifecycle")]
        assert [r.lifecycle["event"] for r in records] == [
            "load_done",
            "save_done",
        ]
        assert records[0].lifecycle["req_id"] == "r0"
        assert machine.illegal_counts[(State.NEW, E.LOAD_DONE)] == 500

    def test_suppressed_count_reported_on_next_record(self, caplog) -> None:
        machine = LifecycleMachine(TABLE, log_interval=0.0)
        machine._illegal_log.interval = 3600
        caplog.set_level(logging.WARNING, logger="lifecycle")
        for i in range(4):
            machine.fire(Tracker(f"r{i}"), E.RESUME)
        machine._illegal_log.interval = 0.0
        machine.fire(Tracker("last"), E.RESUME)
        fields = [r.lifecycle for r in caplog.records]
        assert [f["suppressed"] for f in fields] == [0, 3]

    def test_registry_unknown_id_policy(self) -> None:
        machine = LifecycleMachine(TABLE)
        reg = Registry(machine, Tracker)
        assert reg.fire("ghost", E.FINISH) is False
        assert machine.illegal_counts[(None, E.FINISH)] == 1
        assert reg.fire_if_tracked("ghost", E.SAVE_DONE) is False
        assert machine.illegal_counts[(None, E.SAVE_DONE)] == 0
        with pytest.warns(DeprecationWarning, match="fire_if_tracked"):
            assert reg.fire("ghost", E.SAVE_DONE, known=False) is False
        assert machine.illegal_counts[(None, E.SAVE_DONE)] == 0
        strict = Registry(LifecycleMachine(TABLE, strict=True), Tracker)
        with pytest.raises(UnknownRequest) as info:
            strict.fire("ghost", E.ABORT)
        assert (info.value.req_id, info.value.state) == ("ghost", None)

    def test_registry_drops_terminal_trackers(self) -> None:
        reg = Registry(LifecycleMachine(TABLE), Tracker)
        reg.get_or_create("a")
        reg.get_or_create("b")
        assert reg.fire("a", E.ABORT)
        assert "a" not in reg
        assert len(reg) == 1
        assert [t.req_id for t in reg] == ["b"]

    def test_transition_counts_and_observers(self) -> None:
        machine = LifecycleMachine(TABLE)
        seen = []
        machine.add_observer(
            lambda t, s, e, d: seen.append((t.req_id, s, e, d))
        )
        t = Tracker("r")
        _drive(machine, t, E.LOOKUP, E.LOOKUP, E.ALLOC_LOCAL)
        counts = {
            (r.source, r.event): n
            for r, n in machine.transition_counts().items()
            if n
        }
        assert counts == {
            (State.NEW, E.LOOKUP): 2,
            (State.NEW, E.ALLOC_LOCAL): 1,
        }
        assert seen[-1] == ("r", State.NEW, E.ALLOC_LOCAL, State.SAVING)
        assert machine.can_fire(t, E.PREEMPT)
        assert not machine.can_fire(t, E.LOAD_DONE)
        machine.remove_observer(machine._observers[0])
        machine.fire(t, E.SAVE_ISSUED)
        assert len(seen) == 3


class TestTracker:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"req_id": ""}, "req_id must have"),
            ({"req_id": 5}, "req_id must be a str"),
            ({"req_id": "r", "epoch": -1}, "epoch must be a non-negative"),
            ({"req_id": "r", "num_tokens": 1.5}, "num_tokens must be"),
            ({"req_id": "r", "block_ids": [1, -2]}, "block_ids must be"),
            ({"req_id": "r", "state": "new"}, "'state' must be"),
        ],
    )
    def test_fields_are_validated(self, kwargs, message) -> None:
        with pytest.raises((TypeError, ValueError), match=message):
            Tracker(**kwargs)

    def test_identity_equality_and_slots(self) -> None:
        a, b = Tracker("r"), Tracker("r")
        assert a != b
        assert a == a  # noqa: PLR0124
        assert not hasattr(a, "__dict__")

    def test_trackers_hold_no_bound_methods(self) -> None:
        machine = LifecycleMachine(TABLE)
        t = tracker_in(State.RESET, machine)
        values = [getattr(t, f.name) for f in attrs.fields(Tracker)]
        assert not any(callable(v) for v in values)

    def test_dropped_trackers_are_freed_without_gc(self) -> None:
        machine = LifecycleMachine(TABLE)
        gc.disable()
        try:
            refs = []
            for i in range(100_000):
                t = Tracker(f"r{i}")
                machine.fire(t, E.LOOKUP)
                machine.fire(t, E.ALLOC_LOCAL)
                machine.fire(t, E.PREEMPT)
                refs.append(weakref.ref(t))
            del t
            alive = sum(r() is not None for r in refs)
        finally:
            gc.enable()
        assert alive == 0


class TestDifferential:
    @pytest.mark.parametrize("thread_safe", [True, False])
    @settings(max_examples=300, deadline=None)
    @given(events=event_sequences(TABLE))
    def test_fast_path_matches_stock_transitions(
        self, thread_safe, events
    ) -> None:
        """The compiled dispatch == transitions' own trigger, callbacks too."""
        machine = LifecycleMachine(TABLE, thread_safe=thread_safe)
        fast, stock = Tracker("r"), Tracker("r")
        for seed in (fast, stock):
            seed.block_ids.extend([1, 2])
        for event in events:
            a = machine.fire(fast, event)
            b = fire_stock(machine, stock, event)
            assert a == b
            assert attrs.asdict(fast) == attrs.asdict(stock)


class TestThreads:
    def test_concurrent_firing_never_loses_or_tears(self) -> None:
        """Exactly one of many racing preempts applies, per tracker."""
        machine = LifecycleMachine(TABLE)
        trackers = [tracker_in(State.SAVING, machine) for _ in range(400)]
        wins = [0] * 8
        barrier = threading.Barrier(8)

        def worker(k: int) -> None:
            barrier.wait()
            for t in trackers:
                wins[k] += machine.fire(t, E.PREEMPT)
                machine.fire(t, E.SAVE_DONE)

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [
                threading.Thread(target=worker, args=(k,)) for k in range(8)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            sys.setswitchinterval(old)
        assert sum(wins) == len(trackers)
        assert {(t.state, t.epoch) for t in trackers} == {(State.PREEMPTED, 1)}
        counts = machine.transition_counts()
        preempts = sum(n for r, n in counts.items() if r.event is E.PREEMPT)
        assert preempts == len(trackers)
        illegal = machine.illegal_counts
        assert illegal[(State.PREEMPTED, E.PREEMPT)] == 7 * len(trackers)
