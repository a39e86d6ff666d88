"""KV identity inside vLLM 0.33's real scheduler, over a real master.

A stored block is served only to an instance of the same model (full name
or path, and revision), parallel layout and weights generation: two
models sharing a folder name never share a key or a hit, and a cache
reset (vLLM's ``reset_prefix_cache(reset_connector=True)``) makes every
earlier block miss.  Each test has a positive control (the same setup
with equal identities hits), so a miss proves the identity, not a broken
store.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from harness import Harness
from harness.scheduler import tiny_model_dir
from tests.connector_helpers import CONNECTOR, assert_clean, prompt, run

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

LENGTH = 64  # 4 blocks of 16 tokens
ASK = [*prompt(7, LENGTH), 1, 2, 3]  # the stored prefix, then more


@pytest.fixture
def make(extra, harnesses):
    def _make(model=None, extra_config=None, **kwargs):
        h = Harness(
            CONNECTOR,
            extra_config={**extra, **(extra_config or {})},
            model=model,
            num_blocks=40,
            **kwargs,
        )
        harnesses.append(h)
        return h

    return _make


def _store(h, req_id="s"):
    h.add_request(req_id, prompt(7, LENGTH), max_tokens=2)
    run(h)


def _ask(h, req_id):
    """External hit tokens of one request asking the stored prefix."""
    h.add_request(req_id, ASK, max_tokens=2)
    run(h)
    assert h.finished_status[req_id] == "FINISHED_LENGTH_CAPPED"
    return h.external_hits[req_id]


def _scheme(h):
    return h.worker_connector.worker_side.lanes[0].keys


class TestModelIdentity:
    def test_models_sharing_a_basename_never_share(self, make, tmp_path):
        """``org-a/llama`` and ``org-b/llama`` on one master: no common key,
        no hit; a second ``org-a/llama`` instance hits (control)."""
        org_a = tiny_model_dir(tmp_path / "org-a" / "llama")
        org_b = tiny_model_dir(tmp_path / "org-b" / "llama")
        a = make(org_a)
        _store(a)
        b = make(org_b)
        hashes = a.requests["s"].block_hashes[: LENGTH // 16]
        keys_a, keys_b = _scheme(a).keys(hashes), _scheme(b).keys(hashes)
        assert not set(keys_a) & set(keys_b)
        store = a.worker_connector.worker_side._store
        assert store.exists(keys_a).succeeded == [True] * len(keys_a)
        assert store.exists(keys_b).succeeded == [False] * len(keys_b)
        assert _ask(b, "b") == 0
        again = make(org_a)
        assert _ask(again, "a2") == LENGTH
        assert _scheme(again).prefix == _scheme(a).prefix
        for h in (a, b, again):
            assert_clean(h)

    def test_revisions_never_share(self, make, tmp_path):
        """One path, two revisions: the revision is part of the identity."""
        model = tiny_model_dir(tmp_path / "llama")
        _store(make(model, revision="v1"))
        assert _ask(make(model, revision="v2"), "v2") == 0
        assert _ask(make(model, revision="v1"), "v1") == LENGTH

    def test_weights_versions_never_share(self, make, tmp_path):
        """``weights_version`` names weights the path does not."""
        model = tiny_model_dir(tmp_path / "llama")
        _store(make(model, {"weights_version": "step-1"}))
        assert _ask(make(model, {"weights_version": "step-2"}), "s2") == 0
        assert _ask(make(model, {"weights_version": "step-1"}), "s1") == LENGTH


class TestReset:
    def test_reset_makes_earlier_kv_miss(self, make, tmp_path):
        """After ``reset_prefix_cache(reset_connector=True)`` the instance
        never loads KV stored before it, from itself or from an instance
        that did not reset; KV it saves afterwards hits again (scheduler
        and worker agree on the new generation)."""
        model = tiny_model_dir(tmp_path / "llama")
        other = make(model)
        _store(other)
        h = make(model, enable_prefix_caching=False)
        assert _ask(h, "before") == LENGTH  # control: shared before
        generation = _scheme(h).generation
        assert h.scheduler.reset_prefix_cache(reset_connector=True) is True
        assert _ask(h, "after") == 0
        assert _ask(h, "again") == LENGTH  # saved under the new generation
        new = h.worker_connector.worker_side._generation[1][0].keys
        assert new.generation != generation
        assert new.generation.startswith("+reset-")
        # The instance that did not reset keeps its KV (left to eviction)
        # and never sees the reset instance's new KV.
        late = make(model, enable_prefix_caching=False)
        assert _ask(late, "late") == LENGTH
        assert _scheme(late).generation == generation
        for x in (other, h, late):
            assert_clean(x)

    def test_two_resets_are_two_generations(self, make, tmp_path):
        """Each reset is a new generation: KV of the one before misses."""
        h = make(
            tiny_model_dir(tmp_path / "llama"), enable_prefix_caching=False
        )
        assert h.scheduler_connector.reset_cache() is True
        _store(h)
        assert _ask(h, "hit") == LENGTH
        assert h.scheduler_connector.reset_cache() is True
        assert _ask(h, "miss") == 0
        assert h.worker_connector.reset_cache() is None  # worker: not called
        assert_clean(h)


class TestStartUp:
    """Refusals and warnings when vLLM builds the connector."""

    @staticmethod
    def _build(h, role):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorRole,
        )

        from connector import MooncakeLifecycleConnector  # noqa: PLC0415

        return MooncakeLifecycleConnector(
            h.vllm_config, getattr(KVConnectorRole, role), h.kv_cache_config
        )

    @pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
    def test_pipeline_parallel_is_refused(self, make, role):
        """PP > 1 stops start-up with a message naming the setting."""
        from connector.errors import UnsupportedParallelism  # noqa: PLC0415

        h = make()
        h.vllm_config.parallel_config.pipeline_parallel_size = 2
        with pytest.raises(UnsupportedParallelism) as info:
            self._build(h, role)
        assert info.value.setting == "pipeline_parallel_size"
        assert info.value.value == 2
        assert "pipeline_parallel_size=1" in str(info.value)

    def test_unreadable_tp_rank_is_an_error(self, make):
        """A TP worker whose rank vLLM cannot tell fails, never guesses 0."""
        from connector.errors import ParallelRankError  # noqa: PLC0415

        h = make()
        h.vllm_config.parallel_config.tensor_parallel_size = 2
        with pytest.raises(ParallelRankError) as info:
            self._build(h, "WORKER")
        assert info.value.size == 2
        assert "tensor-parallel rank" in str(info.value)
        # The scheduler half needs no rank: it keys every rank's blocks.
        scheduler = self._build(h, "SCHEDULER")
        assert len(scheduler.scheduler_side._lookup.schemes) == 2
        scheduler.shutdown()

    @pytest.mark.parametrize(
        ("policy", "warned"), [("fail", 1), ("recompute", 0)]
    )
    def test_fail_policy_is_warned_at_start_up(
        self, make, caplog, policy, warned
    ):
        h = make()
        h.vllm_config.kv_transfer_config.kv_load_failure_policy = policy
        logger = "connector.integration.vllm_connector"
        with caplog.at_level(logging.WARNING, logger=logger):
            self._build(h, "WORKER").shutdown()
            self._build(h, "SCHEDULER").shutdown()
        found = [
            r
            for r in caplog.records
            if "kv_load_failure_policy" in r.getMessage()
        ]
        assert len(found) == warned
        for record in found:
            assert record.levelno == logging.WARNING
            assert "recompute" in record.getMessage()
