"""A steady decode step costs the scheduler half nothing per request.

vLLM 0.33's real scheduler with prompt-only saves: once every running
request's prompt is saved, `build_connector_meta` looks up no running
request; a request still being prefilled in chunks is visited every step
until its last save is issued, and all of its full prompt blocks are
saved.
"""

from __future__ import annotations

import pytest

from tests.connector_helpers import CONNECTOR, assert_clean, prompt, run, side

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BLOCK = 16


class _CountingRegistry:
    """The scheduler half's registry; counts `get` calls while counting."""

    def __init__(self, registry):
        self.registry = registry
        self.counting = False
        self.gets = 0

    def get(self, req_id):
        if self.counting:
            self.gets += 1
        return self.registry.get(req_id)

    def __getattr__(self, name):
        return getattr(self.registry, name)


def _step_counting(h, counter):
    """One step; the `get` calls its `build_connector_meta` made."""
    s = side(h)
    build = s.build_connector_meta

    def building(so):
        counter.counting = True
        try:
            return build(so)
        finally:
            counter.counting = False

    counter.gets = 0
    s.build_connector_meta = building
    try:
        h.step()
    finally:
        del s.build_connector_meta
    return counter.gets


def test_steady_decode_visits_no_running_request(extra, harnesses):
    pytest.importorskip("vllm")
    from harness import Harness  # noqa: PLC0415

    h = Harness(CONNECTOR, extra_config=extra, max_num_batched_tokens=48)
    harnesses.append(h)
    for i in range(4):
        h.add_request(f"s{i}", prompt(10 + i, 2 * BLOCK + 3), max_tokens=40)
    h.add_request("long", prompt(20, 10 * BLOCK + 3), max_tokens=40)
    s = side(h)
    counter = _CountingRegistry(s.registry)
    s.registry = counter
    try:
        prefill_gets = []
        for _ in range(30):
            gets = _step_counting(h, counter)
            tracker = counter.get("long")
            if tracker is None or tracker.num_saved_tokens >= 10 * BLOCK:
                break
            prefill_gets.append(gets)
        # The chunked prompt was visited while its saves were left.
        assert len(prefill_gets) >= 3
        assert all(n >= 1 for n in prefill_gets[1:])
        assert counter.get("long").num_saved_tokens == 10 * BLOCK
        # The step after its last save issued visits it once more (and
        # finds nothing left); then 5 running requests, none looked up.
        steady = [_step_counting(h, counter) for _ in range(5)]
        assert len(h.scheduler.running) == 5
        assert steady[0] <= 1
        assert steady[1:] == [0] * 4
    finally:
        s.registry = counter.registry
    run(h)
    assert_clean(h)
