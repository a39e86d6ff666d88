"""`connector.parallel.TPPlan` and the head-shard views: pure logic.

The store-backed behaviour runs in vLLM's real scheduler
(`tests.test_tp_vllm`) and in real engines (`tests.e2e.test_tp_e2e`).
"""

import pytest
import torch

from connector.errors import ConfigError
from connector.parallel import TPPlan
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.pieces import HeadSlice, block_pieces, head_pieces

LAYOUT = KeyLayout("bfloat16", 32, 8192, "2layers")


def scheme(layout=LAYOUT):
    return KeyScheme("ns", "tiny", 0, 1, layout)


def keys(plan, layout=LAYOUT):
    """Every key of block hash 7 that `plan`'s rank reads and writes."""
    return [s.key(7) for s in plan.schemes(scheme(layout))]


def shard_layout(tp, heads=4):
    """A rank's block bytes at TP `tp` over `heads` heads of 1024 bytes."""
    return KeyLayout("bfloat16", 32, heads // tp * 1024, "2layers")


def test_replicas_and_writers():
    """GQA with more ranks than heads and MLA: one writer per shard."""
    gqa = [TPPlan(r, 4, num_kv_heads=2) for r in range(4)]
    assert [p.kv_replicas for p in gqa] == [2] * 4
    assert [p.writes for p in gqa] == [True, False, True, False]
    assert keys(gqa[0]) == keys(gqa[1]) != keys(gqa[2]) == keys(gqa[3])
    mla = [TPPlan(r, 2, num_kv_heads=8, replicated=True) for r in range(2)]
    assert [p.writes for p in mla] == [True, False]
    assert (
        keys(mla[0]) == keys(mla[1]) == keys(TPPlan(0, 1, 8, replicated=True))
    )
    distinct = [TPPlan(r, 2, num_kv_heads=2) for r in range(2)]
    assert all(p.writes for p in distinct)
    assert keys(distinct[0]) != keys(distinct[1])


def test_head_shards_give_every_tp_size_the_same_keys():
    """store_tp 4 over 4 heads: TP 1, 2 and 4 name the same 4 objects."""
    by_tp = {}
    for tp in (1, 2, 4):
        ranks = [TPPlan(r, tp, num_kv_heads=4, store_tp=4) for r in range(tp)]
        per_rank = [keys(p, shard_layout(tp)) for p in ranks]
        assert all(len(k) == 4 // tp for k in per_rank)
        by_tp[tp] = [k for rank_keys in per_rank for k in rank_keys]
    assert by_tp[1] == by_tp[2] == by_tp[4]
    assert len(set(by_tp[1])) == 4
    lookup = TPPlan(0, 2, 4, store_tp=4).schemes(
        scheme(shard_layout(2)), ranks=range(2)
    )
    assert [s.key(7) for s in lookup] == by_tp[1]


def test_incompatible_layouts_never_share():
    """Head counts, dtypes, block sizes and per-rank vs sharded differ."""
    base = keys(TPPlan(0, 2, 4, store_tp=2), shard_layout(2))
    other_heads = keys(TPPlan(0, 2, 8, store_tp=2), shard_layout(2, heads=8))
    dtype = keys(
        TPPlan(0, 2, 4, store_tp=2), KeyLayout("float16", 32, 2048, "2layers")
    )
    tokens = keys(
        TPPlan(0, 2, 4, store_tp=2), KeyLayout("bfloat16", 64, 2048, "2layers")
    )
    per_rank = keys(TPPlan(0, 2, 4), shard_layout(2))
    assert len({*base, *other_heads, *dtype, *tokens, *per_rank}) == 5


def test_bad_store_tp_is_a_config_error():
    with pytest.raises(ConfigError, match="multiple of the TP size 4"):
        TPPlan(0, 4, num_kv_heads=8, store_tp=2)
    with pytest.raises(ConfigError, match="divide the model's 4 KV heads"):
        TPPlan(0, 1, num_kv_heads=4, store_tp=3)
    # One KV head or MLA: one shard at every TP size, store_tp not needed.
    assert not TPPlan(0, 2, num_kv_heads=1, store_tp=2).shared


def test_head_pieces_view_each_slice_of_every_block():
    """A shard's view of a block is exactly its heads' bytes, per layer."""
    kv = {
        f"l{i}": torch.arange(6 * 4 * 2 * 3, dtype=torch.float32).reshape(
            6, 4, 2, 3
        )
        + 1000 * i
        for i in range(2)
    }
    pieces = block_pieces(kv, 6)
    second = head_pieces(pieces, HeadSlice(2, 2, 4))
    for piece, (name, tensor) in zip(second, kv.items(), strict=True):
        assert piece.layer == name
        assert piece.nbytes == 2 * 2 * 3 * 4
        assert torch.equal(piece.view[5], tensor[5, 2:4])
        assert piece.view[0].is_contiguous()
    with pytest.raises(ValueError, match="head-major"):
        head_pieces(pieces, HeadSlice(0, 1, 3))
