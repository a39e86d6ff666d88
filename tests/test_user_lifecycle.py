"""A user-defined lifecycle gets everything the KV lifecycle has.

Public API only (no private module, no monkeypatching, no casts): the
table in `tests/user_lifecycle.py` is driven through the generic machine,
registry, testing helpers, renderer, traces and CLI.
"""

from __future__ import annotations

import enum
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
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
    define_tracker,
    render,
)
from lifecycle.testing import fire_stock, table_tests, tracker_in
from lifecycle.trace import TraceWriter, replay_file, summarize
from lifecycle.tracker import check_count, compiled_factory
from tests.user_lifecycle import (
    MAX_ATTEMPTS,
    TABLE,
    JobEvent,
    JobState,
    JobTracker,
)

ROOT = Path(__file__).resolve().parent.parent
S, E = JobState, JobEvent

# The whole generated suite for the user's table, in one line.
TestGeneratedConsumerTable = table_tests(TABLE, JobTracker)


def _machine(**kw: bool) -> LifecycleMachine[JobState, JobEvent, JobTracker]:
    return LifecycleMachine(TABLE, **kw)


class TestUserTable:
    def test_a_request_runs_and_is_dropped_at_the_terminal_state(
        self,
    ) -> None:
        machine = _machine(strict=True)
        registry = Registry(machine, JobTracker)
        tracker = registry.get_or_create("r")
        tracker.blocks.extend([1, 2])
        tracker.receiving = 16
        assert registry.fire("r", E.ALLOC)
        assert registry.fire("r", E.RECEIVED)
        assert (tracker.state, tracker.receiving, tracker.runs) == (
            S.RUNNING,
            0,
            1,
        )
        assert registry.fire("r", E.FINISH)
        assert tracker.blocks == []
        assert "r" not in registry

    def test_terminal_comes_from_the_table_not_the_enum(self) -> None:
        """ABORTED is not terminal here: the tracker stays and retries."""
        registry = Registry(_machine(strict=True), JobTracker)
        tracker = registry.get_or_create("r")
        assert registry.fire("r", E.ABORT)
        assert tracker.state is S.ABORTED
        assert "r" in registry
        assert registry.fire("r", E.RETRY)
        assert (tracker.state, tracker.attempts) == (S.WAITING, 1)

    def test_a_guard_refuses_without_an_illegal_count(self) -> None:
        machine = _machine()
        tracker = JobTracker("r", state=S.ABORTED, attempts=MAX_ATTEMPTS)
        assert machine.fire(tracker, E.RETRY) is False
        assert tracker.state is S.ABORTED
        assert machine.guard_counts[(S.ABORTED, E.RETRY)] == 1
        assert machine.illegal_total == 0
        strict = _machine(strict=True)
        with pytest.raises(GuardRefused) as info:
            strict.fire(tracker, E.RETRY)
        assert (info.value.state, info.value.event) == (S.ABORTED, E.RETRY)
        assert info.value.table == "consumer"
        assert tracker.state is S.ABORTED
        assert strict.illegal_total == 0

    def test_enter_hooks_run_on_every_row_into_the_state(self) -> None:
        machine = _machine()
        tracker = tracker_in(S.RUNNING, machine, JobTracker)
        assert tracker.runs == 1
        assert machine.fire(tracker, E.ABORT)
        assert machine.fire(tracker, E.RETRY)
        assert machine.fire(tracker, E.ALLOC)
        assert machine.fire(tracker, E.RECEIVED)
        assert tracker.runs == 2

    def test_illegal_ordering_policy_and_strict_mode(self, caplog) -> None:
        machine = _machine()
        tracker = JobTracker("r")
        with caplog.at_level(logging.WARNING, logger="lifecycle"):
            assert machine.fire(tracker, E.RECEIVED) is False
        assert machine.illegal_counts == {(S.WAITING, E.RECEIVED): 1}
        (record,) = [r for r in caplog.records if hasattr(r, "lifecycle")]
        assert record.lifecycle["event"] == "received"
        assert record.lifecycle["state"] == "WAITING"
        with pytest.raises(IllegalTransition) as info:
            _machine(strict=True).fire(tracker, E.RECEIVED)
        assert (info.value.state, info.value.event) == (S.WAITING, E.RECEIVED)

    def test_a_stale_completion_is_counted_not_applied(self) -> None:
        machine = _machine()
        tracker = tracker_in(S.RECEIVING, machine, JobTracker)
        tracker.epoch = 2
        assert machine.fire(tracker, E.RECEIVED, epoch=1) is False
        assert tracker.state is S.RECEIVING
        assert machine.stale_counts == {(S.RECEIVING, E.RECEIVED): 1}

    def test_two_tables_in_one_process_share_no_callbacks(self) -> None:
        """Callbacks live in rows: no global registry, no name clashes."""
        calls: list[str] = []

        @define_tracker
        class Other(Tracker[JobState]):
            state: JobState = JobState.WAITING

        # The user table has a `release` too.
        def release(tracker: Other, _data: object = None) -> None:
            calls.append(tracker.req_id)

        other = Table(
            [
                Row(S.WAITING, E.FINISH, S.DONE, after=(release,)),
            ],
            initial=S.WAITING,
            terminal={S.DONE},
            states=(S.WAITING, S.DONE),
        )
        assert LifecycleMachine(other).fire(Other("o"), E.FINISH)
        tracker = tracker_in(S.RUNNING, _machine(), JobTracker)
        tracker.blocks.append(7)
        assert _machine().fire(tracker, E.FINISH)
        assert (calls, tracker.blocks) == (["o"], [])


