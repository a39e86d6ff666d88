"""Recurrent-state (Mamba) groups under vLLM 0.33's hybrid KV cache manager.

Every scenario runs `harness.hybrid.HybridHarness` with a recurrent
group (a ``MambaSpec`` in ``mamba_cache_mode="align"``) beside full
attention, and beside full attention and a sliding window: vLLM's real
Scheduler and `HybridKVCacheCoordinator`, `MooncakeLifecycleConnector`
over a real master.  The harness runner reads and writes states as
vLLM's align-mode runner does and fails any step that resumes from a
missing or wrong state; after every step it checks every block of every
group, the recurrent ones included.  `pytest -k "hybrid and mamba"`
selects them.

With ``max_num_batched_tokens=64`` vLLM ends a 128-token prompt's chunks
at 64, 112 (its last cacheable boundary, ``(128 - 1) // 16 * 16``) and
128, and hands the connector the state at each: those are the only
positions a later request can resume from.
"""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("vllm")

from connector.groups import GroupKind, KVGroups, StateOffer
from connector.scheduler import requests
from harness.hybrid import HybridHarness
from harness.scheduler import HarnessError
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    fail_every_get,
    prompt,
    run,
    side,
)
from tests.test_hybrid_vllm import moved, tally, worker

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BS = 16
LAYOUTS = {
    "full+mamba": ("full", "mamba"),
    "full+swa+mamba": ("full", "sliding", "mamba"),
}
#: The boundaries vLLM checkpoints a 128-token prompt at (see above).
CHECKPOINTS_128 = (64, 112, 128)


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request):
    return LAYOUTS[request.param]


@pytest.fixture
def make(extra, harnesses, layout):
    def _make(**kwargs):
        kwargs.setdefault("num_blocks", 64)
        kwargs.setdefault("sliding_window", 40)
        kwargs.setdefault("kinds", layout)
        h = HybridHarness(CONNECTOR, extra_config=extra, **kwargs)
        harnesses.append(h)
        return tally(h)

    return _make


def state_group(h):
    return h.kinds.index("mamba")


def produce(make, seeds, length, **kwargs):
    a = make(kv_role="kv_producer", **kwargs)
    for s in seeds:
        a.add_request(f"a{s}", prompt(s, length), max_tokens=3)
    run(a)
    assert_clean(a)
    return a


def test_hybrid_mamba_groups_are_read_from_vllm(make, layout):
    """The connector sees the recurrent group; vLLM runs its hybrid
    coordinator with a MambaManager in align mode."""
    h = make()
    kinds = [g.kind for g in side(h).groups.groups]
    assert kinds[state_group(h)] is GroupKind.STATE
    assert kinds[0] is GroupKind.FULL
    assert len(kinds) == len(layout)
    coordinator = h.scheduler.kv_cache_manager.coordinator
    assert type(coordinator).__name__ == "HybridKVCacheCoordinator"
    manager = coordinator.single_type_managers[state_group(h)]
    assert type(manager).__name__ == "MambaManager"
    assert manager.mamba_cache_mode == "align"
    assert len(worker(h).lanes) == len(layout)
    # an attention block and a state are one page each (float32), per layer
    page = BS * h.kv_width * 4
    for lane in worker(h).lanes:
        assert lane.block_bytes == h.layers_per_group * page
    state = h.kv_cache_config.kv_cache_groups[state_group(h)].kv_cache_spec
    assert state.state_content_size_bytes == page


@pytest.mark.parametrize(
    ("async_scheduling", "model_runner"),
    [(False, "v1"), (False, "v2"), (True, "v1"), (True, "v2")],
)
def test_hybrid_mamba_producer_consumer_prefix_sharing(
    make, async_scheduling, model_runner
):
    """B resumes from the state A saved at 128 tokens: one state block per
    request loaded, every attention block of the prefix; only the states
    vLLM handed off are saved, each under its own prefix."""
    modes = {
        "async_scheduling": async_scheduling,
        "model_runner": model_runner,
    }
    a = produce(make, [1, 2], 128, **modes)
    g = state_group(a)
    saved = moved(a, "save")
    assert saved[0] == 2 * 8
    # every state vLLM handed off in a save's range, at least 112 and 128
    # per prompt (chunk ends depend on how the two prompts share steps)
    counts = side(a).state_offers.counts
    assert saved[g] == counts["saved"] == counts["offered"] >= 2 * 2
    b = make(kv_role="kv_consumer", **modes)
    for s in (1, 2):
        b.add_request(f"b{s}", [*prompt(s, 128), 7, 8], max_tokens=4)
    run(b)
    assert b.external_hit_tokens == 2 * 128
    loaded = moved(b, "load")
    assert loaded[0] == 2 * 8
    assert loaded[g] == 2  # the state at the hit, nothing else
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 2}
    assert_clean(b)


