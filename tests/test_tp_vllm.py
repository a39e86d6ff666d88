"""Tensor parallelism in vLLM 0.33's real scheduler, over a real master.

`Harness(tp_size=T, kv_heads=H)` plays T ranks, each with its own
WORKER-role connector and head-major KV tensors (every head holding its
own values); vLLM's `KVOutputAggregator` folds their outputs.  After every
step the harness checks every head slice of every rank byte for byte.

* Different TP sizes share through the head-sharded layout
  (``store_tp_size``): TP=1 loads what TP=2 saved and the reverse, and
  2 <-> 4.
* Replicated KV (GQA with more ranks than KV heads) is put by one rank per
  distinct shard, read by all.
* ``save_decode_cache``: a chat's next turn hits its answer's blocks.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from connector.metadata import JobKind
from connector.store.keys import KeyScheme
from harness import Harness
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    early_saves,
    prompt,
    run,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture
def make(extra, harnesses):
    def _make(extra_config=None, **kwargs):
        config = {**extra, **(extra_config or {})}
        h = Harness(CONNECTOR, extra_config=config, num_blocks=40, **kwargs)
        harnesses.append(h)
        return h

    return _make


def tp_part(key):
    """The ``tp<shard>of<shards>`` component of a store key."""
    return re.search(r"@(tp\d+of\d+)@", key).group(1)


def clean(h):
    """`assert_clean` on every rank."""
    assert_clean(h)
    for connector, _ in h.ranks:
        worker = connector.worker_side
        assert dict(worker.machine.illegal_counts) == {}
        assert len(worker.registry) == 0


class CountingStore:
    """A rank's store, counting the keys it puts and gets."""

    def __init__(self, real):
        self.real = real
        self.put_keys: list[str] = []
        self.got_keys: list[str] = []

    def put(self, keys, regions):
        self.put_keys += keys
        return self.real.put(keys, regions)

    def get(self, keys, regions):
        self.got_keys += keys
        return self.real.get(keys, regions)


def count_store(h):
    """Per rank, a `CountingStore` in front of its worker's store."""
    counters = []
    for connector, _ in h.ranks:
        worker = connector.worker_side
        worker._store = CountingStore(worker._store)
        counters.append(worker._store)
    return counters


def save_then_load(make, saver, loader, *, heads, extra, length=64):
    """`saver` TP saves 3 prompts; `loader` TP loads them, bytes checked."""
    a = make(tp_size=saver, kv_heads=heads, extra_config=extra)
    for i in range(3):
        a.add_request(f"a{i}", prompt(i, length), max_tokens=2)
    run(a)
    b = make(tp_size=loader, kv_heads=heads, extra_config=extra)
    for i in range(3):
        b.add_request(f"b{i}", [*prompt(i, length), 7, 8], max_tokens=2)
    run(b)
    clean(a)
    clean(b)
    return a, b


SHARED = {"store_tp_size": 2}
SAVE = JobKind.SAVE


@pytest.mark.parametrize(("saver", "loader"), [(2, 1), (1, 2)])
def test_tp_sizes_share_by_head_shard(make, saver, loader):
    """TP=1 loads what TP=2 saved and the reverse; every head exact."""
    _, b = save_then_load(make, saver, loader, heads=2, extra=SHARED)
    assert sum(b.external_hits.values()) == 3 * 64


