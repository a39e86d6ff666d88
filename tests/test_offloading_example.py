"""The offloading example: two lifecycles composed, fuzzed and traced.

Hypothesis drives every hook of `examples.offloading_connector` in any
order (lookups, loads and their completions, preemptions, finishes,
stores, cancels, evictions) and checks after each step what the example
promises: pins are counted exactly (a block's readers are the loads in
flight that read it), a block with readers is never evicted, a stale store
never caches a block, stores in flight are settled whatever their epoch,
and finished requests leave nothing behind.  One trace records both
lifecycles and replays across them.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from examples.offloading_connector import (
    BLOCK,
    REQUEST,
    BlockEvent,
    BlockState,
    BlockTracker,
    OffloadingState,
    RequestState,
    RequestTracker,
)
from lifecycle.testing import table_tests
from lifecycle.trace import TraceWriter, replay_file, summarize

REQS = ("a", "b", "c")
HASHES = (1, 2, 3, 4)


def _pinned(readers: int) -> Any:
    def setup(block: BlockTracker, _row: object) -> None:
        block.readers = readers

    return setup


UNPIN_ROWS = BLOCK.rows_for(BlockState.PINNED, BlockEvent.UNPIN)
TestRequestTable = table_tests(REQUEST, RequestTracker, examples=50)
TestBlockTable = table_tests(
    BLOCK,
    BlockTracker,
    examples=50,
    key=7,
    setups={UNPIN_ROWS[0]: _pinned(2), UNPIN_ROWS[1]: _pinned(1)},
)


class OffloadingFuzz(RuleBasedStateMachine):
    """Every hook in any order, against the example's promises."""

    def __init__(self) -> None:
        super().__init__()
        self.state = OffloadingState()
        self.evicted_with_readers = 0
        self.cached_by_stale_store = 0

    @initialize(tmp=st.just(None))
    def start(self, tmp: None) -> None:
        del tmp

    @rule(req=st.sampled_from(REQS), n=st.integers(0, 4))
    def lookup(self, req: str, n: int) -> None:
        self.state.lookup(req, HASHES[:n])

    @rule(req=st.sampled_from(REQS), n=st.integers(1, 4))
    def load(self, req: str, n: int) -> None:
        self.state.start_load(req, HASHES[:n])

    @precondition(lambda self: self.state.loads)
    @rule(data=st.data(), ok=st.booleans())
    def load_completes(self, data: st.DataObject, ok: bool) -> None:  # noqa: FBT001
        job_id = data.draw(st.sampled_from(sorted(self.state.loads)))
        self.state.load_complete(job_id, ok=ok)

    @rule(req=st.sampled_from(REQS))
    def run(self, req: str) -> None:
        self.state.run(req)

    @rule(req=st.sampled_from(REQS))
    def preempt(self, req: str) -> None:
        self.state.preempt(req)

    @rule(req=st.sampled_from(REQS))
    def finish(self, req: str) -> None:
        self.state.finish(req)

    @rule(block=st.sampled_from(HASHES))
    def store(self, block: int) -> None:
        self.state.start_store(block)

    @precondition(lambda self: self.state.stores)
    @rule(data=st.data(), ok=st.booleans())
    def store_completes(self, data: st.DataObject, ok: bool) -> None:  # noqa: FBT001
        job_id = data.draw(st.sampled_from(sorted(self.state.stores)))
        job = self.state.stores[job_id]
        tracker = self.state.blocks.get(job.block)
        stale = tracker is not None and tracker.epoch != job.epoch
        before = None if tracker is None else tracker.state
        self.state.store_complete(job_id, ok=ok)
        if stale and tracker is not None and tracker.state is not before:
            self.cached_by_stale_store += 1

    @rule(block=st.sampled_from(HASHES))
    def cancel(self, block: int) -> None:
        self.state.cancel_store(block)

    @rule(block=st.sampled_from(HASHES))
    def evict(self, block: int) -> None:
        tracker = self.state.blocks.get(block)
        readers = 0 if tracker is None else tracker.readers
        if self.state.evict(block) and readers:
            self.evicted_with_readers += 1

    @invariant()
    def pins_are_the_loads_in_flight(self) -> None:
        want = Counter(
            h for job in self.state.loads.values() for h in job.hashes
        )
        for block in self.state.blocks:
            assert block.readers == want[block.req_id], block
            assert (block.state is BlockState.PINNED) == (block.readers > 0)

    @invariant()
    def stores_in_flight_are_counted(self) -> None:
        want = Counter(job.block for job in self.state.stores.values())
        for block in self.state.blocks:
            assert block.storing == want[block.req_id], block

    @invariant()
    def nothing_unsafe_happened(self) -> None:
        assert self.evicted_with_readers == 0
        assert self.cached_by_stale_store == 0
        assert not self.state.block_machine.callback_errors
        assert not self.state.request_machine.callback_errors

    @invariant()
    def finished_requests_leave_nothing(self) -> None:
        loading = {job.req_id for job in self.state.loads.values()}
        for request in self.state.requests:
            assert request.state is not RequestState.FINISHED
            if request.state is RequestState.DRAINING:
                assert request.req_id in loading


