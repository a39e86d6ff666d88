"""`StoreEvents`: the scheduler half's store records, without vLLM."""

from __future__ import annotations

from connector.metadata import JobKind
from connector.scheduler import events as events_module
from connector.scheduler.events import (
    Cleared,
    Removed,
    Stored,
    StoreEvents,
)
from connector.scheduler.jobs import JobTable

HASHES = [bytes([i]) * 4 for i in range(8)]
TOKENS = list(range(100, 100 + 8 * 4))


def table_with_events(block_size=4):
    table = JobTable(world_size=2)
    table.events = StoreEvents(block_size)
    return table


def test_a_save_is_announced_once_every_rank_stored_it():
    table = table_with_events()
    job = table.issue(
        JobKind.SAVE,
        "r",
        0,
        [(0, 10 + i, i) for i in range(2, 5)],
        HASHES,
        token_ids=TOKENS,
    )
    assert table.events.saving == 1
    table.settle(job.job_id, 1, 0)
    assert table.events.take() == []  # one rank of two
    table.settle(job.job_id, 1, 0)
    assert table.events.take() == [
        Stored(
            group=0,
            hashes=tuple(HASHES[2:5]),
            parent=HASHES[1],
            token_ids=tuple(TOKENS[8:20]),
            block_size=4,
        )
    ]
    assert table.events.saving == 0


def test_a_save_failed_on_one_rank_announces_nothing():
    table = table_with_events()
    job = table.issue(
        JobKind.SAVE, "r", 0, [(0, 5, 0)], HASHES, token_ids=TOKENS
    )
    table.settle(job.job_id, 1, 0)
    table.settle(job.job_id, 0, 1)
    assert table.events.take() == []
    assert table.events.saving == 0


def test_hybrid_saves_are_announced_per_group_and_contiguous_run():
    table = JobTable()
    table.events = StoreEvents(4, group_block_sizes=(4, 4))
    # Group 1 (a sliding window) skipped block 3.
    pairs = [(0, 20 + i, i) for i in range(5)] + [(1, 30, 2), (1, 31, 4)]
    job = table.issue(JobKind.SAVE, "r", 0, pairs, HASHES, token_ids=TOKENS)
    table.settle(job.job_id, 1, 0)
    got = table.events.take()
    assert [(r.group, r.hashes, r.parent) for r in got] == [
        (0, tuple(HASHES[0:5]), None),
        (1, (HASHES[2],), HASHES[1]),
        (1, (HASHES[4],), HASHES[3]),
    ]
    assert got[2].token_ids == tuple(TOKENS[16:20])


def test_the_one_group_slice_path_announces_the_same():
    table = table_with_events()
    from connector.groups import KVGroups  # noqa: PLC0415

    job = table.issue_range(
        JobKind.SAVE,
        "r",
        0,
        [list(range(50, 58))],
        HASHES,
        groups=KVGroups.single(4),
        first=1,
        last=3,
        token_ids=TOKENS,
    )
    table.settle(job.job_id, 2, 0)
    (stored,) = table.events.take()
    assert stored.hashes == tuple(HASHES[1:3])
    assert stored.parent == HASHES[0]
    assert stored.token_ids == tuple(TOKENS[4:12])


def test_a_failed_load_announces_its_failed_blocks_removed():
    table = table_with_events()
    job = table.issue(
        JobKind.LOAD, "r", 0, [(0, 40 + i, i) for i in range(3)], HASHES
    )
    table[job.job_id].invalid |= {41, 42, 99}
    table.settle(job.job_id, 0, 2)
    assert table.events.take() == [Removed(0, (HASHES[1], HASHES[2]))]
    ok = table.issue(JobKind.LOAD, "s", 0, [(0, 7, 0)], HASHES)
    table.settle(ok.job_id, 2, 0)
    assert table.events.take() == []


def test_a_reset_drops_saves_in_flight_and_announces_cleared():
    table = table_with_events()
    job = table.issue(
        JobKind.SAVE, "r", 0, [(0, 5, 0)], HASHES, token_ids=TOKENS
    )
    table.events.cleared()
    table.settle(job.job_id, 2, 0)
    assert table.events.take() == [Cleared()]


def test_records_are_bounded_when_nobody_takes_them(monkeypatch):
    monkeypatch.setattr(events_module, "MAX_RECORDS", 3)
    events = StoreEvents(4)
    for _ in range(5):
        events.cleared()
    assert len(events) == 3
    assert events.dropped == 2


def test_no_events_object_records_nothing():
    table = JobTable()
    job = table.issue(
        JobKind.SAVE, "r", 0, [(0, 5, 0)], HASHES, token_ids=TOKENS
    )
    assert table.settle(job.job_id, 1, 0) == (job, True)
    assert table.events is None