def test_tp_2_and_4_share_through_lcm(make):
    """``enable_store_tp_lcm`` over ``prefill_tp_sizes`` [2, 4]: 4 shards."""
    extra = {"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 4]}
    _, b = save_then_load(make, 4, 2, heads=4, extra=extra)
    assert sum(b.external_hits.values()) == 3 * 64
    _, c = save_then_load(make, 2, 4, heads=4, extra=extra, length=96)
    assert sum(c.external_hits.values()) == 3 * 96


def test_ranks_never_share_vllms_empty_output(make):
    """A rank with nothing to report returns vLLM's shared
    `EMPTY_MODEL_RUNNER_OUTPUT`; the aggregator writes the folded output
    into rank 0's object.  The harness hands it copies, so the shared
    object never carries one harness's rank count and completions into
    the next (which made vLLM report a TP=4 load done after 2 ranks)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT  # noqa: PLC0415

    save_then_load(make, 2, 4, heads=4, extra=SHARED | {"store_tp_size": 4})
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


def test_head_shards_save_layer_by_layer(make):
    """``layerwise_save_blocks`` with 2 head shards per rank (TP 1,
    ``store_tp_size`` 2, host caches staged): the saves are queued at the
    step's first ``save_kv_layer``, every shard's gather following the
    forward; TP 2 then loads every head shard, each head checked."""
    a = make(
        tp_size=1,
        kv_heads=2,
        extra_config=SHARED | {"layerwise_save_blocks": 8},
    )
    w = a.worker_connector.worker_side
    sharded = w.lanes[0].transfer
    assert len(sharded.parts) == 2
    assert sharded.waits_by_layer  # staged, host caches too
    early = early_saves(w)
    for i in range(3):
        a.add_request(f"a{i}", prompt(20 + i, 64), max_tokens=2)
    run(a)
    # Every save (a prefill's blocks, chunk by chunk) queued mid-forward.
    assert sum(early) == w.jobs_done[SAVE] >= 3
    assert w.jobs_failed[SAVE] == 0
    b = make(tp_size=2, kv_heads=2, extra_config=SHARED)
    for i in range(3):
        b.add_request(f"b{i}", [*prompt(20 + i, 64), 7, 8], max_tokens=2)
    run(b)
    assert sum(b.external_hits.values()) == 3 * 64
    clean(a)
    clean(b)


def test_per_rank_layout_does_not_share_across_tp_sizes(make):
    """Without ``store_tp_size`` TP=2 keys are not TP=1 keys: no hit."""
    _, b = save_then_load(make, 2, 1, heads=2, extra={})
    assert sum(b.external_hits.values()) == 0


def test_head_counts_never_share_a_key(make):
    """The same prompts, models of 2 and 4 KV heads: no hit."""
    a = make(tp_size=2, kv_heads=2, extra_config=SHARED)
    a.add_request("a", prompt(1, 64), max_tokens=2)
    run(a)
    b = make(tp_size=2, kv_heads=4, extra_config=SHARED)
    b.add_request("b", [*prompt(1, 64), 5], max_tokens=2)
    run(b)
    assert sum(b.external_hits.values()) == 0
    clean(b)


def test_replicated_kv_is_written_once(make):
    """TP=2 over one KV head: one rank puts, both read the same keys."""
    a = make(tp_size=2, kv_heads=1)
    puts = count_store(a)
    a.add_request("a", prompt(3, 64), max_tokens=2)
    run(a)
    assert [len(c.put_keys) for c in puts] == [4, 0]  # 64 tokens: 4 blocks
    b = make(tp_size=2, kv_heads=1)
    gets = count_store(b)
    b.add_request("b", [*prompt(3, 64), 1], max_tokens=2)
    run(b)
    assert sum(b.external_hits.values()) == 64
    assert gets[0].got_keys == gets[1].got_keys == puts[0].put_keys
    clean(a)
    clean(b)


def test_replicated_lookup_asks_for_each_key_once(make):
    """The lookup's schemes: one per distinct shard, none never written."""
    h = make(tp_size=4, kv_heads=2)
    schemes = h.scheduler_connector.scheduler_side._lookup.inner.schemes
    assert [tp_part(s.prefix) for s in schemes] == ["tp0of2", "tp1of2"]
    assert all(isinstance(s, KeyScheme) for s in schemes)
    puts = count_store(h)
    h.add_request("r", prompt(4, 64), max_tokens=2)
    run(h)
    assert [len(c.put_keys) for c in puts] == [4, 0, 4, 0]  # ranks 0, 2
    assert set(puts[0].put_keys).isdisjoint(puts[2].put_keys)
    clean(h)


def chat_turn_hits(make, extra, seed, *, answer=40):
    """Turn 1 on A; turn 2 (prompt + answer + new message) on B: B's hit."""
    a = make(extra_config=extra)
    first = prompt(seed, 64)
    a.add_request("t1", first, max_tokens=answer)
    run(a)
    reply = a.output_token_ids("t1")
    assert len(reply) == answer
    b = make(extra_config=extra)
    b.add_request("t2", [*first, *reply, 11, 12, 13], max_tokens=4)
    run(b)
    clean(a)
    clean(b)
    return sum(b.external_hits.values())


def test_decode_cache_serves_the_next_turn(make):
    """``save_decode_cache``: turn 2 hits the answer's full blocks.

    64 prompt tokens + 40 generated: the last one's KV is never computed,
    so 103 tokens hold KV, 6 full blocks of 16; without the decode cache
    only the 4 prompt blocks hit.  Turn 2's KV is checked byte for byte.
    """
    assert chat_turn_hits(make, {"save_decode_cache": True}, 6) == 96
    assert chat_turn_hits(make, {}, 7) == 64


def test_consumer_saves_only_decode_blocks(make):
    """A consumer with ``save_decode_cache`` puts no prompt block."""
    h = make(kv_role="kv_consumer", extra_config={"save_decode_cache": True})
    puts = count_store(h)
    h.add_request("r", prompt(8, 64), max_tokens=40)
    run(h)
    assert len(puts[0].put_keys) == 2  # blocks 4 and 5: generated tokens
    clean(h)


def test_bad_store_tp_sizes_refuse_to_start(extra, harnesses):
    """A store_tp_size the heads or ranks cannot split, or a hybrid model:
    a ConfigError naming ``store_tp_size`` when vLLM builds the connector."""
    from connector.errors import ConfigError  # noqa: PLC0415
    from harness.hybrid import HybridHarness  # noqa: PLC0415

    cases = [
        (Harness, {"store_tp_size": 3}, {"tp_size": 1, "kv_heads": 4}),
        (Harness, {"store_tp_size": 2}, {"tp_size": 4, "kv_heads": 4}),
        (HybridHarness, {"store_tp_size": 2}, {}),
    ]
    for cls, more, kwargs in cases:
        with pytest.raises(Exception) as err:  # noqa: PT011 - vLLM may wrap
            harnesses.append(
                cls(CONNECTOR, extra_config={**extra, **more}, **kwargs)
            )
        chain = [err.value, err.value.__cause__, err.value.__context__]
        found = [e for e in chain if isinstance(e, ConfigError)]
        assert found, err.value
        assert found[0].key == "store_tp_size"
