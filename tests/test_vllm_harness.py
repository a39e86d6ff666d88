"""The vLLM harness drives the reference connector through vLLM's scheduler.

These tests prove the harness itself: that it runs vLLM 0.33's real
`Scheduler` and `AsyncScheduler` with preemptions, aborts and external
loads, and that its checks fail when KV content or blocks go wrong.
"""

import pytest

pytest.importorskip("vllm")

from harness import Harness, HarnessError
from tests import reference_connectors
from tests.connector_helpers import prompt

pytestmark = pytest.mark.vllm

REFERENCE = "tests.reference_connectors.ReferenceConnector"


@pytest.fixture
def store(request):
    """A store namespace of this test's own, emptied afterwards."""
    name = request.node.nodeid
    yield name
    reference_connectors.STORES.pop(name, None)


def make(connector=REFERENCE, *, store, **kwargs):
    return Harness(connector, extra_config={"store": store}, **kwargs)


class TestPlainRun:
    @pytest.mark.parametrize(
        ("model_runner", "resumed_as"),
        [("v1", "resumed_req_ids"), ("v2", "scheduled_new_reqs")],
    )
    def test_preemptions_finish_without_leaks(
        self, store, model_runner, resumed_as
    ):
        """Few blocks force preemptions; every request still finishes."""
        h = make(store=store, num_blocks=12, model_runner=model_runner)
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 30), max_tokens=40)

        h.run_until_idle(max_steps=300)

        assert h.num_preemptions >= 1
        assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
        assert h.resumed
        assert {resumed_as} == {how for _, _, how in h.resumed}
        assert h.num_free_blocks == 11
        assert h.failures == []
        assert all(len(h.output_token_ids(f"r{i}")) == 40 for i in range(4))

    def test_outputs_are_deterministic(self, store):
        """The same prompt gives the same tokens, with or without pressure."""
        roomy = make(store=store + "-a", num_blocks=64)
        tight = make(store=store + "-b", num_blocks=12)
        for h in (roomy, tight):
            for i in range(4):
                h.add_request(f"r{i}", prompt(i, 30), max_tokens=40)
            h.run_until_idle(max_steps=300)

        assert roomy.num_preemptions == 0
        assert tight.num_preemptions >= 1
        for i in range(4):
            assert roomy.output_token_ids(f"r{i}") == tight.output_token_ids(
                f"r{i}"
            )

    def test_abort_mid_run(self, store):
        """Aborts between steps and during execution free their blocks."""
        h = make(store=store, num_blocks=12)
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 30), max_tokens=40)
        for _ in range(5):
            h.step()

        h.abort("r0")
        h.abort("r1", in_flight=True)
        h.run_until_idle(max_steps=300)

        assert h.finished_status["r0"] == "FINISHED_ABORTED"
        assert h.finished_status["r1"] == "FINISHED_ABORTED"
        assert h.finished_status["r2"] == "FINISHED_LENGTH_CAPPED"
        assert h.num_free_blocks == 11


class TestExternalLoads:
    @pytest.mark.parametrize("load_async", [True, False])
    def test_consumer_loads_what_producer_saved(self, store, load_async):
        """A second instance loads the saved prefix; its KV checks pass."""
        prompts = {f"p{i}": prompt(i, 70) for i in range(3)}
        producer = make(store=store, kv_role="kv_producer", num_blocks=32)
        for req_id, tokens in prompts.items():
            producer.add_request(req_id, tokens, max_tokens=8)
        producer.run_until_idle(max_steps=100)
        consumer = Harness(
            REFERENCE,
            kv_role="kv_consumer",
            extra_config={"store": store, "load_async": load_async},
            num_blocks=32,
        )
        for req_id, tokens in prompts.items():
            consumer.add_request(req_id, tokens, max_tokens=8)

        consumer.run_until_idle(max_steps=100)

        assert producer.external_hit_tokens == 0
        assert dict(consumer.external_hits) == {"p0": 64, "p1": 64, "p2": 64}
        for req_id in prompts:
            assert producer.output_token_ids(
                req_id
            ) == consumer.output_token_ids(req_id)

    def test_load_before_forward(self, store):
        """The GPU-runner order (load first, every step) works as well."""
        producer = make(store=store)
        producer.add_request("p", prompt(5, 40), max_tokens=4)
        producer.run_until_idle(max_steps=50)
        consumer = make(store=store, load_order="before_forward")
        consumer.add_request("p", prompt(5, 40), max_tokens=4)

        consumer.run_until_idle(max_steps=50)

        assert consumer.external_hits["p"] == 32
        assert producer.output_token_ids("p") == consumer.output_token_ids("p")

    def test_consumer_never_saves(self, store):
        """A kv_consumer instance leaves the store empty."""
        h = make(store=store, kv_role="kv_consumer")
        h.add_request("r", prompt(0, 40), max_tokens=4)

        h.run_until_idle(max_steps=50)

        assert reference_connectors.get_store(store) == {}