class TestCallbackFailure:
    """A raising callback: state and epoch restored, counted, logged."""

    @staticmethod
    def _table(after: tuple[object, ...]) -> Table[JobState, JobEvent]:
        def bump(tracker: Tracker[JobState], _data: object = None) -> None:
            tracker.epoch += 1

        def boom(tracker: Tracker[JobState], _data: object = None) -> None:
            msg = f"boom for {tracker.req_id}"
            raise RuntimeError(msg)

        named = {"bump": bump, "boom": boom}
        return Table(
            [
                Row(
                    S.WAITING,
                    E.ALLOC,
                    S.RUNNING,
                    after=tuple(named[str(a)] for a in after),
                ),
                Row(S.WAITING, E.FINISH, S.DONE),
                Row(S.RUNNING, E.FINISH, S.DONE),
            ],
            initial=S.WAITING,
            terminal={S.DONE},
            states=(S.WAITING, S.RUNNING, S.DONE),
            total_events=(E.FINISH,),
        )

    def test_the_event_is_refused_and_nothing_is_visible(self, caplog) -> None:
        machine = LifecycleMachine(self._table(("bump", "boom")))
        seen: list[object] = []
        machine.add_observer(lambda *a: seen.append(a))
        registry = Registry(machine, JobTracker)
        tracker = registry.get_or_create("r")
        with caplog.at_level(logging.ERROR, logger="lifecycle"):
            assert registry.fire("r", E.ALLOC) is False
        assert (tracker.state, tracker.epoch) == (S.WAITING, 0)
        assert machine.callback_errors == {(S.WAITING, E.ALLOC): 1}
        assert machine.illegal_total == 0
        assert sum(machine.row_counts()) == 0
        assert seen == []
        (record,) = [r for r in caplog.records if hasattr(r, "lifecycle")]
        assert record.levelno == logging.ERROR
        assert "boom for r" in record.lifecycle["error"]
        assert registry.fire("r", E.FINISH)  # still usable afterwards
        assert "r" not in registry

    def test_strict_mode_reraises_after_restoring(self) -> None:
        machine = LifecycleMachine(self._table(("bump", "boom")), strict=True)
        tracker = JobTracker("r")
        with pytest.raises(RuntimeError, match="boom for r"):
            machine.fire(tracker, E.ALLOC)
        assert (tracker.state, tracker.epoch) == (S.WAITING, 0)
        assert machine.callback_errors[(S.WAITING, E.ALLOC)] == 1

    def test_callbacks_that_succeed_are_applied(self) -> None:
        machine = LifecycleMachine(self._table(("bump",)), strict=True)
        tracker = JobTracker("r")
        assert machine.fire(tracker, E.ALLOC)
        assert (tracker.state, tracker.epoch) == (S.RUNNING, 1)


