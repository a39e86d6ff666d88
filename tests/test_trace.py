"""Lifecycle traces: the JSONL writer, its bound, and replay (no engine)."""

from __future__ import annotations

import io
import json
import logging
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import StoreConfig, TraceConfig
from connector.errors import ConfigError
from lifecycle import (
    IllegalTransition,
    LifecycleMachine,
    Registry,
)
from lifecycle.__main__ import main
from lifecycle.kv import TABLE, Event, State
from lifecycle.kv import KVTracker as Tracker
from lifecycle.trace import (
    DEFAULT_MAX_EVENTS,
    ILLEGAL,
    STALE,
    TraceError,
    TraceWriter,
    replay,
    replay_file,
    summarize,
)

E = Event


def lines_of(path):
    return path.read_text().splitlines()


def events_of(path):
    return [json.loads(x) for x in lines_of(path) if '"meta"' not in x]


def drive(registry, req_id, events):
    for event in events:
        registry.fire(req_id, event)


def open_traced(path, *, strict=False, **writer_options):
    """A machine, its registry and a writer tracing it to `path`."""
    machine = LifecycleMachine(TABLE, strict=strict)
    registry = Registry(machine, Tracker)
    writer = TraceWriter.open(path, **writer_options)
    writer.attach(machine)
    return machine, registry, writer


@pytest.fixture
def traced(tmp_path):
    """`open_traced` to trace.jsonl, and the path; closed at teardown."""
    path = tmp_path / "trace.jsonl"
    machine, registry, writer = open_traced(path)
    yield machine, registry, writer, path
    writer.close()


def preempted_then_finished_twice(registry):
    """vLLM #43281's ordering, a stale save and an illegal load_done."""
    registry.get_or_create("r1")
    drive(registry, "r1", [E.LOOKUP, E.ALLOC_LOCAL, E.SAVE_ISSUED])
    drive(registry, "r1", [E.PREEMPT, E.RESET])
    registry.fire("r1", E.SAVE_DONE, epoch=0)  # stale: the old epoch
    registry.fire("r1", E.LOAD_DONE)  # illegal in RESET
    drive(registry, "r1", [E.FINISH, E.FINISH])  # the second: unknown id


def test_every_event_is_one_line_with_the_documented_fields(traced):
    machine, registry, writer, path = traced
    preempted_then_finished_twice(registry)
    writer.close()
    records = events_of(path)
    assert [(r["state"], r["event"], r["outcome"]) for r in records] == [
        ("NEW", "lookup", "NEW"),
        ("NEW", "alloc_local", "SAVING"),
        ("SAVING", "save_issued", "SAVING"),
        ("SAVING", "preempt", "PREEMPTED"),
        ("PREEMPTED", "reset", "RESET"),
        ("RESET", "save_done", STALE),
        ("RESET", "load_done", ILLEGAL),
        ("RESET", "finish", "FINISHED"),
        (None, "finish", ILLEGAL),
    ]
    for r in records:
        assert set(r) >= {"time", "req_id", "epoch", "state", "event"}
        assert r["req_id"] == "r1"
        assert r["time"] > 1e9
    assert [r["epoch"] for r in records] == [0, 0, 0, 1, 1, 1, 1, 1, None]
    assert records[5]["job_epoch"] == 0
    assert json.loads(lines_of(path)[0])["meta"] == "start"
    assert writer.written == 9
    assert writer.dropped == 0
    assert sum(machine.illegal_counts.values()) == 2


def test_replay_prints_path_first_illegal_and_the_live_counts(traced):
    machine, registry, writer, path = traced
    preempted_then_finished_twice(registry)
    writer.close()
    result = replay_file(path)
    assert summarize(result.machine) == summarize(machine)
    assert result.machine.transition_counts() == machine.transition_counts()
    assert result.machine.illegal_counts == machine.illegal_counts
    assert result.machine.stale_counts == machine.stale_counts
    assert result.divergences == []
    (request,) = result.requests.values()
    assert request.path() == (
        "NEW -lookup-> NEW -alloc_local-> SAVING -save_issued-> SAVING "
        "-preempt-> PREEMPTED -reset-> RESET [stale save_done] "
        "[illegal load_done] -finish-> FINISHED [illegal finish]"
    )
    first = request.first_illegal
    assert first is not None
    assert (first.state, first.event, first.epoch) == (
        State.RESET,
        E.LOAD_DONE,
        1,
    )
    assert first.line == 8  # the start line, then 7 events
    text = result.render()
    assert "first illegal ordering: line 8: `load_done` in RESET" in text
    assert "RESET/load_done  1" in text


