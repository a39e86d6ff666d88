"""Must FAIL `mypy --strict`, exactly on the lines marked ``# E:``.

Issue 34's typing holes, the rejected side (see holes_ok.py): (a) data
through a two- or three-parameter annotation; (b) a callback for another
table's tracker; (c) a key of the wrong type; (e) an observer of other
states or events.
"""

from __future__ import annotations

from collections.abc import Hashable

from examples.offloading_connector import (
    BlockEvent,
    BlockState,
    OffloadingState,
)
from lifecycle import LifecycleMachine, Registry, Row, Table, Tracker
from lifecycle.kv import KVTracker, State
from tests.docpath_lifecycle import PEvent, PState, PTracker
from tests.user_lifecycle import TABLE, JobEvent, JobState, JobTracker

# (a) No data through an annotation that does not give its type.
m3: LifecycleMachine[JobState, JobEvent, JobTracker] = LifecycleMachine(TABLE)
m3.fire(JobTracker("j"), JobEvent.RECEIVED, data=3)  # E: Argument "data" to "__call__" of "_Fire" has incompatible type "int"; expected "None"
r3: Registry[JobState, JobEvent, JobTracker] = Registry(m3, JobTracker)
r3.fire("j", JobEvent.RECEIVED, data=3)  # E: Argument "data" to "fire" of "Registry" has incompatible type "int"; expected "None"
m2: LifecycleMachine[JobState, JobEvent] = LifecycleMachine(TABLE)
m2.fire(JobTracker("j"), JobEvent.RECEIVED, data="x")  # E: Argument 1 to "__call__" of "_Fire" has incompatible type "JobTracker"; expected "Never"  # E: Argument "data" to "__call__" of "_Fire" has incompatible type "str"; expected "None"


# (b) A callback for another table's tracker.
def on_kv(tracker: KVTracker, data: object) -> None:
    del tracker, data


def on_mine(tracker: PTracker, data: object) -> None:
    del tracker, data


def on_any(tracker: Tracker[PState, Hashable], data: object) -> None:
    del tracker, data


annotated: Table[PState, PEvent, None, PTracker] = Table(
    [Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_kv,))],  # E: Argument "after" to "Row" has incompatible type "tuple[Callable[[KVTracker, object], None]]"; expected "tuple[Callable[[PTracker, None], object], ...]"
    initial=PState.WAITING,
    terminal={PState.DONE},
)
FOREIGN = Table(
    [Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_kv,))],
    initial=PState.WAITING,
    terminal={PState.DONE},
)
Registry(LifecycleMachine(FOREIGN), PTracker)  # E: Cannot infer value of type parameter "T" of "Registry"
LifecycleMachine(FOREIGN).fire(PTracker("p"), PEvent.FINISH)  # E: Argument 1 to "__call__" of "_Fire" has incompatible type "PTracker"; expected "KVTracker"
MIXED = Table(  # E: Need type annotation for "MIXED"
    [  # E: Argument 1 to "Table" has incompatible type "list[object]"
        Row(PState.WAITING, PEvent.FINISH, PState.DONE, after=(on_any,)),
        Row(PState.WAITING, PEvent.ABORT, PState.DONE, after=(on_mine,)),
    ],
    initial=PState.WAITING,
    terminal={PState.DONE},
)

# (c) A key of the wrong type.
blocks = OffloadingState().blocks
blocks.fire("1", BlockEvent.STORE)  # E: Argument 1 to "fire" of "Registry" has incompatible type "str"; expected "int"
blocks.get("1")  # E: Argument 1 to "get" of "Registry" has incompatible type "str"; expected "int"
blocks.get_or_create("1")  # E: Argument 1 to "get_or_create" of "Registry" has incompatible type "str"; expected "int"
blocks.fire_if_tracked("1", BlockEvent.STORE)  # E: Argument 1 to "fire_if_tracked" of "Registry" has incompatible type "str"; expected "int"
blocks.discard("1")  # E: Argument 1 to "discard" of "Registry" has incompatible type "str"; expected "int"
Registry(LifecycleMachine(TABLE), JobTracker).fire(1, JobEvent.ALLOC)  # E: Argument 1 to "fire" of "Registry" has incompatible type "int"; expected "str"


# (e) Observers of another table's states or events.
def watch_kv(tracker: object, source: State, event: BlockEvent, dest: State) -> None:
    del tracker, source, event, dest


def watch_dest(tracker: object, source: BlockState, event: BlockEvent, dest: State) -> None:
    del tracker, source, event, dest


machine = OffloadingState().block_machine
machine.add_observer(watch_kv)  # E: Argument 1 to "add_observer" of "LifecycleMachine" has incompatible type
machine.add_observer(watch_dest)  # E: Argument 1 to "add_observer" of "LifecycleMachine" has incompatible type
