"""`connector.groups` against vLLM 0.33's own hybrid rules.

The hit rule is checked against vLLM's real `HybridKVCacheCoordinator`
(built by vLLM's Scheduler over `harness.hybrid`'s two groups) on
random store contents; the group kinds vLLM can hand the connector are
accepted or refused at start-up with every group named.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.errors import UnsupportedKVGroups
from connector.groups import (
    GroupKind,
    KVGroup,
    KVGroups,
    StateOffer,
    sliding_hit,
    state_hit,
)

BS = 16


def _groups(window_blocks):
    return KVGroups(
        (
            KVGroup(0, GroupKind.FULL, BS),
            KVGroup(1, GroupKind.SLIDING, BS, window_blocks),
        )
    )


def test_hybrid_sliding_hit_examples():
    """vLLM's scan: `need` contiguous blocks ending at the hit, else the
    stored run from block 0."""
    assert sliding_hit([True] * 8, 8, 3) == 8
    assert sliding_hit([False, False, True, True, True, False], 6, 3) == 5
    assert sliding_hit([True, True, False, True, True], 5, 3) == 2
    assert sliding_hit([True] * 8, 5, 3) == 5
    assert sliding_hit([False] * 4, 4, 2) == 0


def test_hybrid_hit_is_common_prefix():
    """Full attention bounds the hit; the window must be stored there."""
    groups = _groups(2)
    full = [True] * 6
    window = [False, False, True, True, False, False]
    assert groups.hit_blocks([full, window]) == 4
    assert groups.hit_blocks([[True, True, False, True], [True] * 4]) == 2
    assert groups.hit_blocks([[], []]) == 0


def test_hybrid_pairs_move_the_window_only():
    """Saves/loads: every full-attention block; the window's real blocks."""
    groups = _groups(2)
    tables = [[1, 2, 3, 4, 5], [0, 0, 8, 9, 10]]
    assert groups.pairs(tables, 1, 5) == [
        (0, 2, 1),
        (0, 3, 2),
        (0, 4, 3),
        (0, 5, 4),
        (1, 9, 3),
        (1, 10, 4),
    ]
    # the null block (a skipped position) is never moved
    assert groups.pairs([[1, 2], [0, 0]], 0, 2) == [(0, 1, 0), (0, 2, 1)]


def test_hybrid_mamba_state_hit_examples():
    """vLLM's MambaManager scan: the last stored state at or below the
    limit; no state needs the blocks before it."""
    assert state_hit([False, False, True, False], 4) == 3
    assert state_hit([True, False, False, True], 3) == 1
    assert state_hit([False] * 3, 3) == 0
    assert state_hit([True] * 5, 2) == 2


def _state_groups(*kinds):
    made = []
    for i, kind in enumerate(kinds):
        window = 3 if kind is GroupKind.SLIDING else 0
        made.append(KVGroup(i, kind, BS, window))
    return KVGroups(tuple(made))


def test_hybrid_mamba_hit_needs_every_group():
    """Full attention bounds the hit, the state cuts it to its last stored
    boundary, a window must be stored there too."""
    groups = _state_groups(GroupKind.FULL, GroupKind.STATE)
    assert (
        groups.hit_blocks([[True] * 6, [False, True, False, True, 0, 0]]) == 4
    )
    assert groups.hit_blocks([[True, True, False, True], [True] * 4]) == 2
    three = _state_groups(GroupKind.FULL, GroupKind.SLIDING, GroupKind.STATE)
    full = [True] * 8
    window = [True, True, True, True, False, True, True, True]
    state = [False, False, False, True, False, True, False, False]
    # state at 6 blocks, window there [3, 6) misses block 4: back to 4
    assert three.hit_blocks([full, window, state]) == 4


def test_hybrid_mamba_pairs_load_one_state_save_offers():
    """A load moves the state block the request resumes from (even the
    null block, which the worker fails); a save moves the offers in its
    range, each under the block index ending at its boundary."""
    groups = _state_groups(GroupKind.FULL, GroupKind.STATE)
    tables = [[1, 2, 3, 4], [0, 0, 0, 9]]
    assert groups.pairs(tables, 1, 4) == [
        (0, 2, 1),
        (0, 3, 2),
        (0, 4, 3),
        (1, 9, 3),
    ]
    assert groups.pairs([[1, 2], [0, 0]], 0, 2)[-1] == (1, 0, 1)
    offers = [
        StateOffer(1, 7, 2 * BS),  # ends block 1: in range
        StateOffer(1, 8, 4 * BS),  # ends block 3: in range
        StateOffer(1, 6, 1 * BS),  # at the save's start: saved before
        StateOffer(1, 5, 5 * BS),  # past the save
        StateOffer(1, 4, 2 * BS + 3),  # not block-aligned: no key
        StateOffer(1, 0, 3 * BS),  # the null block
    ]
    saved = groups.pairs(tables, 1, 4, offers)
    assert [p for p in saved if p[0] == 1] == [(1, 7, 1), (1, 8, 3)]
    assert groups.pairs(tables, 1, 4, []) == saved[:3]


