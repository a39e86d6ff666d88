"""The worker side's seams: injectable job loops, and its thread rule.

Three threads touch the worker's registry: the model runner's (the
hooks) and the load and save loops (completions).  The rule: the
registry and its trackers are read and changed only under the side's
lock.  A registry that checks the lock on every call, over a real master
and real transfer threads, shows it holds.

`make()` hands the worker KV tensors and drops them at once, as a caller
may: the worker must hold them while its transfers can touch them.  Every
save is read back and compared with the source values (`kv_caches()` is
seeded), so a save or load through freed memory fails here (and, under
`scripts/malloc_check.py`, crashes loudly).
"""

from __future__ import annotations

import threading

import pytest
import torch

from connector.metadata import ConnectorMeta, JobKind
from connector.worker.side import daemon_thread
from tests.worker_helpers import (
    JobMaker,
    assert_stored,
    make_worker,
    settle,
    step,
)

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 8
TOKENS = 4
LOAD, SAVE = JobKind.LOAD, JobKind.SAVE


def kv_caches():
    gen = torch.Generator().manual_seed(0)
    return {
        f"l{i}": torch.randn((NUM_BLOCKS, TOKENS, 16), generator=gen)
        for i in range(2)
    }


class LockChecked:
    """A registry that records every call made without `lock` held."""

    def __init__(self, registry, lock):
        self._registry = registry
        self._lock = lock
        self.violations = []
        self.calls = 0

    def _check(self, name):
        self.calls += 1
        if not self._lock._is_owned():
            thread = threading.current_thread().name
            self.violations.append(f"{name} on {thread}")

    def __getattr__(self, name):
        attr = getattr(self._registry, name)
        if not callable(attr):
            return attr

        def checked(*args, **kwargs):
            self._check(name)
            return attr(*args, **kwargs)

        return checked

    def __iter__(self):
        self._check("__iter__")
        return iter(self._registry)

    def __len__(self):
        return len(self._registry)


@pytest.fixture
def make(store_client, unique, workers):
    def _make(**kwargs):
        return workers.add(
            make_worker(
                store_client, unique, kv_caches(), NUM_BLOCKS, TOKENS, **kwargs
            )
        )

    return _make


def test_registry_is_only_touched_under_the_lock(make, unique, store_client):
    job = JobMaker(unique)
    w = make()
    checked = w.registry = LockChecked(w.registry, w._lock)

    source = kv_caches()  # the values `make` handed over (seeded)
    save = job(1, SAVE, "a", 0, [0, 1], "xy")
    step(w, ConnectorMeta(step=1, jobs=(save,)))
    settle(w, 1)
    assert_stored(store_client, w._keys.keys(save.block_hashes), source,
                  [0, 1], NUM_BLOCKS)  # fmt: skip
    step(w, ConnectorMeta(step=2, jobs=(job(2, LOAD, "b", 0, [2, 3], "xy"),)))
    assert settle(w, 1)[0] == [{"b"}]
    # Blocks 2 and 3 now hold what blocks 0 and 1 held: save them again.
    again = job(3, SAVE, "c", 0, [2, 3], "zw")
    step(w, ConnectorMeta(step=3, jobs=(again,)))
    step(w, ConnectorMeta(step=4, preempted=(("c", 1),)))
    settle(w, 1)
    assert w.open_jobs == 0
    assert_stored(store_client, w._keys.keys(again.block_hashes), source,
                  [0, 1], NUM_BLOCKS)  # fmt: skip
    step(w, ConnectorMeta(step=5, finished=frozenset({"a", "b", "c"})))

    assert checked.calls > 10  # hooks and both transfer threads
    assert checked.violations == []
    assert dict(w.machine.illegal_counts) == {}


def test_job_loops_start_through_the_injected_spawn(
    make, unique, store_client
):
    job = JobMaker(unique)
    started = []

    def spawn(name, target):
        started.append(name)
        return daemon_thread(name, target)

    w = make(spawn=spawn)
    assert sorted(started) == ["kv-lifecycle-load", "kv-lifecycle-save"]
    save = job(1, SAVE, "a", 0, [5], "q")
    step(w, ConnectorMeta(step=1, jobs=(save,)))
    _, results, _ = settle(w, 1)
    assert [r.ok for r in results] == [1]
    assert_stored(store_client, w._keys.keys(save.block_hashes), kv_caches(),
                  [5], NUM_BLOCKS)  # fmt: skip
    assert w.shutdown(timeout=10)


def test_loops_run_only_where_the_spawn_runs_them(make, unique, store_client):
    """A spawn that holds the loops back: jobs wait, then run."""
    job = JobMaker(unique)
    loops = {}

    class Later:
        def __init__(self, target):
            self.thread = threading.Thread(target=target, daemon=True)

        def join(self, timeout=None):
            self.thread.join(timeout)

        def is_alive(self):
            return self.thread.is_alive()

    def spawn(name, target):
        loops[name] = Later(target)
        return loops[name]

    w = make(spawn=spawn)
    save = job(1, SAVE, "a", 0, [7], "r")
    step(w, ConnectorMeta(step=1, jobs=(save,)))
    assert settle(w, 1, timeout=0.2)[1] == []  # no loop runs it yet
    for loop in loops.values():
        loop.thread.start()
    _, results, _ = settle(w, 1)
    assert [r.ok for r in results] == [1]
    assert_stored(store_client, w._keys.keys(save.block_hashes), kv_caches(),
                  [7], NUM_BLOCKS)  # fmt: skip
