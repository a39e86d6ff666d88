"""A get whose replica's owner died is read again from another replica.

Real `mooncake_master`, real clients: an owner process puts blocks with
``replica_num = 2`` (one replica in its own segment, one in a holder's),
then is SIGKILLed; a reader with no segment of its own gets them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import attrs
import pytest
import torch

from connector.ops.master import store_config_for
from connector.store import Op, Outcome, Regions, StoreClient
from connector.store.keys import KeyLayout, KeyScheme

pytestmark = pytest.mark.mooncake

BLOCK = 64 * 1024
N = 12
MiB = 1024 * 1024


def block(index: int) -> torch.Tensor:
    """Deterministic content, computable in either process."""
    gen = torch.Generator().manual_seed(7000 + index)
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=gen)


def keys_for(namespace: str) -> list[str]:
    return KeyScheme(
        namespace=namespace,
        model="replica-reads",
        tp_rank=0,
        tp_size=1,
        layout=KeyLayout("uint8", 16, BLOCK),
    ).keys(range(N))


def owner(config, namespace: str, queue, stop) -> None:
    """Spawned: put the blocks with two replicas, report, wait to die."""
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    try:
        client = StoreClient.open(config)
        src = torch.stack([block(i) for i in range(N)])
        client.register_tensor(src)
        put = client.put(
            keys_for(namespace),
            Regions.blocks(src.data_ptr(), BLOCK, range(N)),
        )
        queue.put({"put": [o.name for o in put], "hostname": client.hostname})
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put({"error": repr(exc)})
        return
    stop.wait(120)  # SIGKILLed long before


@contextlib.contextmanager
def _owner_gone(start_master, unique, sig):
    """A master, a holder client, and blocks whose other owner got `sig`.

    Yields ``(config, namespace, holder, owner_segment)``.
    """
    master = start_master(lease_ttl_ms=500, client_ttl_s=60)
    config = store_config_for(
        master,
        global_segment_size=16 * MiB,
        namespace="replicas",
        replica_num=2,
        rpc_timeout_ms=10_000,  # a loaded machine: no master call times out
    )
    namespace = f"rr-{unique}"
    holder = StoreClient.open(config)
    ctx = multiprocessing.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=owner, args=(config, namespace, queue, stop))
    proc.start()
    try:
        report = queue.get(timeout=120)
        assert "error" not in report, report
        assert report["put"] == ["STORED"] * N
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.join(timeout=30)
        yield config, namespace, holder, report["hostname"]
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        holder.close()


@pytest.fixture
def dead_owner(start_master, unique):
    """Blocks with two replicas whose first owner was SIGKILLed."""
    with _owner_gone(start_master, unique, signal.SIGKILL) as made:
        yield made


@pytest.fixture
def hung_owner(start_master, unique, monkeypatch):
    """Blocks with two replicas whose first owner is SIGSTOPped; the TCP
    transport gives up on a silent peer after 1 s."""
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "1")
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "1")
    with _owner_gone(start_master, unique, signal.SIGSTOP) as made:
        yield made


def _reader(config) -> StoreClient:
    """A client with no segment: every replica it reads is remote."""
    return StoreClient.open(
        attrs.evolve(config, global_segment_size=0), check_regions=True
    )


def test_get_reads_the_surviving_replica_when_the_owner_is_dead(dead_owner):
    """Keys whose first replica lived in the dead owner still HIT,
    byte-exact, through one raw read of the holder's replica."""
    config, namespace, holder, dead = dead_owner
    keys = keys_for(namespace)
    with _reader(config) as reader:
        assert reader.replica_reads
        replicas = reader.replicas(keys)
        assert all(
            {r.endpoint for r in found} == {dead, holder.hostname}
            for found in replicas
        ), replicas
        # Keys a plain get reads from the dead owner (the master's first).
        on_dead = [
            i for i, found in enumerate(replicas) if found[0].endpoint == dead
        ]
        assert on_dead, "no key listed the dead owner first: nothing tested"
        out = torch.zeros((N, BLOCK), dtype=torch.uint8)
        reader.register_tensor(out)
        got = reader.get(keys, Regions.blocks(out.data_ptr(), BLOCK, range(N)))
        retried = reader.stats[Op.REPLICA_GET]
        assert got.outcomes == [Outcome.HIT] * N, (got, retried, on_dead)
        assert got.codes == [BLOCK] * N
        for i in range(N):
            assert torch.equal(out[i], block(i)), i
        assert got.failed_segments == {dead}
        # Mooncake may fail the whole batch (a transfer to the dead owner
        # fails its neighbours too): then the holder-first keys are
        # retried as well, and served from the holder once it answered.
        assert retried.keys >= len(on_dead)
        assert retried.failures == {}
        assert retried.bytes == retried.keys * BLOCK


