"""``placement: mirror``: a replica here and one in the node-level pool.

An engine with its own segment puts each block twice: into its own
segment and into the node pool's (``pool_segment``).  Its hits stay
copies inside its process (Mooncake's get reads the replica in the
reader's own segment), and the pool's replica outlives the engine.
Real processes only: the wheel's ``mooncake_master`` and a node-level
``mooncake_client`` (`NodePool`).  The key's parsing is in
``tests/test_config.py`` (torch-free: it runs on every Python).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import threading
import time

import attrs
import pytest
import torch

from connector.config import StoreConfig
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.ops.procs import NodePool
from connector.store import Outcome, StoreClient
from tests.conftest import pool_command, taken

pytestmark = pytest.mark.mooncake


BLOCK = 256 * 1024
SEGMENT = 16 * 1024 * 1024  # 64 blocks
WAIT_S = 10.0
"""Bound on a get with the pool stopped (a read of the pool would hang)."""


@pytest.fixture(scope="module")
def node():
    """A master and a node-level pool of 64 MiB, named for mirroring."""
    with EmbeddedMaster(client_ttl_s=2) as master:
        pool = NodePool.for_master(master, 4 * SEGMENT).start()
        try:
            yield master, pool
        finally:
            pool.stop()


def _configs(node) -> tuple[StoreConfig, StoreConfig]:
    """A mirroring engine's config (16 MiB) and a peer's (32 MiB)."""
    master, pool = node
    base = store_config_for(master, global_segment_size=SEGMENT)
    mirror = attrs.evolve(base, placement="mirror", pool_segment=pool.segment)
    return mirror, attrs.evolve(base, global_segment_size=2 * SEGMENT)


def _blocks(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=gen)


def _regions(t: torch.Tensor) -> list[tuple[int, int]]:
    return [(t[i].data_ptr(), BLOCK) for i in range(t.shape[0])]


def _mirror_beside_peer(
    node, unique: str, blocks: int, seed: int
) -> tuple[collections.Counter[tuple[str, ...]], list[bool], list[bool]]:
    """A (mirroring, a 16 MiB segment) puts ``blocks`` blocks beside B (a
    peer, 32 MiB); every put is stored and B reads each one back, byte
    for byte.

    Returns how many blocks have their replicas in each set of segments
    (named ``own``, ``peer``, ``pool``), and per block whether A and
    whether B reads it locally.
    """
    mirror, peer = _configs(node)
    _, pool = node
    src, dst = _blocks(blocks, seed), _blocks(blocks, seed + 1)
    with StoreClient.open(mirror) as a, StoreClient.open(peer) as b:
        assert a.register_tensor(src)
        assert b.register_tensor(dst)
        keys = [f"{unique}-{seed}-{i}" for i in range(blocks)]
        put = a.put(keys, _regions(src))
        assert list(put) == [Outcome.STORED] * blocks
        names = {a.hostname: "own", b.hostname: "peer", pool.segment: "pool"}
        where = collections.Counter(
            tuple(sorted(names.get(e, e) for e in w))
            for w in a.replica_endpoints(keys)
        )
        here, there = a.local_reads(keys), b.local_reads(keys)
        got = b.get(keys, _regions(dst))
        assert list(got) == [Outcome.HIT] * blocks
        assert torch.equal(dst, src)
        return where, here, there


def test_each_block_has_one_replica_here_and_one_in_the_pool(node, unique):
    """32 blocks beside a peer's segment: every block's two replicas are
    the engine's segment and the pool (the peer gets none), the engine
    reads all of them locally, and the peer reads each one exactly."""
    where, here, there = _mirror_beside_peer(node, unique, 32, seed=1)
    assert where == {("own", "pool"): 32}
    assert here == [True] * 32
    assert there == [False] * 32


def test_a_get_reads_its_own_replica_even_when_the_pool_is_first(node, unique):
    """What `local_reads` relies on: with the pool's replica first in the
    master's order and the pool process SIGSTOPped, the engine's get
    still returns at once with every byte right: it read its own one."""
    mirror, _ = _configs(node)
    _, pool = node
    src, dst = _blocks(32, 3), _blocks(32, 4)
    with StoreClient.open(mirror) as a:
        assert a.register_tensor(src)
        assert a.register_tensor(dst)
        keys = [f"{unique}-first-{i}" for i in range(32)]
        a.replicate_config.preferred_segments = [pool.segment, a.hostname]
        assert list(a.put(keys, _regions(src))) == [Outcome.STORED] * 32
        order = a.replica_endpoints(keys)
        assert all(w == (pool.segment, a.hostname) for w in order), order
        assert a.local_reads(keys) == [True] * 32
        got: list[object] = []
        getter = threading.Thread(
            target=lambda: got.append(list(a.get(keys, _regions(dst))))
        )
        os.kill(pool.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            getter.start()
            getter.join(WAIT_S)
            took = time.monotonic() - started
            finished = not getter.is_alive()
        finally:
            os.kill(pool.pid, signal.SIGCONT)
            getter.join()
        assert finished, f"the get still waited after {took:.1f} s"
        assert got == [[Outcome.HIT] * 32]
        assert torch.equal(dst, src)


def test_the_pool_replica_outlives_the_engine(node, unique):
    """The engine closes (its segment and replicas go); a new engine (a
    restart: another segment name) hits every block from the pool."""
    mirror, _ = _configs(node)
    src, dst = _blocks(32, 5), _blocks(32, 6)
    keys = [f"{unique}-restart-{i}" for i in range(32)]
    with StoreClient.open(mirror) as first:
        assert first.register_tensor(src)
        assert list(first.put(keys, _regions(src))) == [Outcome.STORED] * 32
        gone = first.hostname
    with StoreClient.open(mirror) as again:
        assert again.hostname != gone
        assert again.register_tensor(dst)
        assert again.local_reads(keys) == [False] * 32
        assert list(again.get(keys, _regions(dst))) == [Outcome.HIT] * 32
        assert torch.equal(dst, src)


def test_a_full_own_segment_still_mirrors_into_the_pool(node, unique):
    """96 blocks, 1.5x the engine's segment: every put is stored, each
    block keeps a replica in the pool, the engine's segment holds what
    fits (read locally) and the rest goes to the peer."""
    where, here, _ = _mirror_beside_peer(node, unique, 96, seed=7)
    assert set(where) <= {("own", "pool"), ("peer", "pool")}, where
    assert 0 < where[("own", "pool")] <= SEGMENT // BLOCK
    assert sum(here) == where[("own", "pool")]


def test_cli_pool_mirror_prints_a_config_that_mirrors(unique) -> None:
    """``kv-lifecycle pool --mirror 32MB``: the printed engines' config
    keeps a 32 MiB segment, mirrors into the pool it names, and a client
    opened from it puts each block here and in that pool."""
    with (
        EmbeddedMaster() as master,
        pool_command(master, "--mirror=32MB") as (_, extra),
    ):
        config = StoreConfig.from_extra_config(extra)
        assert config.placement == "mirror"
        assert config.global_segment_size == SEGMENT * 2
        assert config.pool_segment is not None
        src = _blocks(4, 9)
        with StoreClient.open(config) as client:
            assert client.register_tensor(src)
            keys = [f"{unique}-cli-{i}" for i in range(4)]
            put = client.put(keys, _regions(src))
            assert list(put) == [Outcome.STORED] * 4
            where = client.replica_endpoints(keys)
            pair = {client.hostname, config.pool_segment}
            assert all(set(w) == pair for w in where), where


def test_the_pool_sigkilled_costs_a_mirroring_engine_no_hit(unique):
    """The pool process dies: the engine still reads every block it put,
    from its own segment, byte for byte; once the master dropped the dead
    segment (``client_ttl``) its puts are stored again."""
    with EmbeddedMaster(client_ttl_s=2) as master:
        pool = NodePool.for_master(master, 4 * SEGMENT).start()
        try:
            base = store_config_for(
                master, global_segment_size=SEGMENT, rpc_timeout_ms=1000
            )
            mirror = attrs.evolve(
                base, placement="mirror", pool_segment=pool.segment
            )
            src, dst = _blocks(32, 10), _blocks(32, 11)
            with StoreClient.open(mirror) as a:
                assert a.register_tensor(src)
                assert a.register_tensor(dst)
                keys = [f"{unique}-kill-{i}" for i in range(32)]
                put = a.put(keys[:16], _regions(src[:16]))
                assert list(put) == [Outcome.STORED] * 16
                pool.kill()
                got = a.get(keys[:16], _regions(dst[:16]))
                assert list(got) == [Outcome.HIT] * 16
                assert torch.equal(dst[:16], src[:16])
                deadline = time.monotonic() + 20
                stored: list[Outcome] = []
                while time.monotonic() < deadline:
                    stored = list(a.put(keys[16:], _regions(src[16:])))
                    if stored == [Outcome.STORED] * 16:
                        break
                    time.sleep(0.5)
                assert stored == [Outcome.STORED] * 16
                got = a.get(keys[16:], _regions(dst[16:]))
                assert list(got) == [Outcome.HIT] * 16
                assert torch.equal(dst, src)
        finally:
            pool.stop()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_pool_holds_every_segment_name_it_used_until_stopped():
    """``mooncake_client`` does not bind its name's port, and a store
    client here names its segment after a port it can bind: the pool
    holds the port of each name it used (a SIGKILLed start's segment
    stays at the master until ``client_ttl``), and gives them back when
    stopped."""
    with EmbeddedMaster(client_ttl_s=2) as master:
        pool = NodePool.for_master(master, SEGMENT).start()
        try:
            first = pool.segment_port
            assert not _bindable(first)
            pool.kill()
            pool.restart()
            second = pool.segment_port
            assert second != first
            assert not _bindable(first)
            assert not _bindable(second)
        finally:
            pool.stop()
        assert _bindable(first)
        assert _bindable(second)


def test_a_taken_port_costs_the_pool_one_attempt_not_its_start(caplog):
    """A port picked for the pool and taken before the client binds it
    (the client exits with status 1): the first start tries new ports."""
    with EmbeddedMaster(client_ttl_s=2) as master:
        pool = NodePool.for_master(master, SEGMENT)
        first = pool.port
        with taken(first):
            try:
                with caplog.at_level(logging.WARNING, "connector.ops.procs"):
                    pool.start()
                assert pool.port != first
                assert pool.running
                assert "start attempt 1/3 failed" in caplog.text
                given = (pool.port, pool.http_port)
                pool.kill()
                pool.restart()  # a restart keeps the ports it gave out
                assert (pool.port, pool.http_port) == given
            finally:
                pool.stop()
