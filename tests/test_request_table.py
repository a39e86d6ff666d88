"""`REQUESTS`: the KV table with the scheduler half's field updates.

The fields change inside the transition, from the event's data, and only
when the row applies; the table keeps `lifecycle.kv.TABLE`'s structure,
so traces replay against it.
"""

import pytest

from connector.scheduler.requests import (
    CALLBACKS,
    REQUESTS,
    Allocated,
    Asked,
    RequestTracker,
    with_callbacks,
)
from connector.scheduler.side import Role, SchedulerSide
from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import TABLE, Event, State


class Req:
    def __init__(self):
        self.request_id = "r"
        self.block_hashes = [b"a" * 8, b"b" * 8]
        self.num_prompt_tokens = 33
        self.num_tokens = 33


def fresh():
    machine = LifecycleMachine(REQUESTS, strict=False)
    return machine, Registry(machine, RequestTracker)


def test_same_structure_name_and_fingerprint_as_the_kv_table():
    assert REQUESTS.name == TABLE.name
    assert REQUESTS.fingerprint == TABLE.fingerprint
    assert REQUESTS.rows == TABLE.rows
    assert REQUESTS.without_callbacks().rows == TABLE.rows


def test_every_callback_names_a_row():
    rows = {(r.source, r.event) for r in TABLE.rows}
    assert set(CALLBACKS) <= rows
    with pytest.raises(KeyError, match="FINISHED/lookup"):
        with_callbacks(TABLE, {(State.FINISHED, Event.LOOKUP): ()})


def test_lookup_and_allocation_write_their_data():
    _, reg = fresh()
    t = reg.get_or_create("r")
    req = Req()
    assert reg.fire_on(t, Event.LOOKUP, data=Asked(req, 16))
    assert (t.num_tokens, t.num_prompt_tokens, t.num_local_tokens) == (
        33,
        33,
        16,
    )
    assert t.block_hashes is req.block_hashes
    t.num_hit_tokens = 32
    assert reg.fire_on(
        t, Event.ALLOC_EXTERNAL, data=Allocated(([4, 5, 6], [7]), 16)
    )
    assert t.block_ids == [4, 5, 6]
    assert t.group_block_ids == [[7]]
    assert t.num_external_tokens == 16
    assert t.num_saved_tokens == 32  # the stored hit needs no save


def test_a_refused_event_writes_nothing():
    machine, reg = fresh()
    t = reg.get_or_create("r")
    reg.fire_on(t, Event.ALLOC_LOCAL)  # SAVING: no lookup row
    assert not reg.fire_on(t, Event.LOOKUP, data=Asked(Req(), 16))
    assert t.num_local_tokens == 0
    assert machine.illegal_counts[(State.SAVING, Event.LOOKUP)] == 1


def test_a_stale_load_completion_leaves_the_open_load():
    machine, reg = fresh()
    t = reg.get_or_create("r")
    reg.fire_on(t, Event.ALLOC_EXTERNAL, data=Allocated(([1],), 16))
    t.load_job = 7
    assert not reg.fire_on(t, Event.LOAD_FAILED, epoch=3, data=7)
    assert (t.load_job, t.load_failures) == (7, 0)
    assert reg.fire_on(t, Event.LOAD_FAILED, epoch=0, data=7)
    assert (t.load_job, t.load_failures) == (-1, 1)
    assert machine.stale_counts[(State.LOADING, Event.LOAD_FAILED)] == 1


def test_the_scheduler_half_refuses_a_machine_without_its_callbacks():
    with pytest.raises(ValueError, match="REQUESTS"):
        SchedulerSide(
            block_size=16,
            role=Role.BOTH,
            lookup=object(),
            machine=LifecycleMachine(TABLE),
            threaded_lookups=False,
        )