def test_get_reads_the_live_replica_when_the_owner_hangs(hung_owner):
    """A hung owner fails the whole get (Mooncake fails every key of a
    batch with a stalled transfer, the live segment's too): each key is
    read from the live holder, byte-exact, and only the hung owner is
    reported as the failed segment."""
    config, namespace, holder, hung = hung_owner
    keys = keys_for(namespace)
    with _reader(config) as reader:
        out = torch.zeros((N, BLOCK), dtype=torch.uint8)
        reader.register_tensor(out)
        got = reader.get(keys, Regions.blocks(out.data_ptr(), BLOCK, range(N)))
        retried = reader.stats[Op.REPLICA_GET]
        assert got.outcomes == [Outcome.HIT] * N, (got, retried)
        for i in range(N):
            assert torch.equal(out[i], block(i)), i
        assert got.failed_segments == {hung}
        assert holder.hostname not in got.failed_segments


def test_read_replicas_avoids_a_fenced_segment(dead_owner):
    """`read_replicas` never reads a segment in ``avoid``: with the holder
    fenced, only the dead owner is tried (and fails); with the dead owner
    fenced, every key is read from the holder, byte-exact."""
    config, namespace, holder, dead = dead_owner
    keys = keys_for(namespace)
    with _reader(config) as reader:
        out = torch.zeros((N, BLOCK), dtype=torch.uint8)
        reader.register_tensor(out)
        regions = Regions.blocks(out.data_ptr(), BLOCK, range(N))
        firsts = [found[0].endpoint for found in reader.replicas(keys)]
        assert dead in firsts, "no key listed the dead owner first"
        fenced = reader.read_replicas(keys, regions, avoid={holder.hostname})
        # The holder-first keys' other replica is the dead owner: tried,
        # failed; the dead-first keys' other replica is fenced: not tried.
        assert fenced.outcomes == [Outcome.TRANSFER_FAILED] * N
        assert reader.stats[Op.REPLICA_GET].keys == firsts.count(
            holder.hostname
        )
        assert not out.any()
        # Dead-first keys: their other replica; holder-first keys: their
        # own segment, once the holder answered a raw read.
        live = reader.read_replicas(keys, regions, avoid={dead})
        assert live.outcomes == [Outcome.HIT] * N, (live, firsts)
        for i in range(N):
            assert torch.equal(out[i], block(i)), i


def test_a_replica_of_another_size_is_never_read(dead_owner, caplog):
    """A region that is not the stored object's size: the retry refuses
    it (INVALID, code = the replica's size), and writes nothing."""
    config, namespace, _, _ = dead_owner
    keys = keys_for(namespace)
    short = BLOCK // 2
    with _reader(config) as reader:
        out = torch.zeros((N, short), dtype=torch.uint8)
        reader.register_tensor(out)
        regions = Regions.blocks(out.data_ptr(), short, range(N))
        with caplog.at_level(logging.WARNING, logger="connector.store.client"):
            got = reader.read_replicas(keys, regions)
        assert got.outcomes == [Outcome.INVALID] * N
        assert got.codes == [BLOCK] * N
        assert not out.any()
        assert reader.stats[Op.REPLICA_GET].failures == {Outcome.INVALID: N}
        assert "not read" in caplog.text


def test_registered_regions_are_published_by_the_clients_engine(
    store_config, caplog
):
    """The store runs on the client's own engine: the segment descriptor
    that engine publishes (under the store's name) lists the store's
    segment and every `register` region, so raw reads land in them."""
    with (
        caplog.at_level(logging.WARNING, logger="connector.store.client"),
        StoreClient.open(store_config) as client,
    ):
        assert client.replica_reads, caplog.text
        out = torch.zeros(BLOCK, dtype=torch.uint8)
        client.register_tensor(out)
        key = urllib.parse.quote(f"mooncake/ram/{client.hostname}", safe="")
        url = f"{store_config.metadata_server}?key={key}"
        buffers: set[tuple[int, int]] = set()
        for _ in range(50):  # bounded: the descriptor is written at once
            with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310
                published = json.loads(reply.read())
            buffers = {(b["addr"], b["length"]) for b in published["buffers"]}
            if (out.data_ptr(), BLOCK) in buffers:
                break
            time.sleep(0.1)
        assert (out.data_ptr(), BLOCK) in buffers, (published, out.data_ptr())
        assert store_config.global_segment_size in {n for _, n in buffers}


def _descriptor(config, name: str) -> dict:
    """Segment ``name``'s descriptor as the metadata server holds it."""
    key = urllib.parse.quote(f"mooncake/ram/{name}", safe="")
    url = f"{config.metadata_server}?key={key}"
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310
        return json.loads(reply.read())


def _lists(buffers: list[dict], ptr: int) -> bool:
    """Whether a descriptor's ``buffers`` list the region ``(ptr, BLOCK)``."""
    return any((b["addr"], b["length"]) == (ptr, BLOCK) for b in buffers)


