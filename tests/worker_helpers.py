"""Helpers for driving `connector.worker.side.WorkerSide` as a runner does.

Shared by the worker lifecycle tests and the CUDA path tests.  Nothing here
fakes the store: `Gate` wraps the real client and only delays calls.
"""

from __future__ import annotations

import threading
import time

import torch

from connector.metadata import ConnectorMeta, TransferJob
from connector.store import Regions
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.side import WorkerSide


class Gate:
    """The real store, with puts and/or gets held until `release()`.

    `once` holds only the first held call; `ended` is set when a held
    call has gone through to the store and returned.
    """

    def __init__(self, store, *, puts=True, gets=True, once=False):
        self.store = store
        self.held = {"put": puts, "get": gets}
        self.once = once
        self.entered = threading.Event()
        self.ended = threading.Event()
        self._open = threading.Event()

    def release(self):
        self._open.set()

    def _hold(self, op):
        if not self.held[op]:
            return False
        if self.once:
            self.held[op] = False
        self.entered.set()
        self._open.wait(30)
        return True

    def put(self, keys, regions):
        held = self._hold("put")
        result = self.store.put(keys, regions)
        if held:
            self.ended.set()
        return result

    def get(self, keys, regions):
        held = self._hold("get")
        result = self.store.get(keys, regions)
        if held:
            self.ended.set()
        return result


class JobMaker:
    """Builds transfer jobs whose hashes are unique to one test."""

    def __init__(self, unique):
        self.unique = unique

    def __call__(  # noqa: PLR0917
        self, job_id, kind, req_id, epoch, blocks, hashes, *, pinned=True
    ):
        return TransferJob(
            job_id=job_id,
            kind=kind,
            req_id=req_id,
            epoch=epoch,
            block_ids=tuple(blocks),
            block_hashes=tuple(f"{self.unique}/{h}".encode() for h in hashes),
            pinned=pinned,
        )


class Workers:
    """Shuts down workers and unregisters their memory at teardown."""

    def __init__(self, client):
        self.client = client
        self.made = []

    def add(self, worker):
        self.made.append(worker)
        return worker

    def close(self):
        """Unregister a worker's memory only once its transfers stopped."""
        for w in self.made:
            if w.shutdown(timeout=30):
                for ptr in w.registered:
                    self.client.unregister(ptr)


def block_parts(kv, b, num_blocks):
    """Every layer's part of block `b` (either KV layout)."""
    return [t[b] if t.shape[0] == num_blocks else t[:, b] for t in kv.values()]


def assert_same_blocks(kv_a, a_ids, kv_b, b_ids, num_blocks):
    for a, b in zip(a_ids, b_ids, strict=True):
        parts = zip(
            block_parts(kv_a, a, num_blocks),
            block_parts(kv_b, b, num_blocks),
            strict=True,
        )
        for x, y in parts:
            assert torch.equal(x, y), f"block {a} != block {b}"


def block_bytes(kv, b, num_blocks):
    """Block `b` as the store holds it: its pieces' bytes in layer order."""
    return torch.cat(
        [
            p.contiguous().view(torch.uint8).reshape(-1)
            for p in block_parts(kv, b, num_blocks)
        ]
    )


def read_back(client, keys, nbytes):
    """Get `keys` into a fresh registered buffer: (flags, rows)."""
    rows = torch.zeros((len(keys), nbytes), dtype=torch.uint8)
    client.register_tensor(rows)
    try:
        regions = Regions.blocks(rows.data_ptr(), nbytes, range(len(keys)))
        got = client.get(list(keys), regions).succeeded
    finally:
        client.unregister(rows.data_ptr())
    return got, rows


def assert_stored(client, keys, kv, block_ids, num_blocks):
    """Each key holds exactly block `block_ids[i]`'s bytes of `kv`."""
    expected = [block_bytes(kv, b, num_blocks) for b in block_ids]
    got, rows = read_back(client, keys, expected[0].numel())
    assert got == [True] * len(keys), f"not stored: {got}"
    for row, want, b in zip(rows, expected, block_ids, strict=True):
        diff = int((row != want).sum())
        assert diff == 0, f"stored block {b}: {diff} bytes differ"


def key_scheme(unique, kv, num_blocks, tokens, *, detail=None):
    """Keys for blocks of `kv` in the test's own namespace.

    The layout's detail is the first tensor's shape unless `detail`
    names another (a KV cache group's).
    """
    probe = next(iter(kv.values()))
    block_bytes = sum(
        t.numel() // num_blocks * t.element_size() for t in kv.values()
    )
    return KeyScheme(
        namespace=unique,
        model="m",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout(
            str(probe.dtype).removeprefix("torch."),
            block_tokens=tokens,
            block_bytes=block_bytes,
            detail=detail or f"{tuple(probe.shape)}",
        ),
    )


def make_worker(
    client,
    unique,
    kv,
    num_blocks,
    tokens,
    *,
    store=None,
    staging_blocks=None,
    load_timeout_s=None,
    spawn=None,
    layerwise_saves=False,
):
    """A worker over `kv` whose keys live in the test's own namespace."""
    return WorkerSide.for_kv_caches(
        store or client,
        key_scheme(unique, kv, num_blocks, tokens),
        kv,
        num_blocks,
        Regions,
        register=client.register,
        staging_blocks=staging_blocks,
        load_timeout_s=load_timeout_s,
        layerwise_save_blocks=staging_blocks if layerwise_saves else 0,
        **({} if spawn is None else {"spawn": spawn}),
    )


def step(w, meta):
    """One step's worker hooks, in the model runner's order."""
    w.handle_preemptions(meta)
    w.start_load_kv(meta)
    w.wait_for_save(meta)


def step_job(w, n, job):
    """Step `n` of the worker hooks with `job` as its only transfer job."""
    step(w, ConnectorMeta(step=n, jobs=(job,)))


def _poll(w, recving, results, errors):
    _, done = w.get_finished()
    if done:
        recving.append(done)
    errors |= w.get_block_ids_with_load_errors()
    report = w.build_report()
    if report:
        results.extend(report.results)


def settle(w, count, timeout=30.0):
    """Poll like the runner until `count` job results came back.

    Returns (receive completions per poll, job results, load errors).
    """
    recving, results, errors = [], [], set()
    end = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < end:
        _poll(w, recving, results, errors)
        time.sleep(0.005)
    for _ in range(3):  # nothing may be reported twice
        _poll(w, recving, results, errors)
    return recving, results, errors
