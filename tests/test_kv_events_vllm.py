"""The store's KV events and hit sources through vLLM 0.33's own path.

The real `Scheduler` takes the connector's events (`take_events`) with
its own GPU block events and publishes them through vLLM's
`ZmqEventPublisher` on loopback; a ZMQ subscriber decodes them with
vLLM's msgspec classes, as a KV-aware router would.  The hit sources ride
in the real scheduler's `SchedulerStats`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import itertools

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.config import DEFAULT_EVENTS_MEDIUM
from harness import Harness
from harness.kv_events import KVEventSubscriber
from tests.connector_helpers import (
    CONNECTOR,
    fail_every_get,
    prompt,
    run,
    side,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BLOCK = 16


@pytest.fixture
def subscriber():
    with KVEventSubscriber() as sub:
        yield sub


@pytest.fixture
def publishing(extra, harnesses, subscriber):
    """A harness whose vLLM publishes KV events to `subscriber`."""

    def make(extra_config=None, **kwargs):
        h = Harness(
            CONNECTOR,
            extra_config={**extra, **(extra_config or {})},
            num_blocks=40,
            kv_events_config=subscriber.config(),
            **kwargs,
        )
        harnesses.append(h)
        return h

    return make


def of_medium(events, kind, medium):
    return [e for e in events if isinstance(e, kind) and e.medium == medium]


def stored_in(events, medium=DEFAULT_EVENTS_MEDIUM):
    return of_medium(events, BlockStored, medium)


def chain(events):
    """The hashes and tokens of BlockStored events, concatenated."""
    hashes = [h for e in events for h in e.block_hashes]
    tokens = [t for e in events for t in e.token_ids]
    return hashes, tokens


def test_a_saved_prefix_is_published_with_vllms_own_hashes(
    publishing, subscriber
):
    a = publishing(block_size=BLOCK)
    tokens = prompt(5, 4 * BLOCK + 5)  # 4 full blocks, then a partial one
    a.add_request("a", tokens, max_tokens=2)
    run(a)
    events = subscriber.wait_for(stored_in)
    store = stored_in(events)
    gpu = of_medium(events, BlockStored, "GPU")
    assert store, [type(e).__name__ for e in events]
    hashes, store_tokens = chain(store)
    # The store holds the four full prompt blocks: vLLM's own GPU events
    # for the same blocks carry the same hashes and tokens.
    gpu_hashes, gpu_tokens = chain(gpu)
    assert len(hashes) == 4
    assert hashes == gpu_hashes[:4]
    assert store_tokens == tokens[: 4 * BLOCK] == gpu_tokens[: 4 * BLOCK]
    assert store[0].parent_block_hash is None
    for event in store:
        assert event.block_size == BLOCK
        assert event.group_idx == 0
    # Each later event of the chain names the block before it.
    for before, after in itertools.pairwise(store):
        assert after.parent_block_hash == before.block_hashes[-1]
    # They are the request's block hashes as vLLM publishes them, and the
    # store really holds those blocks, under the connector's keys.
    own = list(a.requests["a"].block_hashes[:4])
    assert hashes == [maybe_convert_block_hash(h) for h in own]
    connector = a.scheduler_connector
    keys = connector._keys[0].keys(own)
    assert connector._client.exists(keys).num_failed == 0
    assert subscriber.sequences == sorted(subscriber.sequences)


def capture_hit_sources(h):
    """Every `hits_by_source` the real scheduler records."""
    seen = []
    real = h.scheduler.update_from_output

    def update_from_output(*args, **kwargs):
        outputs = real(*args, **kwargs)
        for eco in outputs.values():
            stats = eco.scheduler_stats
            connector = stats and stats.connector_prefix_cache_stats
            if connector is not None and connector.hits_by_source:
                seen.append(dict(connector.hits_by_source))
        return outputs

    h.scheduler.update_from_output = update_from_output
    return seen


def test_store_hits_are_counted_as_host_memory(extra, harnesses):
    a = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
    harnesses.append(a)
    a.add_request("a", prompt(6, 64), max_tokens=2)
    run(a)
    b = Harness(CONNECTOR, extra_config=extra, num_blocks=40, log_stats=True)
    harnesses.append(b)
    seen = capture_hit_sources(b)
    b.add_request("b", [*prompt(6, 64), 9], max_tokens=2)
    run(b)
    assert b.external_hit_tokens == 64
    assert seen == [{CacheHitSource.HOST: 64}]


def test_a_failed_load_is_published_as_removed(
    extra, harnesses, publishing, subscriber
):
    a = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
    harnesses.append(a)
    a.add_request("a", prompt(7, 64), max_tokens=2)
    run(a)
    b = publishing()
    fail_every_get(b.worker_connector.worker_side)
    b.add_request("b", [*prompt(7, 64), 9], max_tokens=2)
    run(b)
    assert b.external_hit_tokens == 64
    # The publisher sends batches from its own thread: wait for both.
    events = subscriber.wait_for(
        lambda ev: (
            of_medium(ev, BlockRemoved, DEFAULT_EVENTS_MEDIUM)
            and stored_in(ev)
        )
    )
    (removed,) = of_medium(events, BlockRemoved, DEFAULT_EVENTS_MEDIUM)
    gpu_hashes, _ = chain(of_medium(events, BlockStored, "GPU"))
    assert removed.block_hashes == gpu_hashes[:4]
    assert removed.group_idx == 0
    # b recomputed the prefix and saved it again: announced again.
    stored, _ = chain(stored_in(events))
    assert stored == gpu_hashes[:4]
    assert events.index(removed) < events.index(stored_in(events)[0])


def test_a_store_reset_is_published_as_all_blocks_cleared(
    publishing, subscriber
):
    a = publishing({"kv_events_medium": "cpu"})
    a.add_request("a", prompt(8, 64), max_tokens=2)
    run(a)
    a.scheduler_connector.store_cleared()
    a.add_request("b", prompt(9, 40), max_tokens=2)
    run(a)
    events = subscriber.wait_for(
        lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev)
    )
    cleared = [
        i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)
    ]
    assert len(cleared) == 1
    assert stored_in(events) == []  # the medium is configurable
    before, after = events[: cleared[0]], events[cleared[0] :]
    assert len(chain(stored_in(before, "cpu"))[0]) == 4
    assert len(chain(stored_in(after, "cpu"))[0]) == 2
    assert side(a).jobs.events is not None


def test_a_cache_reset_is_published_as_all_blocks_cleared(
    publishing, subscriber
):
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` calls the
    connector's ``reset_cache()``: a new weights generation, so nothing
    stored before is loaded again; routers are told the store's blocks
    are gone (the saves of the new generation are announced afresh).
    vLLM's block pool publishes its own ``AllBlocksCleared`` for the GPU
    cache in the same batch: the connector's is told apart by spying on
    what `take_events` hands the scheduler."""
    a = publishing()
    connector = a.scheduler_connector
    taken = []
    real_take = connector.take_events

    def take_events():
        events = list(real_take())
        taken.extend(events)
        return events

    connector.take_events = take_events
    a.add_request("a", prompt(11, 64), max_tokens=2)
    run(a)
    assert a.scheduler.reset_prefix_cache(reset_connector=True) is True
    a.add_request("b", prompt(12, 40), max_tokens=2)
    run(a)
    cleared = [
        i for i, e in enumerate(taken) if isinstance(e, AllBlocksCleared)
    ]
    assert len(cleared) == 1, [type(e).__name__ for e in taken]
    before, after = taken[: cleared[0]], taken[cleared[0] :]
    assert len(chain(stored_in(before))[0]) == 4
    assert len(chain(stored_in(after))[0]) == 2
    # ... and it reached the router, between the two generations' saves.
    events = subscriber.wait_for(lambda ev: len(chain(stored_in(ev))[0]) >= 6)
    last = max(
        i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)
    )
    assert len(chain(stored_in(events[:last]))[0]) == 4
    assert len(chain(stored_in(events[last:]))[0]) == 2


def test_no_events_are_recorded_without_kv_events(extra, harnesses):
    a = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
    harnesses.append(a)
    a.add_request("a", prompt(10, 64), max_tokens=2)
    run(a)
    assert side(a).jobs.events is None
    assert list(a.scheduler_connector.take_events()) == []


def test_a_late_subscriber_catches_up_through_the_replay_socket(
    publishing, subscriber
):
    """A router that joins late (or lost batches to ZMQ's slow joiner)
    asks vLLM's replay socket for what it missed: the same batches, in
    the same order, as a subscriber connected from the start."""
    a = publishing()
    a.add_request("a", prompt(13, 64), max_tokens=2)
    run(a)
    events = subscriber.wait_for(stored_in)
    assert stored_in(events)
    with KVEventSubscriber(directory=subscriber.path.parent) as late:
        assert late.poll(0.2) == 0  # everything was published before
        assert late.replay() == len(subscriber.batches) > 0
        assert late.sequences == []  # nothing arrived live
        assert late.events() == subscriber.events()