def test_a_stale_descriptor_is_published_again(store_config, caplog):
    """Mooncake's client re-publishes a copy of its descriptor taken
    before a registration (its start-up re-mount; 1-2 clients in 30 that
    registered at once lost the region): the client's metadata check
    sees the registered region missing, counts it and publishes again.

    The stale copy is written up to three times: Mooncake's own start-up
    re-mount, late, may publish the current descriptor over the first
    (it re-mounts once), so a later copy is healed by the check alone."""
    with (
        caplog.at_level(logging.WARNING, logger="connector.store.client"),
        StoreClient.open(store_config) as client,
    ):
        out = torch.zeros(BLOCK, dtype=torch.uint8)
        client.register_tensor(out)
        ptr = out.data_ptr()
        name = client.hostname
        for _ in range(50):  # bounded: at most a few metadata checks
            published = _descriptor(store_config, name)
            if _lists(published["buffers"], ptr):
                break
            time.sleep(0.1)
        stale = dict(published)
        stale["buffers"] = [
            b for b in published["buffers"] if not _lists([b], ptr)
        ]
        assert len(stale["buffers"]) == len(published["buffers"]) - 1
        key = urllib.parse.quote(f"mooncake/ram/{name}", safe="")
        buffers: list[dict] = []
        for _ in range(3):  # bounded: see the docstring
            request = urllib.request.Request(  # noqa: S310
                f"{store_config.metadata_server}?key={key}",
                data=json.dumps(stale).encode(),
                method="PUT",
            )
            with urllib.request.urlopen(request, timeout=5):  # noqa: S310
                pass
            for _ in range(50):  # bounded: the check runs every second
                buffers = _descriptor(store_config, name)["buffers"]
                if _lists(buffers, ptr):
                    break
                time.sleep(0.1)
            assert _lists(buffers, ptr), buffers
            if client.stats.faults_copy().get("metadata_stale", 0):
                break
        assert client.stats.faults_copy().get("metadata_stale", 0) >= 1
        assert "published again" in caplog.text
        # The scratch page used to publish again is gone from it.
        assert len(buffers) == len(published["buffers"])


def _published(config, name: str) -> bool:
    """Whether the metadata server holds segment ``name``'s descriptor."""
    key = urllib.parse.quote(f"mooncake/ram/{name}", safe="")
    try:
        with urllib.request.urlopen(  # noqa: S310
            f"{config.metadata_server}?key={key}", timeout=5
        ):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def test_a_closed_clients_name_is_not_reused_while_its_engine_lives(
    store_config,
):
    """The port in a client's name stays held until its engine is gone.

    An engine deletes its metadata entries only when destroyed; a port
    released at ``close`` let a later client take the same name while a
    closed, not yet collected client's engine lived, and that engine's
    end then deleted the new client's descriptor (seen in CI: a region
    registered by the new client vanished from its published segment).
    """
    client = StoreClient.open(store_config)
    assert client.replica_reads
    host, _, port = client.hostname.rpartition(":")
    assert client.close()
    assert not _port_free(host, int(port)), "port released at close"
    del client
    for _ in range(50):  # bounded: collected at once, or by the gc
        gc.collect()
        if _port_free(host, int(port)):
            break
        time.sleep(0.1)
    assert _port_free(host, int(port)), "port still held after collection"
    assert not _published(store_config, f"{host}:{port}")


def test_without_an_engine_of_its_own_the_client_warns_and_works(
    store_config, monkeypatch, caplog
):
    """An engine that cannot start: one WARNING, the store set up as
    before, gets served, `read_replicas` fails every key."""
    from connector.store import engine  # noqa: PLC0415

    def refuse(*args, **kwargs):
        msg = "no engine here"
        raise RuntimeError(msg)

    monkeypatch.setattr(engine.ReplicaReader, "open", refuse)
    with caplog.at_level(logging.WARNING, logger="connector.store.client"):
        client = StoreClient.open(store_config)
    try:
        assert not client.replica_reads
        warnings = [r for r in caplog.records if "no engine here" in r.message]
        assert len(warnings) == 1
        assert "not retried on another" in warnings[0].message
        src = block(0)
        client.register_tensor(src)
        key = [f"no-engine-{os.getpid()}"]
        regions = Regions.blocks(src.data_ptr(), BLOCK, [0])
        assert client.put(key, regions).ok
        assert client.get(key, regions).ok
        assert client.read_replicas(key, regions).outcomes == [
            Outcome.TRANSFER_FAILED
        ]
    finally:
        client.close()


def test_a_store_that_refuses_the_engine_is_set_up_without_it(
    store_config, monkeypatch, caplog
):
    """`setup()` refusing the engine object: one WARNING naming why, the
    store set up again on its own engine, gets served."""
    from connector.store import engine  # noqa: PLC0415

    monkeypatch.setattr(engine.ReplicaReader, "inner", property(lambda _: 42))
    with caplog.at_level(logging.WARNING, logger="connector.store.client"):
        client = StoreClient.open(store_config)
    try:
        assert not client.replica_reads
        warnings = [
            r for r in caplog.records if "own transfer engine" in r.message
        ]
        assert len(warnings) == 1, [r.message for r in caplog.records]
        assert "not retried on another" in warnings[0].message
        src = block(1)
        client.register_tensor(src)
        key = [f"refused-{os.getpid()}"]
        regions = Regions.blocks(src.data_ptr(), BLOCK, [0])
        assert client.put(key, regions).ok
        assert client.get(key, regions).ok
    finally:
        client.close()