@pytest.fixture(scope="module")
def coordinator(mooncake_master):
    pytest.importorskip("vllm")
    from harness.hybrid import HybridHarness  # noqa: PLC0415
    from tests.connector_helpers import CONNECTOR, store_extra  # noqa: PLC0415

    h = HybridHarness(
        CONNECTOR,
        extra_config=store_extra(mooncake_master, "hybrid-coordinator"),
        sliding_window=40,
        num_blocks=32,
    )
    yield h.scheduler.kv_cache_manager.coordinator
    h.close()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    full=st.lists(st.booleans(), min_size=0, max_size=12),
    window=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_hybrid_hit_matches_vllm_coordinator(coordinator, full, window):
    """`KVGroups.hit_blocks` == vLLM's HybridKVCacheCoordinator hit."""
    n = len(full)
    window = window[:n]
    pool = coordinator.single_type_managers[0].block_pool
    block = pool.blocks[1]
    present = {0: full, 1: window}
    hashes = [bytes([i + 1]) * 4 for i in range(n)]

    def get_cached_block(block_hash, group_ids):
        i = hashes.index(block_hash)
        if all(present[g][i] for g in group_ids):
            return [block] * len(group_ids)
        return None

    pool.get_cached_block = get_cached_block
    try:
        _, hit, _ = coordinator.find_longest_cache_hit(hashes, n * BS)
    finally:
        del pool.get_cached_block
    assert hit == _groups(3).hit_blocks([full, window]) * BS


@pytest.fixture(
    scope="module",
    params=[("full", "mamba"), ("full", "sliding", "mamba")],
    ids=["full+mamba", "full+swa+mamba"],
)
def mamba_coordinator(mooncake_master, request):
    pytest.importorskip("vllm")
    from harness.hybrid import HybridHarness  # noqa: PLC0415
    from tests.connector_helpers import CONNECTOR, store_extra  # noqa: PLC0415

    h = HybridHarness(
        CONNECTOR,
        extra_config=store_extra(mooncake_master, "hybrid-mamba-coordinator"),
        sliding_window=40,
        num_blocks=32,
        kinds=request.param,
    )
    groups = h.scheduler_connector.scheduler_side.groups
    yield h.scheduler.kv_cache_manager.coordinator, groups
    h.close()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    full=st.lists(st.booleans(), min_size=0, max_size=12),
    window=st.lists(st.booleans(), min_size=12, max_size=12),
    state=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_hybrid_mamba_hit_matches_vllm_coordinator(
    mamba_coordinator, full, window, state
):
    """`KVGroups.hit_blocks` == vLLM's HybridKVCacheCoordinator hit with a
    recurrent group (MambaManager, align mode) beside full attention, and
    beside full attention and a sliding window."""
    coordinator, groups = mamba_coordinator
    n = len(full)
    by_kind = {
        GroupKind.FULL: full,
        GroupKind.SLIDING: window[:n],
        GroupKind.STATE: state[:n],
    }
    present = {g.index: by_kind[g.kind] for g in groups.groups}
    pool = coordinator.single_type_managers[0].block_pool
    block = pool.blocks[1]
    hashes = [bytes([i + 1]) * 4 for i in range(n)]

    def get_cached_block(block_hash, group_ids):
        i = hashes.index(block_hash)
        if all(present[g][i] for g in group_ids):
            return [block] * len(group_ids)
        return None

    pool.get_cached_block = get_cached_block
    try:
        _, hit, _ = coordinator.find_longest_cache_hit(hashes, n * BS)
    finally:
        del pool.get_cached_block
    assert hit == groups.hit_blocks([present[g] for g in sorted(present)]) * BS


def _config(*specs):
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)
        ],
    )


def _attention(kind="full", **more):
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    shape = {"num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    shape["block_size"] = more.pop("block_size", BS)
    if kind == "full":
        return FullAttentionSpec(**shape)
    return SlidingWindowSpec(**shape, **more)


def test_hybrid_group_kinds_read_from_vllm_specs():
    """Full attention and sliding window are read with their window."""
    pytest.importorskip("vllm")
    groups = KVGroups.from_kv_cache_config(
        _config(_attention(), _attention("swa", sliding_window=40))
    )
    assert groups.kinds == ("0:full_attention", "1:sliding_window")
    assert groups.groups[1].window_blocks == 3
    assert groups.hybrid


def _mamba(**more):
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import MambaSpec  # noqa: PLC0415

    return MambaSpec(
        block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,), **more
    )


