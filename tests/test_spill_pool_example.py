"""The spill-pool example (docs/define-your-own.rst): run, threaded."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from examples.spill_pool import (
    BUDGET,
    CE,
    CHUNKS,
    READS,
    C,
    Chunk,
    Read,
    SpillPool,
    run,
)
from lifecycle.testing import table_tests


def pinned(readers: int) -> Any:
    """A set-up: the chunk holds `readers` readers."""

    def setup(chunk: Chunk, _row: object) -> None:
        chunk.readers = readers

    return setup


TestChunks = table_tests(
    CHUNKS, Chunk, key=7, setups={CHUNKS.rows[2]: pinned(1)}
)
TestReads = table_tests(
    READS, Read, setups={READS.rows[0]: lambda _r, _row: (1, 2)}
)


def test_the_example_runs_clean() -> None:
    result = run(rounds=300)
    assert result["violations"] == 0
    assert result["illegal"] == 0
    assert result["reads_started"] > 0
    assert result["declined"] > 0  # expected refusals happened, not raised
    assert result["live_chunks"] <= 12  # retired at ABSENT: bounded


def test_a_refused_read_undoes_its_pins() -> None:
    pool = SpillPool()
    for key in range(BUDGET + 1):
        pool.store(key)
    assert not pool.start_read("big", list(range(BUDGET + 1)))  # over budget
    assert all(c.readers == 0 for c in pool.chunks)
    assert "big" not in pool.reads
    assert pool.start_read("small", [0, 1])
    assert [pool.chunks.get(k).readers for k in (0, 1)] == [1, 1]  # type: ignore[union-attr]


def test_a_read_cancels_a_spill_whose_report_is_then_stale() -> None:
    pool = SpillPool()
    pool.store(3)
    job = pool.spill(3)
    assert job is not None
    assert pool.start_read("r", [3])  # pins it: back in RAM, new epoch
    assert not pool.spill_done(job, ok=True)
    assert pool.chunks.get(3).state is C.RAM  # type: ignore[union-attr]
    assert pool.spill(3) is None  # pinned: declined, not an error


@pytest.mark.parametrize("threads", [4])
def test_readers_on_many_threads_keep_pins_exact(threads: int) -> None:
    pool = SpillPool()
    for key in range(8):
        pool.store(key)
    bad: list[str] = []

    def reader(n: int) -> None:
        for i in range(200):
            name = f"t{n}-{i}"
            if pool.start_read(name, [(n + i) % 8, (n + 2 * i) % 8]):
                bad.extend(pool.check())
                pool.finish_read(name)
            job = pool.spill((n * i) % 8)
            if job is not None:
                pool.spill_done(job, ok=i % 3 != 0)
                pool.chunks.machine  # noqa: B018 - touch: no lock needed
            pool.store((n + i) % 8)

    workers = [
        threading.Thread(target=reader, args=(n,)) for n in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    assert bad == []
    assert pool.check() == []
    assert all(c.readers == 0 for c in pool.chunks)
    assert pool.machines[0].illegal_counts.get((C.RAM, CE.UNPIN), 0) == 0
