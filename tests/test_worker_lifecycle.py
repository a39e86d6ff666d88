"""The worker half's own lifecycle, over a real master and real tensors.

Each test drives `connector.worker.side.WorkerSide` with the metadata the
scheduler half would send, in the order vLLM's model runner calls the
hooks (`handle_preemptions`, `start_load_kv`, forward, `wait_for_save`,
`get_finished`, `get_block_ids_with_load_errors`, report).  A `Gate`
wrapped around the real store holds a transfer in flight so an ordering
can be forced; the bytes still go through the real master.

`make()` without `kv` hands the worker seeded KV tensors and drops them,
as a caller may: the worker holds them.  Saves are read back and compared
with the source values (`kv_caches()` again), never only checked to exist.
"""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind, JobResult
from connector.store import Regions
from connector.worker import side as worker_module
from connector.worker.side import Verdict
from connector.worker.transfer import (
    HostOps,
    Staged,
    block_pieces,
    open_transfer,
)
from lifecycle import LifecycleMachine
from lifecycle.kv import Event, State
from tests.connector_helpers import CONNECTOR, prompt, run
from tests.worker_helpers import (
    Gate,
    JobMaker,
    assert_same_blocks,
    assert_stored,
    make_worker,
    settle,
    step,
    step_job,
)

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 16
TOKENS = 4
WIDTH = 32
LOAD, SAVE = JobKind.LOAD, JobKind.SAVE