SUPPORTED_TEXT = (
    "supported group kinds: full_attention, sliding_window, "
    "mamba (mamba_cache_mode='align')"
)


def test_hybrid_mamba_align_is_read_from_vllm_specs():
    """A Mamba/SSM/linear-attention group in align mode is served."""
    pytest.importorskip("vllm")
    groups = KVGroups.from_kv_cache_config(
        _config(
            _attention(),
            _attention("swa", sliding_window=40),
            _mamba(mamba_cache_mode="align"),
        )
    )
    assert groups.kinds == ("0:full_attention", "1:sliding_window", "2:mamba")
    assert groups.has_state


def test_hybrid_refuses_mamba_without_align_naming_every_group():
    """Attention + Mamba state without align mode (no prefix caching: only
    the running state is kept) is refused at start-up, naming the
    model's group kinds and the supported ones."""
    pytest.importorskip("vllm")
    with pytest.raises(UnsupportedKVGroups) as caught:
        KVGroups.from_kv_cache_config(_config(_attention(), _mamba()))
    err = caught.value
    assert err.groups == ("0:full_attention", "1:mamba")
    assert "0:full_attention, 1:mamba" in str(err)
    assert "group 1 is mamba with mamba_cache_mode='none'" in str(err)
    assert SUPPORTED_TEXT in str(err)
    assert isinstance(err, ValueError)
    with pytest.raises(UnsupportedKVGroups, match="speculative state blocks"):
        KVGroups.from_kv_cache_config(
            _config(
                _attention(),
                _mamba(mamba_cache_mode="align", num_speculative_blocks=2),
            )
        )


def test_hybrid_refuses_cross_attention_naming_every_group():
    """Encoder-decoder cross attention stays refused, every group named."""
    pytest.importorskip("vllm")
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import CrossAttentionSpec  # noqa: PLC0415

    cross = CrossAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32
    )
    with pytest.raises(UnsupportedKVGroups) as caught:
        KVGroups.from_kv_cache_config(_config(_attention(), cross))
    assert caught.value.groups == ("0:full_attention", "1:cross_attention")
    assert "group 1 is cross_attention" in str(caught.value)
    assert SUPPORTED_TEXT in str(caught.value)


def test_hybrid_refuses_other_unservable_layouts():
    """Different block sizes, a hash size other than the block size and
    retained window tokens are refused."""
    pytest.importorskip("vllm")
    with pytest.raises(UnsupportedKVGroups, match="block sizes differ"):
        KVGroups.from_kv_cache_config(
            _config(
                _attention(),
                _attention("swa", sliding_window=40, block_size=32),
            )
        )
    hashed = _config(_attention(), _attention("swa", sliding_window=40))
    hashed.hash_block_size = 8
    with pytest.raises(UnsupportedKVGroups, match="block hashes cover 8"):
        KVGroups.from_kv_cache_config(hashed)
    with pytest.raises(UnsupportedKVGroups, match="retains extra tokens"):
        KVGroups.from_kv_cache_config(
            _config(
                _attention(),
                _attention("swa", sliding_window=40, extra_retained_tokens=8),
            )
        )


def test_hybrid_connector_refuses_mamba_at_startup(
    extra, harnesses, monkeypatch
):
    """vLLM's start-up path: the connector's construction raises, before
    it takes a store client."""
    pytest.importorskip("vllm")
    import torch  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        KVConnectorRole,
    )
    from vllm.v1.kv_cache_interface import MambaSpec  # noqa: PLC0415

    from connector.integration.vllm_connector import (  # noqa: PLC0415
        MooncakeLifecycleConnector,
    )
    from connector.store import clients  # noqa: PLC0415
    from harness.hybrid import HybridHarness  # noqa: PLC0415
    from tests.connector_helpers import CONNECTOR  # noqa: PLC0415

    h = HybridHarness(CONNECTOR, extra_config=extra)
    harnesses.append(h)
    mamba = MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,))
    assert mamba.mamba_cache_mode == "none"  # no prefix caching

    taken = []
    acquire = clients.acquire

    def spy(config, **kwargs):
        taken.append(config)
        return acquire(config, **kwargs)

    monkeypatch.setattr(clients, "acquire", spy)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedKVGroups, match="1:mamba"):
            MooncakeLifecycleConnector(
                h.vllm_config, role, _config(_attention(), mamba)
            )
    assert taken == []  # refused before any store client is taken
