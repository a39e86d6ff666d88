"""No wasted step: vLLM 0.33's real scheduler admits a request at once
when its answer is already known, over a real master.

A lookup runs off the scheduler thread, so a request whose answer is not
known costs one step ("cannot tell yet").  Two answers are known without
asking: vLLM's local prefix cache already covers every block a load
could fill (a full local hit), and a block up to the first loadable one
missed moments ago (`connector.scheduler.recent.RecentBlocks`).  A stale
memory of a miss costs a miss, never a wrong hit: the harness checks
every computed block's KV.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness import Harness
from tests.connector_helpers import (
    CONNECTOR,
    assert_clean,
    prompt,
    run,
    side,
    store_prefix,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture
def make(extra, harnesses):
    def _make(**kwargs):
        h = Harness(CONNECTOR, extra_config=extra, **kwargs)
        harnesses.append(h)
        return h

    return _make


def _missed(h, req_id, tokens):
    """`req_id` asks for `tokens`, misses, and is aborted before it ran."""
    h.add_request(req_id, tokens, max_tokens=2)
    report = h.step()  # asks; the harness waits for the lookup
    assert req_id not in report.scheduled
    h.abort(req_id)
    h.step()  # the answer is taken: its first block is a recent miss


def test_full_local_hit_is_admitted_in_its_first_step(make):
    h = make(num_blocks=40)
    h.add_request("a", prompt(1, 64), max_tokens=2)
    run(h)
    started = side(h).lookup_counts["started"]

    h.add_request("b", prompt(1, 64), max_tokens=2)  # all of it local
    report = h.step()

    assert "b" in report.scheduled
    assert side(h).lookup_counts["started"] == started  # nothing asked
    assert side(h).lookup_counts["local"] >= 1
    run(h)
    assert h.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 2}
    assert_clean(h)


def test_recent_miss_is_admitted_in_its_first_step(make):
    h = make(num_blocks=40)
    _missed(h, "a", prompt(2, 64))
    started = side(h).lookup_counts["started"]

    h.add_request("b", [*prompt(2, 64), 7, 8, 9], max_tokens=2)
    report = h.step()

    assert "b" in report.scheduled
    assert side(h).lookup_counts["started"] == started
    assert side(h).lookup_counts["known_miss"] == 1
    run(h)
    assert h.finished_by_status()["FINISHED_LENGTH_CAPPED"] == 1
    assert_clean(h)


def test_a_cold_prefix_still_waits_one_step(make):
    h = make(num_blocks=40)
    h.add_request("c", prompt(3, 64), max_tokens=2)

    first = h.step()
    second = h.step()

    assert "c" not in first.scheduled  # asked, off the scheduler thread
    assert "c" in second.scheduled
    run(h)
    assert_clean(h)


def test_with_a_lookup_wait_a_cold_prefix_runs_in_its_first_step(
    extra, harnesses
):
    """``lookup_wait_ms``: the lookup is answered inside the hook."""
    h = Harness(
        CONNECTOR,
        extra_config={**extra, "lookup_wait_ms": 2000},
        num_blocks=40,
    )
    harnesses.append(h)
    h.add_request("c", prompt(3, 64), max_tokens=2)

    first = h.step()

    assert "c" in first.scheduled
    assert side(h).lookup_counts["waited"] == 1
    run(h)
    assert_clean(h)


def test_with_a_lookup_wait_a_burst_is_asked_as_it_arrives(
    extra, harnesses, make
):
    """With ``lookup_wait_ms`` the lookups leave in ``on_new_request``:
    a burst of 16 store hits (another instance stored their prefixes)
    reaches the master in a call or two and every request runs, loading
    layer-wise, in its first step with its hit; a prompt vLLM's prefix
    cache holds (the bound block pool tells) is not asked at all."""
    a = make(num_blocks=200)  # another instance, alive: its segment
    for i in range(16):
        a.add_request(f"a{i}", prompt(40 + i, 64), max_tokens=2)
    run(a)
    h = Harness(
        CONNECTOR,
        extra_config={
            **extra,
            "lookup_wait_ms": 2000,
            "lookup_timeout_ms": 10_000,  # a loaded machine's pause
            "layerwise_load_max_blocks": 8,
        },
        num_blocks=200,
        max_num_seqs=32,
    )
    harnesses.append(h)
    h.add_request("local", prompt(6, 64), max_tokens=2)
    run(h)
    calls = side(h).lookups.store_calls
    started = side(h).lookup_counts["started"]
    arrived = side(h).lookup_counts["on_arrival"]  # "local"'s

    h.add_request("again", prompt(6, 64), max_tokens=2)  # all of it local
    for i in range(16):
        h.add_request(f"b{i}", [*prompt(40 + i, 64), 1], max_tokens=2)
    assert side(h).lookup_counts["on_arrival"] == arrived + 16
    report = h.step()

    assert {"again", *(f"b{i}" for i in range(16))} <= set(report.scheduled)
    assert side(h).lookup_counts["started"] == started + 16
    assert side(h).lookups.store_calls - calls <= 2
    assert all(h.external_hits.get(f"b{i}", 0) == 64 for i in range(16))
    run(h)
    assert_clean(h)


def test_a_stale_miss_costs_a_miss(make):
    """Another instance saves a remembered miss: b computes it."""
    h = make(num_blocks=40)
    _missed(h, "a", prompt(4, 64))
    store_prefix(make, 4, 64)  # the store holds it now

    h.add_request("b", [*prompt(4, 64), 1], max_tokens=2)
    report = h.step()  # the memory says "absent": a miss, at once

    assert "b" in report.scheduled
    assert h.external_hits.get("b", 0) == 0
    run(h)  # b computed its KV; the harness checked every block
    assert side(h).lookup_counts["known_miss"] == 1

    assert_clean(h)


def test_own_save_clears_a_remembered_miss(make):
    h = make(num_blocks=40)
    _missed(h, "a", prompt(5, 64))
    h.add_request("b", [*prompt(5, 64), 1], max_tokens=2)
    run(h)  # answered a miss at once; computes the prefix and saves it
    assert side(h).lookup_counts["known_miss"] == 1
    started = side(h).lookup_counts["started"]

    # Beyond b's blocks (local), so the store is asked again.
    h.add_request("c", [*prompt(5, 64), *prompt(6, 48)], max_tokens=2)
    run(h)

    assert side(h).lookup_counts["known_miss"] == 1
    assert side(h).lookup_counts["started"] == started + 1
    assert_clean(h)
