"""Pure parts of issue 31's fix: fault classification, the rate-limited
warning, the metadata keeper (no master, no torch: the Python matrix
runs them)."""

from __future__ import annotations

import json
import logging

from connector.store.codes import Op, Outcome
from connector.store.faults import RateLimitedWarning, transfer_faults
from connector.store.metadata import (
    MetadataKeeper,
    metadata_keys,
    published_regions,
)


def test_transfer_faults_are_failures_the_master_answered():
    codes = [-704, -800, -900, -200, 0, -600]
    outcomes = [
        Outcome.MISS,
        Outcome.TRANSFER_FAILED,
        Outcome.MASTER_UNREACHABLE,
        Outcome.STORE_FULL,
        Outcome.HIT,
        Outcome.INVALID,
    ]
    assert transfer_faults(Op.GET, outcomes, codes) == {-800: 1, -600: 1}
    put = transfer_faults(Op.PUT, outcomes, codes)
    assert put == {-800: 1, -600: 1, -200: 1}
    assert not transfer_faults(Op.EXISTS, [Outcome.MISS] * 3, [-704] * 3)


def test_rate_limited_warning_reports_what_it_held(caplog):
    now = [0.0]
    warn = RateLimitedWarning(
        logging.getLogger("test.rate"), 30.0, clock=lambda: now[0]
    )
    caplog.set_level(logging.WARNING, logger="test.rate")
    assert warn.note("k", 2, "x %s", "a")
    now[0] = 10.0
    assert not warn.note("k", 3, "x %s", "b")
    assert warn.note("other", 1, "y")  # kinds are limited apart
    now[0] = 31.0
    assert warn.note("k", 1, "x %s", "c")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert messages[0].startswith("x a (2 since")
    assert messages[2].startswith("x c (4 since")  # 3 held + 1


def test_metadata_keeper_restores_only_what_it_saw(monkeypatch):
    keeper = MetadataKeeper("http://127.0.0.1:1/metadata", "h:1")
    store: dict[str, bytes] = {}
    puts: list[str] = []
    monkeypatch.setattr(keeper, "_get", store.get)

    def put(key: str, value: bytes) -> None:
        puts.append(key)
        store[key] = value

    monkeypatch.setattr(keeper, "_put", put)
    ram, rpc = metadata_keys("h:1")
    assert keeper.check().missing == 2  # never seen: nothing restored
    assert puts == []
    store.update({ram: b"r1", rpc: b"p1"})
    assert keeper.check().missing == 0
    store[ram] = b"r2"  # a later register_buffer re-published it
    keeper.check()
    store.clear()
    result = keeper.check()
    assert (result.missing, result.restored) == (2, 2)
    assert store == {ram: b"r2", rpc: b"p1"}
    assert MetadataKeeper.for_server("P2PHANDSHAKE", "h:1") is None
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "c1")
    assert metadata_keys("h:1") == (
        "mooncake/c1/ram/h:1",
        "mooncake/c1/rpc_meta/h:1",
    )


def _descriptor(*regions: tuple[int, int]) -> bytes:
    buffers = [{"addr": a, "length": n, "name": "h:1"} for a, n in regions]
    return json.dumps({"name": "h:1", "buffers": buffers}).encode()


def test_metadata_keeper_republishes_a_descriptor_that_lost_a_region(
    monkeypatch,
):
    registered = {(4096, 64), (8192, 64)}
    republished: list[int] = []
    keeper = MetadataKeeper("http://127.0.0.1:1/metadata", "h:1")
    keeper.follow(lambda: set(registered), lambda: not republished.append(1))
    ram, rpc = metadata_keys("h:1")
    store = {ram: _descriptor((1, 2), (4096, 64), (8192, 64)), rpc: b"p"}
    monkeypatch.setattr(keeper, "_get", store.get)
    monkeypatch.setattr(keeper, "_put", store.__setitem__)
    assert keeper.check().stale == 0  # lists all it registered
    store[ram] = _descriptor((1, 2), (4096, 64))  # an older copy won
    result = keeper.check()
    assert (result.stale, result.republished) == (1, True)
    assert republished == [1]
    assert result.missing == 0
    registered.discard((8192, 64))  # unregistered: not stale any more
    assert keeper.check().stale == 0
    registered.add((8192, 64))
    assert keeper.check(lambda: True).stale == 0  # closing: not checked
    assert republished == [1]
    store[ram] = b"not json"
    assert keeper.check().stale == 0
    assert published_regions(b"{}") is None
    assert published_regions(_descriptor((5, 6))) == {(5, 6)}
