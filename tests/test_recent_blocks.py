"""`RecentBlocks`: bounded, expiring misses and own saves (fake clock)."""

import pytest

from connector.scheduler.recent import RecentBlocks

H = [bytes([i]) * 4 for i in range(8)]


@pytest.fixture
def clock():
    return [100.0]


def make(clock, **kwargs):
    return RecentBlocks(clock=lambda: clock[0], **kwargs)


def test_a_miss_is_trusted_until_its_ttl(clock):
    r = make(clock, ttl_s=1.0)
    r.missed(H[0])
    assert r.absent(H[0])
    assert r.cuts([H[2], H[0]])
    clock[0] += 0.999
    assert r.absent(H[0])
    clock[0] += 0.002
    assert not r.absent(H[0])
    assert not r.cuts([H[0]])
    assert len(r) == 0  # the expired entry is gone


def test_nothing_remembered_cuts_nothing(clock):
    r = make(clock)
    assert not r.cuts(H)
    assert not r.absent(H[0])


def test_oldest_miss_goes_first_beyond_capacity(clock):
    r = make(clock, capacity=2)
    for h in H[:3]:
        r.missed(h)
    assert not r.absent(H[0])
    assert r.absent(H[1])
    assert r.absent(H[2])


def test_saving_or_saved_forgets_the_miss(clock):
    r = make(clock)
    r.missed(H[0])
    r.missed(H[1])
    r.saving([H[0]])
    assert not r.absent(H[0])
    r.saved([H[1]])
    assert not r.absent(H[1])


def test_saved_prefix_is_the_leading_run_of_own_saves(clock):
    r = make(clock, capacity=3)
    r.saved(H[:3])
    assert r.saved_prefix(H[:5]) == 3
    assert r.saved_prefix([H[1], H[0]]) == 2
    assert r.saved_prefix([H[5], H[0]]) == 0
    r.saved([H[3]])  # capacity 3: H[0] is dropped
    assert r.saved_prefix(H[:4]) == 0


def test_a_block_saved_again_is_the_newest(clock):
    r = make(clock, capacity=3)
    r.saved(H[:3])
    r.saved([H[3], H[0]])  # H[0] again (newest), H[3] new: H[1] dropped
    assert r.saved_prefix([H[0]]) == 1
    assert r.saved_prefix([H[1]]) == 0
    r.saved([H[4]])  # then H[2], the oldest left
    assert r.saved_prefix([H[2]]) == 0
    assert r.saved_prefix([H[3], H[0], H[4]]) == 3


@pytest.mark.parametrize(("ttl", "cap"), [(0, 1), (1, 0), (-1, 1)])
def test_bounds_must_be_positive(ttl, cap):
    with pytest.raises(ValueError, match="positive"):
        RecentBlocks(ttl_s=ttl, capacity=cap)
