"""Must pass `mypy --strict`: issue 34's typing holes, the accepted side.

(a) two or three type parameters mean no data, not any data; (b) row
callbacks carry the tracker type; (c) registries carry their key type;
(d) the testing helpers take any factory and key; (e) observers are
matched by position and ``dest`` is a state; (f) a partly or not
parametrised annotation accepts every concrete machine.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Never, assert_type

from examples.offloading_connector import (
    BLOCK,
    REQUEST,
    BlockEvent,
    BlockState,
    BlockTracker,
    OffloadingState,
    RequestEvent,
    RequestState,
    RequestTracker,
)
from lifecycle import (
    LifecycleMachine,
    Observer,
    Registry,
    RejectObserver,
    Row,
    Table,
    Tracker,
)
from lifecycle.testing import (
    check_case,
    check_row,
    event_sequences,
    machine_mismatches,
    matrix,
    pytest_cases,
    shortest_paths,
    table_tests,
    tracker_in,
)
from tests.docpath_lifecycle import PLAIN, PEvent, PState, PTracker
from tests.user_lifecycle import TABLE, JobEvent, JobState, JobTracker

# (a) Three parameters: the data type is None (no data); four: given.
m3: LifecycleMachine[JobState, JobEvent, JobTracker] = LifecycleMachine(TABLE)
assert_type(m3, LifecycleMachine[JobState, JobEvent, JobTracker, Never])
m3.fire(JobTracker("j"), JobEvent.ALLOC)
r3: Registry[JobState, JobEvent, JobTracker] = Registry(m3, JobTracker)
r3.fire("j", JobEvent.ALLOC, data=None)
m4: LifecycleMachine[JobState, JobEvent, JobTracker, int | None] = (
    LifecycleMachine(TABLE)
)
m4.fire(JobTracker("j"), JobEvent.RECEIVED, data=3)
Registry(m4, JobTracker).fire("j", JobEvent.RECEIVED, data=4)


# (b) The table takes the tracker type of its callbacks; a callback for
# any tracker of the states fits every tracker of them.  Callbacks for
# different tracker types in one table: annotate it (holes_bad.py).
def on_any(tracker: Tracker[PState, Hashable], data: object) -> None:
    del tracker, data


def on_mine(tracker: PTracker, data: object) -> None:
    del tracker, data


ANY = Table(
    [Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_any,))],
    initial=PState.WAITING,
    terminal={PState.DONE},
)
assert_type(ANY, Table[PState, PEvent, object, Tracker[PState, Hashable]])
MINE: Table[PState, PEvent, object, PTracker] = Table(
    [
        Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_any,)),
        Row(PState.WAITING, PEvent.ABORT, PState.DONE, after=(on_mine,)),
    ],
    initial=PState.WAITING,
    terminal={PState.DONE},
)
Registry(LifecycleMachine(ANY), PTracker)
Registry(LifecycleMachine(ANY), Tracker)
Registry(LifecycleMachine(MINE), PTracker)
annotated: Table[PState, PEvent, None, PTracker] = Table(
    [Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_mine,))],
    initial=PState.WAITING,
    terminal={PState.DONE},
)

# (c) The key type comes from the factory.
state = OffloadingState()
blocks = state.blocks
assert_type(blocks, Registry[BlockState, BlockEvent, BlockTracker, Never, int])
assert_type(blocks.get(7), BlockTracker | None)
assert_type(blocks.get_or_create(7), BlockTracker)
blocks.fire(7, BlockEvent.STORE)
blocks.fire_if_tracked(7, BlockEvent.STORE_DONE)
blocks.discard(7)
assert_type(state.requests.get("r"), RequestTracker | None)

# (d) The testing helpers take any factory (the base class too) and key.
TestBlocks = table_tests(BLOCK, BlockTracker, key=7)
TestBase = table_tests(PLAIN, Tracker, key=7)
TestRequests = table_tests(REQUEST, RequestTracker)
block = tracker_in(
    BlockState.STORED, LifecycleMachine(BLOCK), BlockTracker, req_id=7
)
assert_type(block, BlockTracker)
check_row(BLOCK.rows[0], BLOCK, BlockTracker, key=7)
check_case(matrix(BLOCK)[0], BLOCK, BlockTracker, key=7)
assert_type(
    shortest_paths(REQUEST), dict[RequestState, tuple[RequestEvent, ...]]
)
assert_type(machine_mismatches(state.block_machine), list[str])
pytest_cases(REQUEST)
event_sequences(BLOCK)


# (e) Observers: any parameter names; source and dest are states.
def watch(block: BlockTracker, was: BlockState, on: BlockEvent, now: BlockState) -> None:
    del block, was, on, now


def watch_any(tracker: object, src: object, event: object, dst: object) -> None:
    del tracker, src, event, dst


def refused(  # noqa: PLR0917 - the reject-observer protocol
    key: object,
    epoch: int | None,
    at: BlockState | None,
    on: BlockEvent,
    job: int | None,
    why: str,
) -> None:
    del key, epoch, at, on, job, why


state.block_machine.add_observer(watch)
state.block_machine.add_observer(watch_any)
state.block_machine.add_reject_observer(refused)
observer: Observer[BlockTracker, BlockState, BlockEvent] = watch
rejects: RejectObserver[BlockState, BlockEvent] = refused


# (f) Partly parametrised annotations accept every concrete machine.
def count(machine: LifecycleMachine[Any, Any]) -> int:
    return machine.illegal_total


def live(registry: Registry[Any, Any, Any]) -> int:
    return len(registry)


count(state.block_machine)
count(state.request_machine)
count(m4)
count(LifecycleMachine(MINE))
live(state.requests)