def kv_caches(layout="blocks_first", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def tensor(shape):
        return torch.randn(shape, generator=gen).to(dtype)

    if layout == "blocks_first":
        shape = (NUM_BLOCKS, TOKENS, WIDTH)
    else:
        shape = (2, NUM_BLOCKS, TOKENS, WIDTH)
    return {f"l{i}": tensor(shape) for i in range(2)}


def assert_blocks_equal(kv_a, a_ids, kv_b, b_ids):
    assert_same_blocks(kv_a, a_ids, kv_b, b_ids, NUM_BLOCKS)


def assert_saved(client, w, jobs, kv=None):
    """Each save job's keys hold its blocks' bytes of `kv` (seeded)."""
    source = kv_caches() if kv is None else kv
    for j in jobs:
        keys = w._keys.keys(j.block_hashes)
        assert_stored(client, keys, source, j.block_ids, NUM_BLOCKS)


@pytest.fixture
def make(store_client, unique, workers):
    def _make(kv=None, *, store=None, staging_blocks=None):
        kv = kv_caches() if kv is None else kv
        return workers.add(
            make_worker(
                store_client,
                unique,
                kv,
                NUM_BLOCKS,
                TOKENS,
                store=store,
                staging_blocks=staging_blocks,
            )
        )

    return _make


@pytest.fixture
def job(unique):
    return JobMaker(unique)


class TestWorkerLifecycle:
    def test_stale_save_completion_after_preempt_and_resume_is_dropped(
        self, make, job, store_client
    ):
        """A save from before a preemption never counts for the new epoch."""
        gate = Gate(store_client, gets=False)
        w = make(store=gate)
        old = job(1, SAVE, "r", 0, [0, 1], ["a0", "a1"])
        step(w, ConnectorMeta(step=1, jobs=(old,)))
        assert gate.entered.wait(10)  # the old save is in flight
        step(w, ConnectorMeta(step=2, preempted=(("r", 1),)))
        tracker = w.registry.get("r")
        assert tracker is not None
        assert (tracker.state, tracker.epoch) == (State.RESET, 1)
        new = job(2, SAVE, "r", 1, [2, 3], ["b0", "b1"])
        step(w, ConnectorMeta(step=3, jobs=(new,)))
        assert tracker.state is State.SAVING
        gate.release()
        recving, results, errors = settle(w, 2)
        assert {
            1: JobResult(1, ok=0, failed=1, stale=1),
            2: JobResult(2, ok=1, failed=0, stale=0),
        } == {r.job_id: r for r in results}
        assert w.machine.stale_counts == {(State.SAVING, Event.SAVE_DONE): 1}
        assert w.verdicts[Verdict.STALE] == 1
        assert (recving, errors) == ([], set())
        assert tracker.pending_jobs == set()
        keys = w._keys.keys([*old.block_hashes, *new.block_hashes])
        assert store_client.exists(keys).hit_prefix == 4  # both wrote
        assert_saved(store_client, w, [old, new])
        assert dict(w.machine.illegal_counts) == {}

    def test_a_job_keeps_the_generation_of_its_step(
        self, make, job, store_client
    ):
        """A save issued before a cache reset and run after the next step
        named a new generation is stored under its own (old) generation;
        the next step's save uses the new one."""
        gate = Gate(store_client, gets=False)
        w = make(store=gate)
        first = job(1, SAVE, "p", 0, [6, 7], ["c0", "c1"])
        old = job(4, SAVE, "r", 0, [0, 1], ["a0", "a1"])
        step(w, ConnectorMeta(step=1, jobs=(first, old)))
        assert gate.entered.wait(10)  # `first` in flight, `old` queued
        new = job(2, SAVE, "q", 0, [2, 3], ["b0", "b1"])
        step(w, ConnectorMeta(step=2, jobs=(new,), generation="g1"))
        gate.release()
        assert {r.job_id for r in settle(w, 3)[1]} == {1, 2, 4}
        base = w._keys
        moved = attrs.evolve(base, generation="g1")
        exists = store_client.exists
        assert exists(base.keys(old.block_hashes)).hit_prefix == 2
        assert exists(moved.keys(old.block_hashes)).hit_prefix == 0
        assert exists(moved.keys(new.block_hashes)).hit_prefix == 2
        assert exists(base.keys(new.block_hashes)).hit_prefix == 0
        assert_saved(store_client, w, [first, old])
        moved_keys = moved.keys(new.block_hashes)
        assert_stored(
            store_client, moved_keys, kv_caches(), [2, 3], NUM_BLOCKS
        )

    def test_load_failure_is_reported_exactly_once(self, make, job):
        """Partial miss: one receive completion, the missing blocks once."""
        kv = kv_caches()
        w = make(kv)
        step(
            w, ConnectorMeta(step=1, jobs=(job(1, SAVE, "p", 0, [0], ["h0"]),))
        )
        assert [JobResult(1, ok=1)] == settle(w, 1)[1]
        kv["l0"][4:7].zero_()
        kv["l1"][4:7].zero_()
        load = job(2, LOAD, "r", 0, [4, 5, 6], ["h0", "miss1", "miss2"])
        step(w, ConnectorMeta(step=2, jobs=(load,)))
        recving, results, errors = settle(w, 1)
        assert [{"r"}] == recving
        assert {5, 6} == errors
        assert [JobResult(2, ok=0, failed=1)] == results
        assert set() == w.get_block_ids_with_load_errors()
        assert_blocks_equal(kv, [0], kv, [4])  # the hit arrived
        tracker = w.registry.get("r")
        assert tracker is not None
        assert tracker.state is State.RESET
        assert w.jobs_failed[LOAD] == 1
        step(w, ConnectorMeta(step=3, finished=frozenset({"p", "r"})))
        assert len(w.registry) == 0
        assert dict(w.machine.illegal_counts) == {}

    def test_abort_during_load_drains_to_one_completion(
        self, make, job, store_client
    ):
        """Finished while its KV arrives: DRAINING, then one completion."""
        kv = kv_caches()
        gate = Gate(store_client, puts=False)
        w = make(kv, store=gate)
        step(
            w,
            ConnectorMeta(
                step=1, jobs=(job(1, SAVE, "p", 0, [0, 1], ["x0", "x1"]),)
            ),
        )
        settle(w, 1)
        load = job(2, LOAD, "r", 0, [8, 9], ["x0", "x1"])
        step(w, ConnectorMeta(step=2, jobs=(load,)))
        assert gate.entered.wait(10)
        tracker = w.registry.get("r")
        assert tracker is not None
        step(w, ConnectorMeta(step=3, finished=frozenset({"r"})))
        assert tracker.state is State.DRAINING
        assert "r" in w.registry  # kept until its completion
        gate.release()
        recving, results, errors = settle(w, 1)
        assert [{"r"}] == recving
        assert [JobResult(2, ok=1)] == results
        assert set() == errors
        assert tracker.state is State.ABORTED
        assert "r" not in w.registry
        assert_blocks_equal(kv, [0, 1], kv, [8, 9])

    def test_shutdown_with_jobs_in_flight_cancels_without_hang(
        self, make, job, store_client
    ):
        """Queued jobs are cancelled; a stuck one costs at most `timeout`."""
        gate = Gate(store_client, puts=False)
        w = make(store=gate)
        loads = tuple(
            job(i, LOAD, f"r{i}", 0, [i], [f"none{i}"]) for i in range(8)
        )
        step(w, ConnectorMeta(step=1, jobs=loads))
        assert gate.entered.wait(10)
        start = time.monotonic()
        stopped = w.shutdown(timeout=0.5)
        assert time.monotonic() - start < 3.0
        assert not stopped  # r0's get is still held in the store
        assert w.jobs_cancelled == 7
        step(
            w, ConnectorMeta(step=2, jobs=(job(9, SAVE, "s", 0, [9], ["s"]),))
        )
        assert "s" not in w.registry  # nothing accepted after shutdown
        gate.release()
        assert w.shutdown(timeout=10)
        recving, results, _ = settle(w, 8)
        assert len(results) == 8
        assert dict(w.verdicts) == {Verdict.CANCELLED: 7, Verdict.APPLIED: 1}
        # Cancelled loads fired load_failed; nothing was received for them.
        assert [{"r0"}] == recving
        assert all(
            w.registry.get(f"r{i}").state is State.RESET for i in range(1, 8)
        )

    def test_shutdown_reports_every_job_once_ran_or_cancelled(
        self, make, job, store_client
    ):
        """Queued saves either ran or were cancelled: one result each."""
        w = make()
        saves = tuple(
            job(i, SAVE, f"r{i}", 0, [i], [f"q{i}"]) for i in range(12)
        )
        step(w, ConnectorMeta(step=1, jobs=saves))
        start = time.monotonic()
        assert w.shutdown(timeout=10)
        assert time.monotonic() - start < 5.0
        _, results, _ = settle(w, 12)
        assert sorted(r.job_id for r in results) == list(range(12))
        ran = sum(r.ok for r in results)
        assert ran == w.jobs_done[SAVE]
        assert 12 - ran == w.jobs_cancelled
        assert w.verdicts[Verdict.CANCELLED] == w.jobs_cancelled
        done = {r.job_id for r in results if r.ok}
        assert_saved(store_client, w, [s for s in saves if s.job_id in done])

    def test_no_tracker_left_after_finish(self, make, job):
        """Loads, saves, a preemption, then finish: the registry is empty."""
        kv = kv_caches()
        w = make(kv)
        step(
            w,
            ConnectorMeta(
                step=1, jobs=(job(1, SAVE, "a", 0, [0, 1], ["n0", "n1"]),)
            ),
        )
        settle(w, 1)
        step(
            w,
            ConnectorMeta(
                step=2, jobs=(job(2, LOAD, "b", 0, [2, 3], ["n0", "n1"]),)
            ),
        )
        assert [{"b"}] == settle(w, 1)[0]
        step(
            w,
            ConnectorMeta(
                step=3,
                jobs=(
                    job(3, SAVE, "b", 0, [4], ["n2"]),
                    job(4, SAVE, "c", 0, [5], ["c0"]),
                ),
            ),
        )
        step(w, ConnectorMeta(step=4, preempted=(("c", 1),)))
        settle(w, 2)
        assert len(w.registry) == 3
        step(w, ConnectorMeta(step=5, finished=frozenset({"a", "b", "c"})))
        assert len(w.registry) == 0
        assert dict(w.machine.illegal_counts) == {}
        assert_blocks_equal(kv, [0, 1], kv, [2, 3])

    def test_job_from_a_later_epoch_catches_up_through_the_table(
        self, make, job, store_client
    ):
        """A worker that never saw the preemptions replays them."""
        w = make()
        save = job(1, SAVE, "r", 2, [1], ["e"])
        step(w, ConnectorMeta(step=1, jobs=(save,)))
        tracker = w.registry.get("r")
        assert tracker is not None
        assert (tracker.state, tracker.epoch) == (State.SAVING, 2)
        assert [JobResult(1, ok=1)] == settle(w, 1)[1]
        assert_saved(store_client, w, [save])
        assert sum(w.machine.stale_counts.values()) == 0
        assert dict(w.machine.illegal_counts) == {}

    def test_metadata_seen_by_several_hooks_applies_once(
        self, make, job, store_client
    ):
        """handle_preemptions, start_load_kv and wait_for_save share a meta."""
        w = make()
        save = job(1, SAVE, "r", 0, [1], ["o"])
        step(w, ConnectorMeta(step=1, jobs=(save,)))
        settle(w, 1)
        assert_saved(store_client, w, [save])
        meta = ConnectorMeta(step=2, preempted=(("r", 1),))
        for _ in range(3):
            step(w, meta)
        tracker = w.registry.get("r")
        assert tracker is not None
        assert tracker.epoch == 1


class TestStaging:
    @pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_staged_and_direct_store_the_same_bytes(
        self, make, job, layout, dtype
    ):
        """CPU staging (chunked) round-trips both ways with zero copy."""
        kv_direct = kv_caches(layout, dtype, seed=1)
        kv_staged = kv_caches(layout, dtype, seed=2)
        direct = make(kv_direct)
        staged = make(kv_staged, staging_blocks=2)
        assert isinstance(staged.transfer, Staged)
        staged.save_kv_layer("l0")  # l1 waits on the step-wide mark
        s_keys = [f"s{i}" for i in range(5)]
        d_keys = [f"d{i}" for i in range(3)]
        step_job(staged, 1, job(1, SAVE, "s", 0, range(5), s_keys))
        step_job(direct, 1, job(1, SAVE, "d", 0, range(3), d_keys))
        assert [JobResult(1, ok=1)] == settle(staged, 1)[1]
        assert [JobResult(1, ok=1)] == settle(direct, 1)[1]
        # Staged saves, zero-copy loads; zero-copy saves, staged loads.
        step_job(direct, 2, job(2, LOAD, "d2", 0, range(8, 13), s_keys))
        step_job(staged, 2, job(2, LOAD, "s2", 0, range(13, 16), d_keys))
        assert [{"d2"}] == settle(direct, 1)[0]
        assert [{"s2"}] == settle(staged, 1)[0]
        assert_blocks_equal(kv_staged, range(5), kv_direct, range(8, 13))
        assert_blocks_equal(kv_direct, range(3), kv_staged, range(13, 16))
        _, save_ops = staged.transfer.ops
        assert isinstance(save_ops, HostOps)
        pieces = 2 if layout == "blocks_first" else 4
        assert 3 * pieces == save_ops.waits  # every piece of 3 chunks

    @pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
    def test_staged_save_gathers_runs_and_scattered_blocks(
        self, make, job, store_client, layout
    ):
        """Runs of consecutive ids are copied as slices (two runs here),
        scattered ids by an indexed gather: both store each block's
        bytes in its own slot."""
        kv = kv_caches(layout, seed=5)
        w = make(kv, staging_blocks=8)
        runs = job(1, SAVE, "a", 0, [9, 10, 11, 12, 0, 1, 2, 3], "abcdefgh")
        scattered = job(2, SAVE, "b", 0, [13, 1, 7, 4], "ijkl")
        step(w, ConnectorMeta(step=1, jobs=(runs, scattered)))
        results = sorted(settle(w, 2)[1], key=lambda r: r.job_id)
        assert [JobResult(1, ok=1), JobResult(2, ok=1)] == results
        assert_saved(store_client, w, [runs, scattered], kv)

    def test_staged_load_scatters_only_the_blocks_that_arrived(
        self, make, job
    ):
        """A miss in a staged chunk leaves that block alone."""
        kv = kv_caches(seed=3)
        w = make(kv, staging_blocks=4)
        step(
            w,
            ConnectorMeta(
                step=1, jobs=(job(1, SAVE, "p", 0, [0, 2], ["q0", "q2"]),)
            ),
        )
        settle(w, 1)
        before = [t[6].clone() for t in kv.values()]
        step(
            w,
            ConnectorMeta(
                step=2,
                jobs=(job(2, LOAD, "r", 0, [5, 6, 7], ["q0", "gone", "q2"]),),
            ),
        )
        recving, _, errors = settle(w, 1)
        assert ([{"r"}], {6}) == (recving, errors)
        assert_blocks_equal(kv, [0, 2], kv, [5, 7])
        assert all(
            torch.equal(b, t[6])
            for b, t in zip(before, kv.values(), strict=True)
        )

    def test_each_piece_waits_for_its_layer_mark_or_the_step(
        self, store_client, unique, job
    ):
        """The fence a save waits on: per piece, its layer's mark."""

        class MarkingOps(HostOps):
            """Host copies; markers are numbers, waits are recorded."""

            def __init__(self, device):
                super().__init__(device)
                self.made = 0
                self.waited = []

            def record(self):
                self.made += 1
                return self.made

            def wait(self, marker):
                self.waited.append(marker)

        kv = kv_caches("kv_first")
        transfer = Staged(
            block_pieces(kv, NUM_BLOCKS),
            Regions,
            lambda: MarkingOps(torch.device("cpu")),
            slots=2,
            register=store_client.register,
        )
        try:
            _, ops = transfer.ops
            transfer.layer_written("l1")
            fence = transfer.fence()
            # Pieces: l0 K, l0 V, l1 K, l1 V; l0 never reported this step.
            assert fence == (2, 2, 1, 1)
            assert transfer.fence() == (3, 3, 3, 3)  # marks do not linger
            save = job(1, SAVE, "r", 0, [0, 1, 2], ["f0", "f1", "f2"])
            keys = [f"{unique}-fence-{i}" for i in range(3)]
            flags = transfer.save(store_client, keys, save.block_ids, fence)
            assert flags == [True] * 3
            assert ops.waited == list(fence) * 2  # two chunks of two slots
        finally:
            for ptr in transfer.registered:
                store_client.unregister(ptr)

    def test_staging_buffers_are_registered_once(self, store_client):
        """Two pinned-or-host buffers are registered; KV tensors are not."""
        kv = kv_caches()
        calls = []

        def register(ptr, nbytes):
            calls.append((ptr, nbytes))
            return True

        transfer = open_transfer(
            kv, NUM_BLOCKS, Regions, register=register, staging_blocks=3
        )
        block_bytes = 2 * TOKENS * WIDTH * 4
        assert [3 * block_bytes] * 2 == [n for _, n in calls]
        assert tuple(p for p, _ in calls) == transfer.registered


def test_harness_preemptions_through_cpu_staging(extra, monkeypatch):
    """vLLM's real scheduler, every transfer through the staging code."""
    pytest.importorskip("vllm")
    from harness import Harness  # noqa: PLC0415

    def staged(*args, **kwargs):
        return open_transfer(*args, **{**kwargs, "staging_blocks": 3})

    monkeypatch.setattr(worker_module, "open_transfer", staged)
    with Harness(CONNECTOR, extra_config=extra, num_blocks=12) as h:
        worker = h.worker_connector.worker_side
        assert isinstance(worker.transfer, Staged)
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 40), 30)
        run(h)
        assert h.num_preemptions >= 1
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
        assert worker.jobs_done[SAVE] >= 1
        assert len(worker.registry) == 0
        assert dict(worker.machine.illegal_counts) == {}
        assert (
            dict(h.scheduler_connector.scheduler_side.machine.illegal_counts)
            == {}
        )


def test_machine_is_thread_safe_by_default(make):
    """Completions fire from transfer threads: the machine must lock."""
    w = make()
    assert isinstance(w.machine, LifecycleMachine)
    assert w.machine.thread_safe
