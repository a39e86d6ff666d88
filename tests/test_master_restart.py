"""Sharing survives a master restart; a store that cannot transfer shows.

Real `mooncake_master`, real clients.  An instance is one process with
the clients a vLLM instance runs: a contributing client (the worker's,
with a segment) and a pure one (the scheduler's lookups, no segment).
The master's embedded HTTP metadata server forgets every client's
transfer metadata when it restarts (issue 31): Mooncake publishes a
contributing client's entries again only once its heartbeat re-mounts
the segment, and a pure client's never; `connector.store.metadata`
restores them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import attrs
import pytest
import torch

from connector.integration.stats import StatsSource
from connector.ops.master import store_config_for
from connector.store import Outcome, Regions, StoreClient
from connector.store.metadata import MetadataKeeper, metadata_keys

pytestmark = pytest.mark.mooncake

MiB = 1024 * 1024
BLOCK = 64 * 1024
N = 4
MASTER_DOWN_S = 8.0  # the operators' restart of issue 31
SHARING_BOUND_S = 10.0  # B loads A's fresh keys this soon after


def _status(url: str, key: str) -> int:
    """The metadata server's HTTP status for ``key``."""
    try:
        with urllib.request.urlopen(  # noqa: S310 - loopback test server
            f"{url}?key={urllib.parse.quote(key, safe='')}", timeout=2
        ) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _delete(url: str, key: str) -> None:
    request = urllib.request.Request(  # noqa: S310 - loopback test server
        f"{url}?key={urllib.parse.quote(key, safe='')}", method="DELETE"
    )
    with urllib.request.urlopen(request, timeout=2):  # noqa: S310
        pass