def test_a_planted_illegal_line_is_the_first_illegal_ordering(traced):
    machine, registry, writer, path = traced
    for r in ("a", "b"):
        registry.get_or_create(r)
        drive(registry, r, [E.LOOKUP, E.ALLOC_LOCAL, E.SAVE_ISSUED])
        registry.fire(r, E.SAVE_DONE, epoch=0)
        drive(registry, r, [E.FINISH])
    writer.close()
    lines = lines_of(path)
    planted = {
        "time": 1.0,
        "req_id": "b",
        "epoch": 0,
        "state": "SAVING",
        "event": "load_done",
        "outcome": ILLEGAL,
    }
    at = next(i for i, x in enumerate(lines) if '"b"' in x) + 2
    lines.insert(at, json.dumps(planted))
    result = replay(lines)
    assert result.requests["a"].first_illegal is None
    first = result.requests["b"].first_illegal
    assert first is not None
    assert first.line == at + 1
    assert (first.state, first.event) == (State.SAVING, E.LOAD_DONE)
    assert result.machine.illegal_counts == {(State.SAVING, E.LOAD_DONE): 1}
    assert result.divergences == []
    counts = summarize(result.machine)["transitions"]
    assert counts == summarize(machine)["transitions"]


def test_the_bound_is_respected_and_dropped_events_are_counted(
    tmp_path, caplog
):
    path = tmp_path / "t.jsonl"
    _, registry, writer = open_traced(path, max_events=5)
    registry.get_or_create("r")
    with caplog.at_level(logging.WARNING, logger="lifecycle.trace"):
        drive(registry, "r", [E.LOOKUP] * 12)
    writer.close()
    assert len(events_of(path)) == 5
    assert writer.written == 5
    assert writer.dropped == 7
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1
    assert json.loads(lines_of(path)[-1]) == {"meta": "dropped", "dropped": 7}
    result = replay_file(path)
    assert result.dropped == 7
    assert result.events == 5


def test_closing_detaches_and_is_idempotent(traced):
    machine, registry, writer, path = traced
    registry.get_or_create("r")
    registry.fire("r", E.LOOKUP)
    writer.close()
    writer.close()
    registry.fire("r", E.LOOKUP)
    registry.fire("nobody", E.FINISH)
    assert writer.closed
    assert len(events_of(path)) == 1
    assert machine._observers == ()
    assert machine._reject_observers == ()


def test_sessions_append_and_replay_separately(tmp_path):
    path = tmp_path / "t.jsonl"
    machines = []
    for _ in range(2):
        machine, registry, writer = open_traced(path)
        machines.append(machine)
        registry.get_or_create("r")
        drive(registry, "r", [E.LOOKUP, E.ALLOC_LOCAL])  # left running
        writer.close()
    result = replay_file(path)
    assert result.sessions == 2
    assert result.divergences == []
    assert list(result.requests) == ["r", "2:r"]
    total = machines[0].transition_counts()
    for row, n in machines[1].transition_counts().items():
        total[row] += n
    assert result.machine.transition_counts() == total


def test_a_trace_starting_mid_request_resynchronises(traced):
    _, registry, writer, path = traced
    registry.get_or_create("r")
    drive(registry, "r", [E.LOOKUP, E.ALLOC_LOCAL, E.PREEMPT, E.RESET])
    drive(registry, "r", [E.RESUME, E.FINISH])
    writer.close()
    lines = lines_of(path)
    result = replay([lines[0], *lines[4:]])  # drop the first 3 events
    assert len(result.divergences) == 1
    assert result.divergences[0].record.state is State.PREEMPTED
    assert result.requests["r"].path().endswith("-finish-> FINISHED")
    assert result.machine.illegal_total == 0


def test_malformed_lines_are_listed_and_skipped(traced):
    machine, registry, writer, path = traced
    registry.get_or_create("r")
    drive(registry, "r", [E.LOOKUP, E.FINISH])
    writer.close()
    lines = [*lines_of(path), '{"time": 1, "req_id": "r", "sta', "[1]"]
    result = replay(lines)
    assert result.malformed == [4, 5]
    assert summarize(result.machine) == summarize(machine)


def test_an_unreadable_trace_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError) as err:
        replay_file(tmp_path / "missing.jsonl")
    assert err.value.path.endswith("missing.jsonl")
    with pytest.raises(TraceError):
        TraceWriter.open(tmp_path / "no" / "such" / "dir.jsonl")
    with pytest.raises(ValueError, match="positive"):
        TraceWriter.open(tmp_path / "t.jsonl", max_events=0)


