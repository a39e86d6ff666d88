"""The scheduler-thread guard itself, and the lookup path under it.

`tests/conftest.py` runs every test under `SchedulerThreadGuard`; these
tests show it fails a store call made inside a scheduler hook (so its
silence elsewhere means something), and that the connector's own lookup
path, driven by vLLM 0.33's real scheduler, makes its store calls on the
lookup thread only.
"""

from __future__ import annotations

import threading

import pytest

from connector.scheduler.side import Role, SchedulerSide
from connector.store.keys import KeyLayout, KeyScheme
from tests.scheduler_guard import StoreCallInSchedulerHook

pytestmark = [pytest.mark.mooncake]

BS = 16


class _Request:
    def __init__(self, req_id: str, hashes: list[bytes]) -> None:
        self.request_id = req_id
        self.block_hashes = hashes
        self.num_prompt_tokens = len(hashes) * BS + 1
        self.num_tokens = self.num_prompt_tokens


class _Out:
    def __init__(self) -> None:
        self.preempted_req_ids = ()
        self.scheduled_new_reqs = ()
        self.num_scheduled_tokens = {}
        self.finished_req_ids = set()

        class _Cached:
            req_ids = ()
            new_block_ids = ()
            num_computed_tokens = ()
            resumed_req_ids = ()

        self.scheduled_cached_reqs = _Cached()


def _side(store_client, *, threaded: bool) -> SchedulerSide:
    from connector.scheduler.store_lookup import StoreLookup  # noqa: PLC0415

    scheme = KeyScheme(
        namespace="guard",
        model="m",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", BS, 64, detail="x"),
    )
    return SchedulerSide(
        block_size=BS,
        role=Role.BOTH,
        lookup=StoreLookup(store_client, (scheme,)),
        threaded_lookups=threaded,
    )


def test_guard_fails_a_store_call_inside_a_hook(
    store_client, scheduler_thread_guard
):
    """A lookup run synchronously inside a hook is caught and raised."""
    side = _side(store_client, threaded=False)
    request = _Request("r", [bytes([i]) * 8 for i in range(3)])
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    dispatch = side.lookups.dispatch

    def dispatch_and_run() -> int:  # the old, synchronous behaviour
        n = dispatch()
        side.lookups.run_pending()
        return n

    side.lookups.dispatch = dispatch_and_run  # type: ignore[method-assign]
    # The lookup swallows the raised error (a lookup is best effort), so
    # the guard's record is what fails the test.
    side.build_connector_meta(_Out())
    assert side.lookups.failures == 1
    assert scheduler_thread_guard.violations == [
        "build_connector_meta called StoreClient.exists"
    ]
    scheduler_thread_guard.violations.clear()  # expected here
    with pytest.raises(StoreCallInSchedulerHook):
        scheduler_thread_guard._hook(
            "get_num_new_matched_tokens",
            lambda: store_client.exists(["k"]),
        )()
    scheduler_thread_guard.violations.clear()


def test_lookups_call_the_store_from_their_own_thread(
    store_client, scheduler_thread_guard
):
    """The same lookup, dispatched as the connector does, passes."""
    side = _side(store_client, threaded=True)
    threads = []
    real = side._lookup

    class Spy:
        def hit_blocks_many(self, prefixes):
            threads.append(threading.current_thread().name)
            return real.hit_blocks_many(prefixes)

    side._lookup = Spy()
    try:
        request = _Request("r", [bytes([i]) * 8 for i in range(3)])
        assert side.get_num_new_matched_tokens(request, 0) == (None, False)
        side.build_connector_meta(_Out())
        assert side.wait_for_lookups(10.0)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert threads == ["kv-lookup"]
        assert scheduler_thread_guard.store_calls >= 1
        assert scheduler_thread_guard.violations == []
    finally:
        side.close()