def instance(config, conn, *, replica_reads: bool) -> None:
    """Spawned: a contributing and a pure client; serves commands."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    if not replica_reads:
        import connector.store.client as client_module  # noqa: PLC0415

        client_module._open_reader = lambda *_: None  # the engine off
    worker = StoreClient.open(config)
    lookup = StoreClient.open(attrs.evolve(config, global_segment_size=0))
    buf = torch.zeros(N * BLOCK, dtype=torch.uint8)
    worker.register_tensor(buf)
    regions = Regions.blocks(buf.data_ptr(), BLOCK, range(N))
    conn.send((worker.hostname, lookup.hostname, worker.replica_reads))
    while True:
        op, arg = conn.recv()
        keys = [f"{config.namespace}-{arg}-{i}" for i in range(N)]
        if op == "put":
            buf.fill_(int(arg[-2:], 16))
            conn.send([o.name for o in worker.put(keys, regions)])
        elif op == "exists":
            conn.send([o.name for o in lookup.exists(keys)])
        elif op == "get":
            buf.zero_()
            got = worker.get(keys, regions)
            conn.send(([o.name for o in got], buf.tolist()[::BLOCK]))
        elif op == "faults":
            conn.send((worker.stats.faults_copy(), lookup.stats.faults_copy()))
        else:
            break
    lookup.close()
    worker.close()


@contextlib.contextmanager
def two_instances(master, config, replica_reads):
    """(A, B): connections to two spawned instances, and their names."""
    ctx = multiprocessing.get_context("spawn")
    procs, conns, names = [], [], []
    try:
        for _ in range(2):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=instance,
                args=(config, there),
                kwargs={"replica_reads": replica_reads},
            )
            proc.start()
            procs.append(proc)
            conns.append(here)
        for conn in conns:
            assert conn.poll(120), "an instance did not start"
            worker, lookup, reads = conn.recv()
            assert reads is replica_reads
            names.append((worker, lookup))
        yield conns, names
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", ""))
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def ask(conn, op, arg=""):
    conn.send((op, arg))
    assert conn.poll(60), (op, arg)
    return conn.recv()


@pytest.mark.parametrize(
    "replica_reads", [True, False], ids=["replica-reads", "no-replica-reads"]
)
def test_sharing_resumes_after_a_master_restart(
    start_master, unique, replica_reads
):
    """After an 8 s outage and a restart on the same ports, B loads keys
    A stores within 10 s of the master answering, and every client's
    transfer metadata is published again (a pure client's included)."""
    master = start_master(lease_ttl_ms=500)
    config = store_config_for(
        master,
        global_segment_size=32 * MiB,
        namespace=f"restart-{unique}",
        local_hostname="127.0.0.1",
    )
    with two_instances(master, config, replica_reads) as (conns, names):
        a, b = conns
        assert ask(a, "put", "before-a1") == ["STORED"] * N
        assert ask(b, "get", "before-a1")[0] == ["HIT"] * N
        url = master.metadata_server
        keys = [k for pair in names for n in pair for k in metadata_keys(n)]
        assert {_status(url, k) for k in keys} == {200}

        master.kill()
        time.sleep(MASTER_DOWN_S)
        master.restart()
        answering = time.monotonic()

        shared_after = None
        for i in range(200):
            if time.monotonic() - answering > 3 * SHARING_BOUND_S:
                break
            prefix = f"after-{i:02x}"
            ask(a, "put", prefix)
            ask(b, "exists", prefix)  # B's lookup client, as vLLM's
            outcomes, firsts = ask(b, "get", prefix)
            if outcomes == ["HIT"] * N:
                assert firsts == [i % 256] * N  # A's bytes
                shared_after = time.monotonic() - answering
                break
            time.sleep(0.2)
        print(f"first cross-instance hit {shared_after} s after restart")
        assert shared_after is not None, "B never loaded A's keys again"
        assert shared_after <= SHARING_BOUND_S, shared_after

        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            missing = [k for k in keys if _status(url, k) != 200]
            if not missing:
                break
            time.sleep(0.2)
        assert missing == [], "the restarted master never got these back"
        for conn in conns:
            _, lookup_faults = ask(conn, "faults")
            # Mooncake never publishes a pure client's entries again.
            assert lookup_faults.get("metadata_restored", 0) >= 1


def test_a_store_that_cannot_transfer_is_counted_and_logged(
    start_master, unique, caplog
):
    """A reader whose peer's transfer metadata is gone gets -800: the
    keys count as transfer faults (client counters, the stats payload),
    one WARNING covers repeated failures; restoring the entries makes
    the same get hit."""
    master = start_master(lease_ttl_ms=500)
    config = store_config_for(
        master,
        global_segment_size=16 * MiB,
        namespace=f"faults-{unique}",
        local_hostname="127.0.0.1",
    )
    owner = StoreClient.open(config)
    reader = StoreClient.open(attrs.evolve(config, global_segment_size=0))
    try:
        src = torch.arange(N * BLOCK, dtype=torch.int64).to(torch.uint8)
        dst = torch.zeros(N * BLOCK, dtype=torch.uint8)
        owner.register_tensor(src)
        reader.register_tensor(dst)
        keys = [f"{config.namespace}-{i}" for i in range(N)]
        put = owner.put(keys, Regions.blocks(src.data_ptr(), BLOCK, range(N)))
        assert put.num_failed == 0
        # What a restarted master's metadata server has forgotten; the
        # owner's own watch is stopped so that nothing restores it yet.
        keeper = MetadataKeeper(master.metadata_server, owner.hostname)
        assert keeper.check().missing == 0  # remembers both entries
        owner._watch.stop()
        for key in metadata_keys(owner.hostname):
            _delete(master.metadata_server, key)
        source = StatsSource(store=reader.stats, half="worker")
        caplog.set_level(logging.WARNING, logger="connector.store.client")
        regions = Regions.blocks(dst.data_ptr(), BLOCK, range(N))
        for _ in range(3):
            got = reader.get(keys, regions)
            assert list(got) == [Outcome.TRANSFER_FAILED] * N, got.codes
        assert reader.stats.faults_copy() == {"transfer": 3 * N}
        warnings = [
            r for r in caplog.records if "cannot transfer" in r.getMessage()
        ]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "-800" in warnings[0].getMessage()
        stats = source.take()
        assert stats is not None
        assert stats.data["store_faults"] == {"transfer": 3 * N}
        assert stats.data["store"]["get"]["failures"] == {
            "TRANSFER_FAILED": 3 * N
        }

        assert keeper.check().restored == 2
        got = reader.get(keys, regions)
        assert list(got) == [Outcome.HIT] * N
        assert torch.equal(dst, src)
    finally:
        reader.close()
        owner.close()