TestOffloadingFuzz = OffloadingFuzz.TestCase
TestOffloadingFuzz.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_preempted_requests_late_load_is_stale_and_unpins() -> None:
    state = OffloadingState()
    store = state.start_store(1)
    assert store is not None
    assert state.store_complete(store.job_id, ok=True)
    assert state.lookup("a", [1]) == 1
    job = state.start_load("a", [1])
    assert job is not None
    assert state.blocks.get(1).state is BlockState.PINNED  # type: ignore[union-attr]
    assert not state.evict(1)  # readers: refused (an illegal ordering)
    assert state.block_machine.illegal_counts[
        (BlockState.PINNED, BlockEvent.EVICT)
    ]
    assert state.preempt("a")
    assert not state.load_complete(job.job_id, ok=True)  # stale
    request = state.requests.get("a")
    assert request is not None
    assert request.state is RequestState.WAITING
    assert state.blocks.get(1).readers == 0  # type: ignore[union-attr]
    assert state.evict(1)


def test_a_cancelled_store_completes_stale_and_is_settled() -> None:
    state = OffloadingState()
    old = state.start_store(2)
    assert old is not None
    assert state.cancel_store(2)
    new = state.start_store(2)
    assert new is not None
    assert not state.store_complete(old.job_id, ok=True)  # stale
    block = state.blocks.get(2)
    assert block is not None
    assert (block.state, block.storing) == (BlockState.STORING, 1)
    assert state.store_complete(new.job_id, ok=True)
    assert (block.state, block.storing) == (BlockState.STORED, 0)


def test_one_trace_for_both_lifecycles_replays_across_them(
    tmp_path: Path,
) -> None:
    state = OffloadingState()
    path = tmp_path / "offload.jsonl"
    writer = TraceWriter.open(path)
    writer.attach(state.request_machine)
    writer.attach(state.block_machine)
    for block in (1, 2):
        job = state.start_store(block)
        assert job is not None
        state.store_complete(job.job_id, ok=True)
    state.lookup("a", [1, 2])
    load = state.start_load("a", [1, 2])
    assert load is not None
    state.evict(1)  # refused: pinned (illegal)
    state.preempt("a")
    state.load_complete(load.job_id, ok=True)  # stale
    state.finish("a")
    writer.close()
    result = replay_file(path, table=REQUEST, tables=[BLOCK])
    assert result.divergences == []
    assert result.malformed == []
    assert summarize(result.machines["offload_request"]) == summarize(
        state.request_machine
    )
    assert summarize(result.machines["offload_block"]) == summarize(
        state.block_machine
    )
    assert "offload_block:1" in result.requests
    assert result.summary()["tables"]["offload_block"]["illegal"] == {
        "PINNED/evict": 1
    }


def test_the_cli_replays_a_shared_trace_across_tables(
    tmp_path: Path, capsys: Any
) -> None:
    from lifecycle.__main__ import main  # noqa: PLC0415

    state = OffloadingState()
    path = tmp_path / "offload.jsonl"
    writer = TraceWriter.open(path)
    writer.attach(state.request_machine)
    writer.attach(state.block_machine)
    job = state.start_store(3)
    assert job is not None
    state.store_complete(job.job_id, ok=True)
    state.lookup("r", [3])
    state.finish("r")
    writer.close()
    spec = "examples.offloading_connector:"
    assert main(["replay", str(path), "--table", f"{spec}REQUEST"]) == 1
    capsys.readouterr()  # block lines are malformed without --also
    argv = ["replay", str(path), "--table", f"{spec}REQUEST", "--json"]
    assert main([*argv, "--also", f"{spec}BLOCK"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tables"]["offload_block"]["transitions"] == {
        "EMPTY --store--> STORING": 1,
        "STORING --store_done--> STORED": 1,
    }
    assert out["divergences"] == 0