def test_concurrent_events_all_land_in_order(traced):
    machine, registry, writer, path = traced
    ids = [f"r{i}" for i in range(8)]
    for r in ids:
        registry.get_or_create(r)
    events = [E.LOOKUP, E.ALLOC_LOCAL, *[E.SAVE_ISSUED] * 50, E.FINISH]

    def worker(req_id):
        drive(registry, req_id, events)

    threads = [threading.Thread(target=worker, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    result = replay_file(path)
    assert result.events == len(ids) * len(events)
    assert result.divergences == []
    assert summarize(result.machine) == summarize(machine)


EVENTS = st.sampled_from(list(Event))
STEPS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), EVENTS, st.booleans()),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(steps=STEPS)
def test_replay_reproduces_any_event_sequence(tmp_path_factory, steps):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    machine, registry, writer = open_traced(path)
    for req_id, event, with_epoch in steps:
        tracker = registry.get_or_create(req_id)
        epoch = max(tracker.epoch - 1, 0) if with_epoch else None
        registry.fire(req_id, event, epoch=epoch)
    writer.close()
    result = replay_file(path)
    assert result.divergences == []
    assert result.machine.transition_counts() == machine.transition_counts()
    assert result.machine.illegal_counts == machine.illegal_counts
    assert result.machine.stale_counts == machine.stale_counts


