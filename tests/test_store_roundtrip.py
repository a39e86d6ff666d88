"""Round trips of torch CPU KV blocks through a real mooncake_master."""

from __future__ import annotations

import pytest
import torch

from connector.errors import RegionError, RegistrationError
from connector.store import BreakerState, Op, Outcome, Regions
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = pytest.mark.mooncake

BLOCK = 256 * 1024


def scheme(unique, namespace="tests", model="model-a", block_bytes=BLOCK):
    return KeyScheme(
        namespace=f"{namespace}-{unique}",
        model=model,
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, block_bytes),
    )


def test_contiguous_round_trip(store_client, kv_blocks, unique):
    """Blocks put from one tensor come back byte-identical into another."""
    src = kv_blocks(store_client, 8, BLOCK, seed=1)
    dst = kv_blocks(store_client, 8, BLOCK, seed=2)
    keys = scheme(unique).keys(range(8))

    put = store_client.put(keys, src.regions(range(8)))
    assert list(put) == [Outcome.STORED] * 8
    assert put.nbytes == 8 * BLOCK

    assert list(store_client.exists(keys)) == [Outcome.HIT] * 8

    # Load into a permuted block table: block i -> destination 7 - i.
    got = store_client.get(keys, dst.regions(range(7, -1, -1)))
    assert list(got) == [Outcome.HIT] * 8
    assert got.nbytes == 8 * BLOCK
    assert torch.equal(src.tensor, dst.tensor.flip(0))


def test_multi_buffer_round_trip(store_client, kv_blocks, unique):
    """Per-layer pieces (scatter/gather) round-trip via *_multi_buffers."""
    layers, piece = 4, 32 * 1024
    # (layers, blocks, piece): one block is spread over all layers.
    src = kv_blocks(store_client, layers * 6, piece, seed=3)
    dst = kv_blocks(store_client, layers * 6, piece, seed=4)
    src_t = src.tensor.view(layers, 6, piece)
    dst_t = dst.tensor.view(layers, 6, piece)

    def pieces(t, block):
        return [(t[layer, block].data_ptr(), piece) for layer in range(layers)]

    keys = scheme(unique, block_bytes=layers * piece).keys(range(6))
    regions = Regions.of([pieces(src_t, b) for b in range(6)])
    assert not regions.contiguous_layout
    assert list(store_client.put(keys, regions)) == [Outcome.STORED] * 6

    got = store_client.get(keys, [pieces(dst_t, b) for b in range(6)])
    assert list(got) == [Outcome.HIT] * 6
    assert layers * piece * 6 == got.nbytes
    assert torch.equal(src_t, dst_t)

    # The object is the concatenation of the pieces: read it contiguously.
    flat = kv_blocks(store_client, 1, layers * piece, seed=5)
    assert store_client.get(keys[2:3], flat.regions([0])).ok
    expected = torch.cat([src_t[layer, 2] for layer in range(layers)])
    assert torch.equal(expected, flat.tensor[0])


def test_put_twice_keeps_first_value(store_client, kv_blocks, unique):
    """A second put of a key is ALREADY_PRESENT; the content is unchanged."""
    first = kv_blocks(store_client, 2, BLOCK, seed=10)
    second = kv_blocks(store_client, 2, BLOCK, seed=11)
    assert not torch.equal(first.tensor, second.tensor)
    keys = scheme(unique).keys([b"\x01" * 32, b"\x02" * 32])

    assert store_client.put(keys[:1], first.regions([0])).ok
    again = store_client.put(keys, second.regions([0, 1]))
    assert list(again) == [Outcome.ALREADY_PRESENT, Outcome.STORED]
    assert again.nbytes == BLOCK

    out = kv_blocks(store_client, 2, BLOCK, seed=12)
    assert store_client.get(keys, out.regions([0, 1])).ok
    assert torch.equal(first.tensor[0], out.tensor[0])
    assert torch.equal(second.tensor[1], out.tensor[1])


def test_miss(store_client, kv_blocks, unique):
    """Unknown keys are MISS on exists and on get (code -704)."""
    buf = kv_blocks(store_client, 1, BLOCK)
    keys = scheme(unique).keys([12345])
    assert list(store_client.exists(keys)) == [Outcome.MISS]
    got = store_client.get(keys, buf.regions([0]))
    assert list(got) == [Outcome.MISS]
    assert got.codes == [-704]
    assert got.nbytes == 0


