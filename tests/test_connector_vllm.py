"""The connector inside vLLM 0.33's real scheduler, over a real master.

Each scenario runs `harness.scheduler.Harness`: vLLM's own `Scheduler`
(or `AsyncScheduler`) drives `connector.MooncakeLifecycleConnector`
loaded by module path, the harness plays the model runner on CPU KV
tensors and checks after every step that each computed block holds what
recomputation would write, and at the end that every block is free.
On top, each test checks the lifecycle: no illegal ordering, no tracker
and no open job left.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness import Harness
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    fail_every_get,
    preempt_then_abort,
    prompt,
    run,
    side,
    store_prefix,
)
from tests.worker_helpers import Gate

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture
def make(extra, harnesses):
    def _make(**kwargs):
        h = Harness(CONNECTOR, extra_config=extra, **kwargs)
        harnesses.append(h)
        return h

    return _make


class TestScenarios:
    @pytest.mark.parametrize("model_runner", ["v1", "v2"])
    def test_preempt_then_finish(self, make, model_runner):
        """vLLM #43281: requests finish after preemption; nothing leaks."""
        h = make(num_blocks=12, model_runner=model_runner)
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 40), max_tokens=30)
        run(h)
        assert h.num_preemptions >= 1
        assert h.resumed
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
        assert_clean(h)

    def test_preempt_then_abort(self, make):
        """Abort a request while it is preempted (empty block ids)."""
        h = make(num_blocks=12)
        preempt_then_abort(h)
        assert_clean(h)

    def test_prefix_saved_by_producer_loaded_by_consumer(self, make):
        """Two instances, one master: B loads what A saved, bytes checked."""
        a = make(kv_role="kv_producer", num_blocks=40)
        for i in range(3):
            a.add_request(f"a{i}", prompt(i, 64), max_tokens=4)
        run(a)
        b = make(kv_role="kv_consumer", num_blocks=40)
        for i in range(3):
            b.add_request(f"b{i}", [*prompt(i, 64), 1, 2, 3], max_tokens=4)
        run(b)
        assert sum(b.external_hits.values()) == 3 * 64
        assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 3}
        assert_clean(a)
        assert_clean(b)

    def test_abort_during_async_load(self, make):
        """Aborted while its KV arrives: one receive completion, no leak."""
        store_prefix(make, 5, 64)
        b = make(num_blocks=40)
        b.add_request("b", [*prompt(5, 64), 9], max_tokens=8)
        b.step()  # answers None: the lookup runs off the scheduler thread
        tracker = side(b).registry.get("b")
        assert tracker is not None
        assert tracker.state.name == "NEW"
        b.step()
        assert tracker.state.name == "LOADING"
        b.abort("b")
        assert tracker.state.name == "DRAINING"
        run(b)
        assert b.finished_by_status() == {"FINISHED_ABORTED": 1}
        assert tracker.state.name == "ABORTED"
        assert_clean(b)

    def test_load_failure_becomes_recompute(self, make):
        """A failed load is reported, recomputed, and never serves bad KV."""
        store_prefix(make, 7, 64)
        b = make(num_blocks=40)
        worker = fail_every_get(b.worker_connector.worker_side)
        b.add_request("b", [*prompt(7, 64), 3], max_tokens=6)
        run(b)
        assert sum(worker.jobs_failed.values()) == 1
        assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
        assert (
            sum(
                side(b).machine.transition_counts()[r]
                for r in side(b).machine.transition_counts()
                if r.event.value == "load_failed"
            )
            == 1
        )
        assert_clean(b)

    def test_finish_with_saves_in_flight(self, make):
        """A request finishes while its save runs; the save still lands.

        vLLM frees the request's blocks at once (never a delayed free);
        the save's pins keep them from reuse until the put completes.
        """
        h = make(num_blocks=40)
        worker = h.worker_connector.worker_side
        gate = Gate(worker._store, gets=False)
        worker._store = gate
        tokens = prompt(11, 64)
        h.add_request("r", tokens, max_tokens=1)
        for _ in range(50):
            h.step()
            if h.finished_by_status():
                break
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
        assert gate.entered.wait(10)
        assert side(h).open_jobs > 0  # the save outlived its request
        gate.release()
        run(h)
        assert_clean(h)
        b = make(num_blocks=40)
        b.add_request("b", [*tokens, 9], max_tokens=2)
        run(b)
        assert b.external_hits["b"] == 64
        assert_clean(b)

    def test_async_scheduler(self, make):
        """AsyncScheduler: step N+1 is built before step N's output."""
        h = make(num_blocks=12, async_scheduling=True)
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 40), max_tokens=30)
        run(h)
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
        assert_clean(h)

    def test_repeated_lookups_while_waiting_are_idempotent(self, make):
        """vLLM asks every step while a request waits; one store query."""
        store_prefix(make, 3, 48)
        b = make(num_blocks=8, max_num_seqs=4)
        b.add_request("big", prompt(4, 90), max_tokens=20)
        b.add_request("w", [*prompt(3, 48), 1], max_tokens=2)
        calls = []
        real = side(b)._lookup

        class Counting:
            def hit_blocks(self, hashes):
                calls.append(len(hashes))
                return real.hit_blocks(hashes)

        side(b)._lookup = Counting()
        run(b)
        assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 2}
        assert len(calls) <= 3
        assert_clean(b)