def test_hybrid_mamba_hit_stops_at_the_last_stored_state(make):
    """A prompt diverging inside block 5: full attention could serve 5
    blocks (80 tokens), but the last state at or below is at 64."""
    produce(make, [3], 128)
    b = make(kv_role="kv_consumer")
    tokens = prompt(3, 128)
    tokens[5 * BS + 3] = 499
    b.add_request("b", tokens, max_tokens=2)
    run(b)
    assert b.external_hits["b"] == 64
    assert sum(worker(b).jobs_failed.values()) == 0
    assert_clean(b)


def test_hybrid_mamba_hit_at_the_last_cacheable_boundary(make):
    """A 120-token prefix of a stored 128-token prompt, then new tokens:
    full attention holds 7 blocks, the state at 112 is stored: hit 112."""
    produce(make, [4], 128)
    b = make(kv_role="kv_consumer")
    b.add_request("b", [*prompt(4, 128)[:120], 5, 6, 7, 8], max_tokens=2)
    run(b)
    assert b.external_hits["b"] == 112
    assert_clean(b)


def test_hybrid_mamba_full_hit(make):
    """The whole 129-token prompt is stored: 128 tokens load, vLLM computes
    the last one from the loaded state."""
    produce(make, [5], 129)
    b = make(kv_role="kv_consumer")
    b.add_request("b", prompt(5, 129), max_tokens=4)
    run(b)
    assert b.external_hits["b"] == 128
    assert moved(b, "load")[state_group(b)] == 1
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def test_hybrid_mamba_preemption_and_resume(make):
    """Requests contend for blocks of every group: preempted, resumed
    (recomputing their states from scratch), finished; nothing leaks."""
    h = make(num_blocks=20)
    for i in range(4):
        h.add_request(f"r{i}", prompt(10 + i, 60), max_tokens=40)
    run(h)
    assert h.num_preemptions >= 1
    assert h.resumed
    assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 4}
    assert_clean(h)


def test_hybrid_mamba_abort_during_load(make):
    """Aborted while its KV and state arrive: one receive completion, no
    leak, exactly one finish."""
    produce(make, [6], 128)
    b = make()
    b.add_request("b", [*prompt(6, 128), 9], max_tokens=8)
    b.step()  # the lookup runs off the scheduler thread
    tracker = side(b).registry.get("b")
    assert tracker is not None
    b.step()
    assert tracker.state.name == "LOADING"
    assert len(tracker.group_block_ids) == len(b.kinds) - 1
    b.abort("b")
    assert tracker.state.name == "DRAINING"
    run(b, max_steps=100_000)
    assert b.finished_by_status() == {"FINISHED_ABORTED": 1}
    assert tracker.state.name == "ABORTED"
    assert_clean(b)


def test_hybrid_mamba_load_failure_becomes_recompute(make):
    """A failed load is reported once for the request (vLLM 0.33's rule
    for several groups: `failed_recving`, never block ids); vLLM
    recomputes from scratch and the harness sees every state right."""
    produce(make, [7], 128)
    b = make()
    w = fail_every_get(worker(b))
    b.add_request("b", [*prompt(7, 128), 3], max_tokens=6)
    run(b)
    assert sum(w.jobs_failed.values()) == 1
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


def test_hybrid_mamba_missing_state_block_fails_the_load(make, monkeypatch):
    """A load whose state block is the null block never reports success:
    the worker fails the request's load and vLLM recomputes it."""
    produce(make, [8], 128)
    b = make(kv_role="kv_consumer")
    real = requests.set_tables
    g = state_group(b)

    def null_state(tracker, tables):
        tables = [list(t) for t in tables]
        if len(tables) > g and tables[g]:
            tables[g][-1] = 0
        real(tracker, tables)

    # The load's tables come from the ``alloc_external`` row callback.
    monkeypatch.setattr(requests, "set_tables", null_state)
    b.add_request("b", [*prompt(8, 128), 1], max_tokens=3)
    run(b)
    assert sum(worker(b).jobs_failed.values()) == 1
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 1}
    assert_clean(b)