def test_mixed_batch_and_prefix(store_client, kv_blocks, unique):
    """One batch can mix hits and misses; hit_prefix finds the prefix."""
    src = kv_blocks(store_client, 4, BLOCK, seed=20)
    s = scheme(unique)
    stored = s.keys([1, 2, 3])
    assert store_client.put(stored, src.regions([0, 1, 2])).ok
    lookup = store_client.exists(s.keys([1, 2, 99, 3]))
    assert list(lookup) == [
        Outcome.HIT,
        Outcome.HIT,
        Outcome.MISS,
        Outcome.HIT,
    ]
    assert lookup.hit_prefix == 2


@pytest.mark.parametrize(
    "other",
    [{"namespace": "other"}, {"model": "model-b"}],
    ids=["namespace", "model"],
)
def test_isolation(store_client, kv_blocks, unique, other):
    """The same hash under another namespace or model is a MISS."""
    src = kv_blocks(store_client, 1, BLOCK, seed=30)
    mine = scheme(unique).keys([b"shared-prefix"])
    theirs = scheme(unique, **other).keys([b"shared-prefix"])
    assert store_client.put(mine, src.regions([0])).ok
    buf = kv_blocks(store_client, 1, BLOCK)
    assert list(store_client.exists(theirs)) == [Outcome.MISS]
    assert list(store_client.get(theirs, buf.regions([0]))) == [Outcome.MISS]
    assert list(store_client.get(mine, buf.regions([0]))) == [Outcome.HIT]


def test_wrong_size_region_is_invalid(store_client, kv_blocks, unique):
    """Reading into a larger region than the object is not a HIT."""
    src = kv_blocks(store_client, 2, BLOCK, seed=40)
    keys = scheme(unique).keys([7])
    assert store_client.put(keys, src.regions([0])).ok
    big = kv_blocks(store_client, 1, 2 * BLOCK)
    got = store_client.get(keys, big.regions([0]))
    assert list(got) == [Outcome.INVALID]
    assert got.codes == [BLOCK]
    small = kv_blocks(store_client, 1, BLOCK // 2)
    assert list(store_client.get(keys, small.regions([0]))) == [
        Outcome.INVALID
    ]


def test_unregistered_memory_is_rejected(store_client, unique):
    """With region checks on, memory outside registrations is refused."""
    loose = torch.zeros(BLOCK, dtype=torch.uint8)
    with pytest.raises(RegionError) as info:
        store_client.put(scheme(unique).keys([1]), [(loose.data_ptr(), BLOCK)])
    assert info.value.index == 0


def test_register_is_idempotent(store_client):
    """Registering the same or a covered region again is a no-op."""
    t = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    assert store_client.register_tensor(t)
    assert not store_client.register_tensor(t)
    assert not store_client.register(t.data_ptr() + BLOCK, BLOCK)
    with pytest.raises(RegistrationError):
        store_client.register(t.data_ptr(), 8 * BLOCK)
    store_client.unregister(t.data_ptr())
    with pytest.raises(RegistrationError):
        store_client.unregister(t.data_ptr())


def test_remove(store_client, kv_blocks, unique):
    """Forced removal deletes leased keys; then they are MISS."""
    src = kv_blocks(store_client, 2, BLOCK, seed=50)
    keys = scheme(unique).keys([1, 2])
    assert store_client.put(keys, src.regions([0, 1])).ok
    assert store_client.exists(keys).ok  # takes a lease
    removed = store_client.remove([*keys, "absent"], force=True)
    assert list(removed) == [Outcome.HIT, Outcome.HIT, Outcome.MISS]
    assert list(store_client.exists(keys)) == [Outcome.MISS] * 2


def test_stats_are_counted(store_client, kv_blocks, unique):
    """Each call adds ops, keys and bytes to the operation's counters."""
    before = store_client.stats.snapshot()
    src = kv_blocks(store_client, 2, BLOCK, seed=60)
    keys = scheme(unique).keys([1, 2])
    store_client.put(keys, src.regions([0, 1]))
    store_client.get([*keys, "absent"], src.regions([0, 1, 0]))
    after = store_client.stats.snapshot()
    assert after[Op.PUT].ops - before[Op.PUT].ops == 1
    assert after[Op.PUT].bytes - before[Op.PUT].bytes == 2 * BLOCK
    assert after[Op.GET].keys - before[Op.GET].keys == 3
    assert after[Op.GET].bytes - before[Op.GET].bytes == 2 * BLOCK
    misses = after[Op.GET].failures.get(Outcome.MISS, 0)
    assert misses - before[Op.GET].failures.get(Outcome.MISS, 0) == 1


def test_fresh_client_is_open_with_breaker_closed(store_client):
    assert not store_client.closed
    assert store_client.breaker.state is BreakerState.CLOSED
    assert store_client.hostname.startswith("127.0.0.1:")