class TestTrackers:
    def test_a_plain_attrs_subclass_is_refused(self) -> None:
        @attrs.define
        class Slow(Tracker[JobState]):
            state: JobState = JobState.WAITING

        with pytest.raises(TypeError, match="on_setattr") as info:
            Registry(_machine(), Slow)
        assert "define_tracker" in str(info.value)

    def test_a_value_equality_subclass_is_refused(self) -> None:
        @attrs.define(slots=True, on_setattr=attrs.setters.NO_OP)
        class ByValue(Tracker[JobState]):
            state: JobState = JobState.WAITING

        with pytest.raises(TypeError, match="compares by value"):
            Registry(_machine(), ByValue)

    def test_a_factory_of_slow_trackers_is_refused_at_first_use(
        self,
    ) -> None:
        @attrs.define(slots=False, eq=False)
        class Slow(Tracker[JobState]):
            state: JobState = JobState.WAITING

        def factory(req_id: str) -> Slow:
            return Slow(req_id)

        registry = Registry(_machine(), factory)
        with pytest.raises(TypeError, match="__slots__"):
            registry.get_or_create("r")

    def test_define_tracker_keeps_slots_identity_and_plain_setattr(
        self,
    ) -> None:
        a, b = JobTracker("r"), JobTracker("r")
        assert a != b
        assert not hasattr(a, "__dict__")
        assert type(a).__setattr__ is object.__setattr__
        with pytest.raises(TypeError, match="not a subclass"):
            define_tracker(int)

    def test_a_registry_builds_trackers_like_the_class_does(self) -> None:
        """The registry's compiled constructor: every field as the attrs
        ``__init__`` sets it, fresh containers, the key validated at
        every tracker."""

        @define_tracker
        class Rich(Tracker[JobState]):
            state: JobState = JobState.WAITING
            tries: int = attrs.field(default=2, validator=check_count)
            seen: list[int] = attrs.field(factory=list)
            tags: set[str] = attrs.field(factory=set)
            note: str = "n"

        registry = Registry(_machine(), Rich)
        assert registry._factory is not Rich  # the compiled one
        a, b = registry.get_or_create("a"), registry.get_or_create("b")
        assert type(a) is Rich
        assert attrs.asdict(a, recurse=False) == attrs.asdict(
            Rich("a"), recurse=False
        )
        assert a.seen is not b.seen
        assert a.tags is not b.tags
        with pytest.raises(ValueError, match=r"1\.\.1024 characters"):
            registry.get_or_create("")
        with pytest.raises(TypeError, match="hashable"):
            registry.get_or_create(["unhashable"])
        assert len(registry) == 2

    def test_trackers_with_their_own_construction_use_the_class(
        self,
    ) -> None:
        """A class the compiled constructor cannot mimic is built by the
        class itself: an init hook, a factory of its own, a default its
        validator refuses (the class raises, as it always did)."""
        built: list[str] = []

        @define_tracker
        class Hooked(Tracker[JobState]):
            state: JobState = JobState.WAITING

            def __attrs_post_init__(self) -> None:
                built.append(self.req_id)

        @define_tracker
        class OwnFactory(Tracker[JobState]):
            state: JobState = JobState.WAITING
            ids: list[int] = attrs.field(factory=lambda: [7])

        @define_tracker
        class BadDefault(Tracker[JobState]):
            state: JobState = JobState.WAITING
            tries: int = attrs.field(default=-1, validator=check_count)

        for cls in (Hooked, OwnFactory, BadDefault):
            assert compiled_factory(cls) is None, cls
        assert Registry(_machine(), Hooked)._factory is Hooked
        Registry(_machine(), Hooked).get_or_create("h")
        assert built == ["h"]
        assert Registry(_machine(), OwnFactory).get_or_create("o").ids == [7]
        with pytest.raises(ValueError, match="non-negative"):
            Registry(_machine(), BadDefault).get_or_create("b")

    def test_the_base_tracker_is_minimal(self) -> None:
        assert [f.name for f in attrs.fields(Tracker)] == [
            "req_id",
            "state",
            "epoch",
        ]


class TestComposition:
    def test_the_machine_exposes_no_transitions_mutation_api(self) -> None:
        machine = _machine()
        for name in ("add_transition", "add_state", "add_model", "events"):
            assert not hasattr(machine, name), name

    def test_stock_trigger_agrees_with_fire_including_hooks(self) -> None:
        machine = _machine()
        fast, stock = JobTracker("a"), JobTracker("b")
        path = [E.ALLOC, E.RECEIVED, E.ABORT, E.RETRY, E.ALLOC, E.RECEIVED]
        for event in [*path, E.RETRY, E.FINISH]:
            assert machine.fire(fast, event) == fire_stock(
                machine, stock, event
            )
            assert attrs.asdict(fast, filter=_not_id) == attrs.asdict(
                stock, filter=_not_id
            )
        assert fast.runs == 2


def _not_id(attribute: attrs.Attribute[object], _value: object) -> bool:
    return attribute.name != "req_id"


