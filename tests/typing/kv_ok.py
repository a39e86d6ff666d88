"""Must pass `mypy --strict`: the KV lifecycle as README.md, quickstart.rst
and the trace section use it, and the examples' objects keep their types."""

from __future__ import annotations

from typing import Never, assert_type

from examples.offloading_connector import (
    BlockEvent,
    BlockState,
    BlockTracker,
    LoadJob,
    OffloadingState,
    RequestEvent,
    RequestState,
    RequestTracker,
)
from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import TABLE, Event, KVMachine, KVTracker, State
from lifecycle.trace import TraceWriter, replay_file, summarize

machine = LifecycleMachine(TABLE)
assert_type(machine, LifecycleMachine[State, Event, KVTracker, object])
kv_machine: KVMachine = machine
registry = Registry(machine, KVTracker)
assert_type(registry, Registry[State, Event, KVTracker, object])
tracker = registry.get_or_create("req-1")
assert_type(tracker, KVTracker)
assert_type(registry.fire("req-1", Event.LOOKUP), bool)
assert_type(registry.fire_on(tracker, Event.PREEMPT), bool)
assert_type(registry.fire_if_tracked("req-1", Event.FINISH), bool)
assert_type(tracker.state, State)
assert_type(machine.illegal_counts[(None, Event.FINISH)], int)

writer = TraceWriter.open("trace.jsonl", max_events=10_000)
writer.attach(machine)
writer.attach(kv_machine)
result = replay_file("trace.jsonl")
assert_type(summarize(result.machine), dict[str, dict[str, int]])
assert_type(summarize(machine), dict[str, dict[str, int]])

state = OffloadingState()
assert_type(
    state.requests,
    Registry[RequestState, RequestEvent, RequestTracker, int | LoadJob | None],
)
assert_type(
    state.blocks, Registry[BlockState, BlockEvent, BlockTracker, Never, int]
)
