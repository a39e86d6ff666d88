"""A console walk of one request through a preemption (`make demo`)."""

from __future__ import annotations

import logging

from lifecycle.kv import TABLE, Event, KVTracker
from lifecycle.machine import LifecycleMachine
from lifecycle.registry import Registry
from lifecycle.trace import pair_key

STORY = (
    (Event.LOOKUP, "get_num_new_matched_tokens: 32 tokens in the store"),
    (Event.ALLOC_EXTERNAL, "update_state_after_alloc: load 32 tokens"),
    (Event.LOAD_DONE, "worker: load finished"),
    (Event.SAVE_ISSUED, "build_connector_meta: save 2 full blocks"),
    (Event.PREEMPT, "build_connector_meta: preempted under KV pressure"),
    (Event.RESET, "connector: tracker reset for re-admission"),
    (Event.SAVE_DONE, "worker: the old epoch's save completes (stale)"),
    (Event.LOOKUP, "get_num_new_matched_tokens: re-admission lookup"),
    (Event.FINISH, "request_finished while preempted (vLLM #43281)"),
    (Event.FINISH, "request_finished again (a naive connector crashes)"),
)


def walk() -> int:
    """Print one request's path; return 0."""
    logging.basicConfig(level=logging.WARNING, format="  log: %(message)s")
    machine = LifecycleMachine(TABLE)
    registry = Registry(machine, KVTracker)
    tracker = registry.get_or_create("req-1")
    print(f"{'event':<15} {'result':<8} {'state':<10} epoch  hook")
    for event, what in STORY:
        epoch = 0 if event is Event.SAVE_DONE else None
        ok = registry.fire("req-1", event, epoch=epoch)
        state = tracker.state.name
        print(
            f"{event.value:<15} {'ok' if ok else 'no-op':<8} "
            f"{state:<10} {tracker.epoch:>5}  {what}"
        )
    illegal = {
        pair_key(s, e): n for (s, e), n in machine.illegal_counts.items()
    }
    stale = sum(machine.stale_counts.values())
    print(
        f"\nlive trackers: {len(registry)}; illegal: {illegal}; stale: {stale}"
    )
    return 0