class TestValidation:
    def test_events_of_another_enum_are_rejected(self) -> None:
        class Other(enum.Enum):
            FINISH = "finish"

        with pytest.raises(InvalidTable) as info:
            Table(
                [
                    Row(S.WAITING, E.FINISH, S.DONE),
                    Row(S.WAITING, Other.FINISH, S.DONE),
                ],
                initial=S.WAITING,
                terminal={S.DONE},
                states=(S.WAITING, S.DONE),
            )
        assert info.value.kinds == {"unknown-event"}

    def test_an_unknown_event_at_runtime_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match="not an event of table"):
            _machine().fire(JobTracker("r"), S.DONE)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lifecycle", *args],
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )


class TestToolsTakeAnyTable:
    SPEC = "tests.user_lifecycle:TABLE"

    def test_render_writes_into_out_and_checks(self, tmp_path) -> None:
        done = _cli("render", "--table", self.SPEC, "--out", "d", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        names = {p.name for p in (tmp_path / "d").iterdir()}
        want = {"consumer.dot", "consumer.mmd"}
        if shutil.which("dot"):
            want.add("consumer.svg")
        assert names == want
        ok = _cli(
            "render",
            "--check",
            "--table",
            self.SPEC,
            "--out",
            "d",
            cwd=tmp_path,
        )
        assert ok.returncode == 0, ok.stderr
        kv = _cli("render", "--check", "--out", "d", cwd=tmp_path)
        assert kv.returncode == 1  # the KV table's files are not there

    def test_render_defaults_to_the_current_directory(self, tmp_path) -> None:
        done = _cli("render", "--table", self.SPEC, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "consumer.dot").exists()
        assert not (ROOT / "lifecycle" / "consumer.dot").exists()

    def test_table_prints_this_tables_rows(self, tmp_path) -> None:
        done = _cli("table", "--table", self.SPEC, cwd=tmp_path)
        assert done.returncode == 0
        assert done.stdout == render.to_markdown(TABLE)
        row = "| ABORTED | `retry` | `can_retry` | WAITING | `count_attempt` |"
        assert row in done.stdout

    def test_an_unknown_table_is_a_usage_error(self, tmp_path) -> None:
        done = _cli("table", "--table", "tests.user_lifecycle:NOPE", cwd=ROOT)
        assert done.returncode == 2
        assert "not a lifecycle.Table" in done.stderr

    def test_traces_replay_against_their_table_only(self, tmp_path) -> None:
        path = tmp_path / "t.jsonl"
        machine = _machine()
        registry = Registry(machine, JobTracker)
        writer = TraceWriter.open(path)
        writer.attach(machine)
        registry.get_or_create("r")
        for event in (E.ALLOC, E.RECEIVED, E.RETRY, E.ABORT, E.RETRY):
            registry.fire("r", event)
        registry.fire("r", E.FINISH)
        writer.close()
        start = json.loads(path.read_text().splitlines()[0])
        assert start["fingerprint"] == TABLE.fingerprint
        result = replay_file(path, table=TABLE)
        assert result.divergences == []
        assert summarize(result.machine) == summarize(machine)
        ok = _cli("replay", "--table", self.SPEC, str(path), cwd=ROOT)
        assert ok.returncode == 0, ok.stderr
        assert "WAITING -alloc-> RECEIVING -received-> RUNNING" in ok.stdout
        other = _cli("replay", str(path), cwd=ROOT)  # the KV table
        assert other.returncode == 1
        assert "fingerprint" in other.stderr

    def test_malformed_trace_lines_exit_non_zero(self, tmp_path) -> None:
        path = tmp_path / "t.jsonl"
        path.write_text('{"meta": "start", "time": 1}\n{"req_id": "x"\n')
        done = _cli("replay", "--table", self.SPEC, str(path), cwd=ROOT)
        assert done.returncode == 1
        assert "malformed" in done.stderr


@pytest.mark.skipif(shutil.which("dot") is None, reason="no graphviz `dot`")
def test_states_named_like_dot_keywords_render() -> None:
    class Kw(enum.Enum):
        NODE = 1
        EDGE = 2
        GRAPH = 3
        end = 4  # a Mermaid keyword

    class Ev(enum.Enum):
        GO = "go"

    table = Table(
        [
            Row(Kw.NODE, Ev.GO, Kw.EDGE),
            Row(Kw.EDGE, Ev.GO, Kw.GRAPH),
            Row(Kw.GRAPH, Ev.GO, Kw.end),
        ],
        initial=Kw.NODE,
        terminal={Kw.end},
    )
    svg = render.to_svg(render.to_dot(table))
    assert svg is not None
    assert render.svg_problems(svg, table) == []
    mmd = render.to_mermaid(table)
    assert 'state "end" as s3' in mmd
    assert "GRAPH --> s3 : go" in mmd
