"""`connector.scheduler.jobs.JobTable`: one full-attention group's jobs.

Cut from slices, they are the same jobs as the general (group, block,
index) path's."""

import pytest

from connector.groups import KVGroups
from connector.metadata import JobKind
from connector.scheduler.jobs import JobTable

HASHES = [bytes([i]) * 4 for i in range(10)]


@pytest.mark.parametrize("kind", [JobKind.LOAD, JobKind.SAVE])
@pytest.mark.parametrize(
    ("blocks", "first", "last"),
    [
        (list(range(100, 110)), 2, 7),  # a run inside the table
        (list(range(100, 106)), 3, 9),  # past the table: clipped
        (list(range(100, 110)), 4, 4),  # empty
        ([], 0, 3),  # no blocks yet
    ],
)
def test_one_group_range_matches_issue_over_pairs(kind, blocks, first, last):
    pairs = KVGroups.single(16).pairs([blocks], first, last)
    general, fast = JobTable(), JobTable()

    want = general.issue(kind, "r", 3, pairs, HASHES, finished=True)
    got = fast.issue_range(
        kind,
        "r",
        3,
        [blocks],
        HASHES,
        groups=KVGroups.single(16),
        first=first,
        last=last,
        finished=True,
    )

    assert got == want
    assert got.block_ids == tuple(blocks[first:last])
    assert got.block_hashes == tuple(
        HASHES[first : first + len(got.block_ids)]
    )
    assert got.group_ids == ()
    assert fast.take_hits() == general.take_hits()
    assert len(fast) == len(general) == 1


def test_hits_count_loaded_blocks_per_group():
    table = JobTable()
    one = {"groups": KVGroups.single(16), "first": 0}
    table.issue_range(JobKind.LOAD, "a", 0, [[5, 6, 7]], HASHES, last=3, **one)
    table.issue(JobKind.LOAD, "b", 0, [(0, 8, 0), (1, 9, 0)], HASHES)
    table.issue_range(JobKind.SAVE, "c", 0, [[1, 2]], HASHES, last=2, **one)

    assert table.take_hits() == {0: 4, 1: 1}
    assert table.take_hits() == {}