class _SkipStateLoad:
    """A transfer whose loads report success and write nothing."""

    def __init__(self, real):
        self._real = real
        self.registered = real.registered

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load(self, store, keys, block_ids, deadline=None):
        del store, keys, deadline
        return [True] * len(block_ids)


def test_hybrid_mamba_harness_catches_a_hit_without_its_state(make):
    """The LMCache #4247 class: a hit whose state was never restored is
    caught by the harness at the step that resumes from it."""
    produce(make, [9], 128)
    b = make(kv_role="kv_consumer")
    w = worker(b)
    g = state_group(b)
    lanes = list(w.lanes)
    lanes[g] = attrs.evolve(
        lanes[g], transfer=_SkipStateLoad(lanes[g].transfer)
    )
    w.lanes = tuple(lanes)
    b.add_request("b", [*prompt(9, 128), 1], max_tokens=3)
    with pytest.raises(
        HarnessError, match="resumes at 128 tokens from a wrong state"
    ):
        run(b)


def test_hybrid_mamba_harness_catches_a_state_of_another_boundary(
    make, monkeypatch
):
    """A state saved under the key of the prefix one block longer is
    caught when another request resumes from it (the state after 112
    tokens, stored as the state after 128, is loaded for a hit at 128)."""
    real = KVGroups._state_pairs

    def one_block_late(group, table, start, end, states):
        pairs = real(group, table, start, end, states)
        if states is None:
            return pairs
        # the prompt has 8 block hashes: the state at 128 has no later key
        return [(g, b, i + 1) for g, b, i in pairs if i + 1 < 128 // BS]

    a = make(kv_role="kv_producer")
    monkeypatch.setattr(KVGroups, "_state_pairs", staticmethod(one_block_late))
    a.add_request("a", prompt(10, 128), max_tokens=3)
    run(a)
    monkeypatch.undo()
    b = make(kv_role="kv_consumer")
    b.add_request("b", [*prompt(10, 128), 1], max_tokens=3)
    with pytest.raises(
        HarnessError, match="resumes at 128 tokens from a wrong"
    ):
        run(b)


def test_hybrid_mamba_offer_outside_the_save_is_dropped(make):
    """States vLLM hands off during decode (past the saved prompt) or for
    a loaded prefix (already stored) are never saved."""
    a = produce(make, [11], 96)
    assert side(a).state_offers.counts["dropped"] == 0
    b = make()  # kv_both: saves and loads
    b.add_request("b", [*prompt(11, 96), *range(40)], max_tokens=40)
    run(b)
    assert b.external_hits["b"] == 96
    counts = side(b).state_offers.counts
    # the loaded state at 96 (cached after the load) and decode states
    assert counts["dropped"] >= 2
    assert counts["saved"] >= 1  # the new prompt tokens' checkpoints
    assert_clean(b)


def test_hybrid_mamba_states_ride_their_steps_save(make):
    """vLLM's hand-offs read as (group, exact block, boundary) offers,
    each saved by the request's save of the step that computed it."""
    a = make(kv_role="kv_producer")
    offers = side(a).state_offers
    seen = []
    real = offers.for_job

    def spy(kind, tracker, first, last):
        states = real(kind, tracker, first, last)
        if states:
            seen.append((first, last, states))
        return states

    offers.for_job = spy
    a.add_request("a", prompt(12, 128), max_tokens=2)
    run(a)
    g = state_group(a)
    # each chunk's save carries the state at its end, in its group
    assert [
        (f, last, [(o.group, o.boundary) for o in states])
        for f, last, states in seen
    ] == [
        (0, 4, [(g, 64)]),
        (4, 7, [(g, 112)]),
        (7, 8, [(g, 128)]),
    ]
    assert all(isinstance(o, StateOffer) for _, _, s in seen for o in s)
    assert offers.counts == {"offered": 3, "saved": 3, "dropped": 0}
    assert_clean(a)