def test_cli_replay_text_and_json(traced, capsys):
    machine, registry, writer, path = traced
    preempted_then_finished_twice(registry)
    writer.close()
    assert main(["replay", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = ("transitions", "illegal", "stale", "refused")
    assert {k: out[k] for k in keys} == summarize(machine)
    assert out["requests"]["r1"]["first_illegal"] == {
        "line": 8,
        "state": "RESET",
        "event": "load_done",
        "epoch": 1,
    }
    assert main(["replay", str(path), "--request", "r1"]) == 0
    text = capsys.readouterr().out
    assert text.count("r1: NEW -lookup->") == 1
    assert main(["replay", str(path.with_suffix(".nope"))]) == 2
    assert "error: trace" in capsys.readouterr().err


class TestTraceConfig:
    def test_off_by_default(self):
        assert TraceConfig.from_extra_config({}) == TraceConfig(
            None, DEFAULT_MAX_EVENTS
        )
        assert (
            TraceConfig.from_extra_config({"lifecycle_trace": ""}).path is None
        )

    def test_reads_both_keys(self):
        config = TraceConfig.from_extra_config(
            {
                "lifecycle_trace": " /var/log/t.jsonl ",
                "lifecycle_trace_max_events": 7,
            }
        )
        assert config == TraceConfig("/var/log/t.jsonl", 7)

    def test_pid_placeholder_gives_one_file_per_engine(self):
        config = TraceConfig.from_extra_config(
            {"lifecycle_trace": "/var/log/kv-{pid}.jsonl"}
        )
        assert config.file_for(42) == "/var/log/kv-42.jsonl"
        assert TraceConfig().file_for(42) is None

    @pytest.mark.parametrize(
        ("key", "value"),
        [
            ("lifecycle_trace", 3),
            ("lifecycle_trace_max_events", 0),
            ("lifecycle_trace_max_events", "10"),
            ("lifecycle_trace_max_events", True),
        ],
    )
    def test_bad_values_name_the_key(self, key, value):
        with pytest.raises(ConfigError) as err:
            TraceConfig.from_extra_config({key: value})
        assert err.value.key == key
        assert err.value.value == value

    def test_store_config_accepts_the_keys_silently(self, caplog):
        extra = {
            "master_server_address": "127.0.0.1:50051",
            "metadata_server": "http://127.0.0.1:8080/metadata",
            "lifecycle_trace": "/var/log/t.jsonl",
            "lifecycle_trace_max_events": 10,
        }
        with caplog.at_level(logging.WARNING):
            StoreConfig.from_extra_config(extra)
        assert not [r for r in caplog.records if "lifecycle" in r.getMessage()]


def test_any_request_id_round_trips(traced):
    machine, registry, writer, path = traced
    odd = 'a"b\\c\u00e9\n\u2028{}'
    registry.get_or_create(odd)
    drive(registry, odd, [E.LOOKUP, E.ALLOC_LOCAL, E.FINISH])
    writer.close()
    result = replay_file(path)
    assert list(result.requests) == [odd]
    assert result.requests[odd].path().endswith("-finish-> FINISHED")
    assert summarize(result.machine) == summarize(machine)


def test_strict_mode_traces_the_illegal_event_before_raising(tmp_path):
    path = tmp_path / "t.jsonl"
    _, registry, writer = open_traced(path, strict=True)
    registry.get_or_create("r")
    with pytest.raises(IllegalTransition):
        registry.fire("r", E.LOAD_DONE)
    with pytest.raises(IllegalTransition):
        registry.fire("nobody", E.ABORT)
    writer.close()
    assert [(r["state"], r["outcome"]) for r in events_of(path)] == [
        ("NEW", ILLEGAL),
        (None, ILLEGAL),
    ]


def test_lines_reach_the_file_within_the_flush_interval(tmp_path):
    path = tmp_path / "t.jsonl"
    _, registry, writer = open_traced(path, flush_interval=0.05)
    registry.get_or_create("r")
    registry.fire("r", E.LOOKUP)
    deadline = time.monotonic() + 5
    while len(events_of(path)) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(events_of(path)) == 1  # before close, while idle
    writer.close()


def test_two_writers_on_one_file_never_split_lines(tmp_path):
    path = tmp_path / "shared.jsonl"
    machines = [LifecycleMachine(TABLE) for _ in range(2)]
    writers = [TraceWriter.open(path, flush_interval=0.001) for _ in machines]
    for writer, machine in zip(writers, machines, strict=True):
        writer.attach(machine)

    def work(machine, name):
        registry = Registry(machine, Tracker)
        for i in range(300):
            registry.get_or_create(f"{name}{i}")
            drive(registry, f"{name}{i}", [E.LOOKUP, E.ALLOC_LOCAL, E.FINISH])

    threads = [
        threading.Thread(target=work, args=(m, n))
        for m, n in zip(machines, "ab", strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for writer in writers:
        writer.close()
    result = replay_file(path)
    assert result.malformed == []
    assert result.events == 2 * 300 * 3


def test_the_event_path_never_writes_the_file(tmp_path):
    """Full batches are handed to the flusher: no I/O under the lock."""
    writes: list[tuple[str, bool]] = []

    class Recording(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            holding = machine._busy[0]  # inside a transition
            writes.append((threading.current_thread().name, holding))
            return len(data)

    machine = LifecycleMachine(TABLE)
    registry = Registry(machine, Tracker)
    writer = TraceWriter(Recording(), flush_interval=3600)
    writer.attach(machine)
    registry.get_or_create("r")
    drive(registry, "r", [E.LOOKUP] * (3 * TraceWriter.BATCH_LINES))
    deadline = time.monotonic() + 10
    while not writes and time.monotonic() < deadline:
        time.sleep(0.01)
    on_event_path = [w for w in writes if w[0] == "MainThread"]
    writer.close()
    assert writes, "the full batches were never written"
    assert on_event_path == []
    assert {name for name, _ in writes} >= {"lifecycle-trace-flush"}


def test_hashed_and_sampled_traces_replay(tmp_path):
    """Keyed-hash ids hide the request ids; sampling keeps whole requests."""
    from lifecycle.trace import hash_req_id  # noqa: PLC0415

    path = tmp_path / "t.jsonl"
    key = b"secret key"
    machine = LifecycleMachine(TABLE)
    registry = Registry(machine, Tracker)
    writer = TraceWriter.open(path, id_key=key, sample=0.5)
    writer.attach(machine)
    ids = [f"req-{i}" for i in range(200)]
    for r in ids:
        registry.get_or_create(r)
        drive(registry, r, [E.LOOKUP, E.ALLOC_LOCAL, E.PREEMPT, E.RESET])
        registry.fire(r, E.LOAD_DONE)  # illegal
        drive(registry, r, [E.FINISH])
    writer.close()
    text = path.read_text()
    assert "req-" not in text
    records = events_of(path)
    traced = {r["req_id"] for r in records}
    assert 60 < len(traced) < 140  # about half, deterministic
    assert traced <= {hash_req_id(r, key) for r in ids}
    assert all(sum(x["req_id"] == h for x in records) == 6 for h in traced)
    result = replay_file(path)
    assert result.divergences == []
    assert result.malformed == []
    assert result.machine.illegal_total == len(traced)
    again = tmp_path / "again.jsonl"
    writer = TraceWriter.open(again, id_key=key, sample=0.5)
    writer.attach(machine)
    for r in ids:
        registry.get_or_create(r)
        registry.fire(r, E.ABORT)
    writer.close()
    assert {r["req_id"] for r in events_of(again)} == traced
    with pytest.raises(ValueError, match="sample"):
        TraceWriter.open(tmp_path / "x.jsonl", sample=0.0)