class TestAsyncScheduler:
    @pytest.mark.parametrize("model_runner", ["v1", "v2"])
    def test_batch_queue_with_preemptions_and_loads(self, store, model_runner):
        """AsyncScheduler: preemption, abort and loads, all blocks back."""
        warm = make(store=store, num_blocks=64)
        warm.add_request("w", prompt(9, 48), max_tokens=2)
        warm.run_until_idle(max_steps=50)
        h = make(
            store=store,
            num_blocks=12,
            async_scheduling=True,
            model_runner=model_runner,
        )
        for i in range(4):
            h.add_request(f"r{i}", prompt(i, 30), max_tokens=40)
        h.add_request("hit", prompt(9, 48), max_tokens=4)

        reports = h.run_until_idle(max_steps=300)
        h.abort("r3")  # already finished: a no-op

        assert type(h.scheduler).__name__ == "AsyncScheduler"
        assert any(not r.updated for r in reports)  # N+1 before update(N)
        assert h.num_preemptions >= 1
        assert h.external_hits["hit"] >= 32  # again after a preemption
        assert h.finished_by_status()["FINISHED_LENGTH_CAPPED"] == 5
        assert h.num_free_blocks == 11


class TestChecksCanFail:
    def test_corrupted_load_is_detected(self, store):
        """A connector that loads wrong values fails the content check."""
        producer = make(store=store)
        producer.add_request("p", prompt(3, 40), max_tokens=2)
        producer.run_until_idle(max_steps=50)
        consumer = make(
            "tests.reference_connectors.CorruptingConnector",
            store=store,
            kv_role="kv_consumer",
        )
        consumer.add_request("p", prompt(3, 40), max_tokens=2)

        with pytest.raises(HarnessError, match="holds wrong KV"):
            consumer.run_until_idle(max_steps=50)

    def test_overwritten_block_is_detected(self, store):
        """Scribbling over a computed block is caught in the next step."""
        h = make(store=store)
        h.add_request("r", prompt(1, 40), max_tokens=20)
        h.step()
        assert h.failures == []
        block_id = h.scheduler.kv_cache_manager.get_block_ids("r")[0][1]

        h.kv_caches[h.layer_names[1]][block_id, 3] += 1.0
        report = h.step()

        # Caught twice: when layer 1's attention runs (after its
        # wait_for_layer_load), then by the end-of-step check.
        assert len(report.failures) == 2
        assert all(
            "model.layers.1.self_attn.attn" in f for f in report.failures
        )
        assert "when its attention runs" in report.failures[0]
        with pytest.raises(HarnessError, match="first 19"):
            h.run_until_idle(max_steps=50)

    def test_double_free_is_detected(self, store):
        """A block freed twice drives its reference count negative."""
        h = make(store=store)
        h.add_request("r", prompt(4, 40), max_tokens=20)
        h.step()
        pool = h.scheduler.kv_cache_manager.block_pool
        block_id = h.scheduler.kv_cache_manager.get_block_ids("r")[0][0]

        pool.free_blocks([pool.blocks[block_id]] * 2)

        with pytest.raises(HarnessError, match="freed more often"):
            h.check(final=False)
        assert any("which is free" in f for f in h.failures)

    def test_leaked_blocks_are_detected(self, store):
        """Delay-freed blocks that are never reported sent are a leak."""
        h = make("tests.reference_connectors.NeverSendsConnector", store=store)
        h.add_request("r", prompt(2, 40), max_tokens=2)

        with pytest.raises(HarnessError, match="leaked blocks"):
            h.run_until_idle(max_steps=50)
