"""Layer-wise loads read a peer's blocks in spans of layers.

A load the forward waits for layer by layer (``Deadline.by_layer``)
reads each block's one object through a Mooncake get session: spans of
1, 1, 2, 4, ... layers, each written into the KV cache as it arrives and
marked landed, so a layer's attention waits only for its own span.  Over
a real master: an owner client holds the blocks, a reader with no
segment loads them (a remote read, staged).  The deadline still bounds
the whole load: a span late by it ends the load, every block reads
failed, and nothing of the later spans is ever written.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from connector.worker.deadline import Deadline, layer_spans
from connector.worker.pieces import block_pieces
from tests.test_load_deadline import _direct

pytestmark = pytest.mark.mooncake

NUM_BLOCKS = 16
LAYERS = 4
BLOCKS = [3, 4, 5, 9]


@pytest.fixture
def opened():
    """Opens host transfers over a client; unregistered at teardown."""
    made = []

    def _open(client, kv):
        transfer = _direct(client, kv)
        made.append((client, transfer))
        return transfer

    yield _open
    for client, transfer in reversed(made):
        transfer.loads.close()
        for ptr in transfer.registered:
            client.unregister(ptr)


def _kv(seed=None, layers=LAYERS):
    shape = (NUM_BLOCKS, 4, 32)
    if seed is None:
        return {f"l{i}": torch.zeros(shape) for i in range(layers)}
    gen = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(shape, generator=gen) for i in range(layers)}


def _offsets(pieces):
    offsets = [0]
    for p in pieces[:-1]:
        offsets.append(offsets[-1] + p.nbytes)
    return offsets


def test_spans_double_and_cover_every_byte():
    """32 K/V-first layers: 6 reads of 1, 1, 2, 4, 8, 16 layers, back to
    back over the whole object, each holding only its layers' pieces."""
    kv = {f"layer.{i}": torch.zeros(2, 8, 4, 16) for i in range(32)}
    pieces = block_pieces(kv, 8)
    offsets = _offsets(pieces)
    size = sum(p.nbytes for p in pieces)
    spans = layer_spans(pieces, offsets, size)
    assert [len(s.layers) for s in spans] == [1, 1, 2, 4, 8, 16]
    assert spans[0].start == 0
    assert spans[-1].end == size
    for a, b in itertools.pairwise(spans):
        assert a.end == b.start
    for span in spans:
        names = {pieces[i].layer for i in span.pieces}
        assert names == set(span.layers)
        assert span.end - span.start == sum(
            pieces[i].nbytes for i in span.pieces
        )
    # 5 layers: the last span is what is left.
    five = block_pieces(_kv(layers=5), NUM_BLOCKS)
    spans5 = layer_spans(five, _offsets(five), sum(p.nbytes for p in five))
    assert [s.layers for s in spans5] == [
        ("l0",),
        ("l1",),
        ("l2", "l3"),
        ("l4",),
    ]


def test_one_layer_or_a_split_layer_reads_whole():
    one = block_pieces(_kv(layers=1), NUM_BLOCKS)
    assert layer_spans(one, _offsets(one), 1) == ()
    two = block_pieces(_kv(layers=2), NUM_BLOCKS)
    split = [two[0], two[1], two[0]]  # l0's pieces not consecutive
    assert layer_spans(split, _offsets(split), 3) == ()


class _Held:
    """The reader, its spans from `first_held` on told only once released.

    With `only`, only get sessions whose every key starts with it are
    held (one head shard's objects).
    """

    def __init__(self, store, first_held=1, only=None):
        self.store = store
        self.first_held = first_held
        self.only = only
        self.release = threading.Event()
        self.told: list[int] = []
        self.sessions = 0
        self.reads_spans = True

    def get_spans(self, keys, ptrs, spans, landed):
        self.sessions += 1
        hold = self.only is None or all(k.startswith(self.only) for k in keys)

        def held(index, ok):
            if hold and index >= self.first_held:
                self.release.wait(10)
            self.told.append(index)
            return landed(index, ok)

        return self.store.get_spans(keys, ptrs, spans, held)

    def get(self, keys, regions):
        return self.store.get(keys, regions)

    def local_reads(self, keys):
        return self.store.local_reads(keys)


def _stored(opened, owner, unique, tag):
    src = _kv(seed=7)
    keys = [f"{unique}-{tag}-{b}" for b in BLOCKS]
    saving = opened(owner, src)
    assert saving.save(owner, keys, BLOCKS, saving.fence()) == [True] * 4
    return src, keys


def _same(dst, src, layer):
    return torch.equal(dst[layer][BLOCKS], src[layer][BLOCKS])


def _untouched(dst, layer):
    return not dst[layer].any()


def test_a_layer_is_in_before_the_later_spans_are(
    own_and_reader, unique, opened
):
    """The forward's wait for layer 0 returns while the later spans are
    still held in the store: layer 0 is the stored KV, every later layer
    untouched; once released every layer lands, one get session."""
    owner, reader = own_and_reader
    src, keys = _stored(opened, owner, unique, "early")
    dst = _kv()
    target = opened(reader, dst)
    held = _Held(reader)
    deadline = Deadline.after(10, by_layer=True)
    out: list[list[bool]] = []
    loader = threading.Thread(
        target=lambda: out.append(target.load(held, keys, BLOCKS, deadline))
    )
    loader.start()
    try:
        assert deadline.wait_for_layer("l0", 5)
        assert _same(dst, src, "l0")
        assert all(_untouched(dst, f"l{i}") for i in range(1, LAYERS))
        assert not deadline.wait_for_layer("l1", 0.05)
    finally:
        held.release.set()
    loader.join(10)
    assert out == [[True] * 4]
    assert all(_same(dst, src, f"l{i}") for i in range(LAYERS))
    assert deadline.landed == {f"l{i}" for i in range(LAYERS)}
    assert target.loads.spanned == 1
    assert held.told == [0, 1, 2]  # 4 layers: spans of 1, 1, 2
    assert target.loads.held_late == 0


def test_a_span_past_the_deadline_ends_the_load(
    own_and_reader, unique, opened
):
    """Span 1 held past the deadline: the load reads failed at the
    deadline (vLLM recomputes its blocks, layer 0 included), and the
    spans released later are never written; the buffers come back."""
    owner, reader = own_and_reader
    src, keys = _stored(opened, owner, unique, "late")
    dst = _kv()
    target = opened(reader, dst)
    held = _Held(reader)
    late_before = target.loads.late
    deadline = Deadline.after(0.3, by_layer=True)
    started = time.monotonic()
    try:
        flags = target.load(held, keys, BLOCKS, deadline)
        took = time.monotonic() - started
        assert flags == [False] * 4
        assert took < 2.0
        assert target.loads.late == late_before + 1
        assert target.loads.held_late >= 1
        assert _same(dst, src, "l0")  # landed before the deadline
    finally:
        held.release.set()
    end = time.monotonic() + 10
    while target.loads.held_late and time.monotonic() < end:
        time.sleep(0.01)
    assert target.loads.held_late == 0
    assert all(_untouched(dst, f"l{i}") for i in range(1, LAYERS))
    assert "l1" not in deadline.landed


def test_a_missing_key_fails_only_its_blocks(own_and_reader, unique, opened):
    """A key not stored fails its block; the others land in every span."""
    owner, reader = own_and_reader
    src, keys = _stored(opened, owner, unique, "miss")
    keys[2] = f"{unique}-never-stored"
    dst = _kv()
    target = opened(reader, dst)
    deadline = Deadline.after(10, by_layer=True)
    flags = target.load(reader, keys, BLOCKS, deadline)
    assert flags == [True, True, False, True]
    good = [b for b, ok in zip(BLOCKS, flags, strict=True) if ok]
    for i in range(LAYERS):
        assert torch.equal(dst[f"l{i}"][good], src[f"l{i}"][good])
        assert not dst[f"l{i}"][BLOCKS[2]].any()
    assert target.loads.spanned == 1


def test_get_spans_reads_each_span_into_place(own_and_reader, unique, opened):
    """The store call itself: one session, spans land at their offsets,
    `landed` sees each span, False stops the read (the rest fail)."""
    owner, reader = own_and_reader
    src, keys = _stored(opened, owner, unique, "raw")
    size = sum(t[0].numel() * t.element_size() for t in src.values())
    buf = torch.zeros(4, size, dtype=torch.uint8)
    assert reader.register(buf.data_ptr(), buf.numel())
    try:
        ptrs = [buf[i].data_ptr() for i in range(4)]
        seen = []
        result = reader.get_spans(
            keys,
            ptrs,
            [(0, 512), (512, size)],
            lambda i, ok: seen.append((i, ok)) or True,
        )
        assert result.succeeded == [True] * 4
        assert seen == [(0, [True] * 4), (1, [True] * 4)]
        whole = torch.zeros_like(buf)
        assert reader.register(whole.data_ptr(), whole.numel())
        try:
            from connector.store import Regions  # noqa: PLC0415

            regions = Regions(
                [whole[i].data_ptr() for i in range(4)], [size] * 4
            )
            assert reader.get(keys, regions).succeeded == [True] * 4
            assert torch.equal(buf, whole)
            buf.zero_()
            stopped = reader.get_spans(
                keys, ptrs, [(0, 512), (512, size)], lambda i, ok: False
            )
            # The owner's segment's probe (its first key) was read whole.
            assert stopped.succeeded == [True, False, False, False]
            assert buf[0].equal(whole[0])
            assert buf[:, :512].equal(whole[:, :512])
            assert not buf[1:, 512:].any()
        finally:
            reader.unregister(whole.data_ptr())
    finally:
        reader.unregister(buf.data_ptr())
    with pytest.raises(ValueError, match="ascending"):
        reader.get_spans(keys, ptrs, [(512, 1024), (0, 512)])


class _Part:
    """A shard's transfer that records how its load was asked for."""

    def __init__(self, gate=None):
        self.by_layer: list[bool] = []
        self.writers: list[int] = []
        self.entered = threading.Event()
        self.gate = gate

    def load(self, store, keys, block_ids, deadline=None):
        self.entered.set()
        self.by_layer.append(deadline.by_layer)
        self.writers.append(deadline.writers)
        if self.gate is not None:
            assert self.gate.wait(5)
        return [True] * len(block_ids)


def test_head_shards_are_read_side_by_side_each_by_layer():
    """Two head shards of one layer: both are read by layer at once (the
    first waits for the second to have begun), a layer counted landed
    only once both wrote it; one shard alone keeps one writer."""
    from connector.worker.shards import Sharded  # noqa: PLC0415

    second = _Part()
    parts = [_Part(gate=second.entered), second]
    deadline = Deadline.after(10, by_layer=True)
    flags = Sharded(parts).load(None, ["a0", "b0"], [1], deadline)
    assert flags == [True]
    assert [p.by_layer for p in parts] == [[True], [True]]
    assert [p.writers for p in parts] == [[2], [2]]
    one = _Part()
    deadline = Deadline.after(10, by_layer=True)
    assert Sharded([one]).load(None, ["a0"], [1], deadline) == [True]
    assert one.by_layer == [True]
    assert one.writers == [1]


class _Broken:
    """A shard's transfer whose load raises."""

    def load(self, store, keys, block_ids, deadline=None):
        msg = "shard a broke"
        raise RuntimeError(msg)


def test_a_shard_that_raises_waits_for_the_others_first():
    """Shard a raises while shard b is still writing: the error reaches
    the caller only once b ended, so no shard writes into blocks after
    the load was reported failed."""
    from connector.worker.shards import Sharded  # noqa: PLC0415

    release = threading.Event()
    b = _Part(gate=release)
    deadline = Deadline.after(10, by_layer=True)
    raised: list[BaseException] = []

    def load():
        try:
            Sharded([_Broken(), b]).load(None, ["a0", "b0"], [1], deadline)
        except RuntimeError as exc:
            raised.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    assert b.entered.wait(5)
    loader.join(0.2)
    assert loader.is_alive()  # b is still in its load: not reported yet
    release.set()
    loader.join(5)
    assert [str(e) for e in raised] == ["shard a broke"]


def test_a_layer_lands_once_every_writer_wrote_it():
    """`end_write` of one of two writers does not land a layer; the
    watchdog cannot take the load while either writer is in a span."""
    deadline = Deadline.after(10, by_layer=True)
    deadline.writers = 2
    assert deadline.begin_write()
    assert deadline.begin_write()
    deadline.end_write(["l0"])
    assert "l0" not in deadline.landed
    assert not deadline.wait_for_layer("l0", 0.01)
    assert not deadline.expire()  # the other writer is mid-span
    deadline.end_write(["l0", "l1"])
    assert deadline.landed == {"l0"}
    assert deadline.wait_for_layer("l0", 0)
    assert deadline.expire()
    assert not deadline.begin_write()


def _sharded(client, kv, made):
    from connector.store import Regions  # noqa: PLC0415
    from connector.worker.pieces import HeadSlice  # noqa: PLC0415
    from connector.worker.shards import Sharded  # noqa: PLC0415
    from connector.worker.transfer import open_transfer  # noqa: PLC0415

    parts = [
        open_transfer(
            kv,
            NUM_BLOCKS,
            Regions,
            register=client.register,
            deadlines=True,
            heads=HeadSlice(first, 2, 4),
        )
        for first in (0, 2)
    ]
    made.extend((client, part) for part in parts)
    return Sharded(parts)


@pytest.fixture
def sharded_opened():
    made = []
    yield lambda client, kv: _sharded(client, kv, made)
    for client, transfer in reversed(made):
        transfer.loads.close()
        for ptr in transfer.registered:
            client.unregister(ptr)


def _heads(kv, layer, first):
    return kv[layer][BLOCKS][:, first : first + 2]


@pytest.mark.parametrize("held", ["both", "b"])
def test_a_head_sharded_layer_waits_for_every_shard(
    own_and_reader, unique, sharded_opened, held
):
    """A rank reading two head shards per block from a peer, in spans.

    ``both``: spans from 1 on held for each shard: layer 0's wait returns
    with both head halves of layer 0 in and every later layer untouched.
    ``b``: shard b held whole: shard a wrote every layer, yet no layer
    is landed until b's spans are in.  Released, everything lands."""
    owner, reader = own_and_reader
    src = _kv(seed=11)
    keys = [f"{unique}-{s}-{b}" for s in ("a", "b") for b in BLOCKS]
    saving = sharded_opened(owner, src)
    assert saving.save(owner, keys, BLOCKS, saving.fence()) == [True] * 4
    dst = _kv()
    target = sharded_opened(reader, dst)
    prefix = unique if held == "both" else f"{unique}-b"
    store = _Held(reader, first_held=1 if held == "both" else 0, only=prefix)
    deadline = Deadline.after(10, by_layer=True)
    out: list[list[bool]] = []
    loader = threading.Thread(
        target=lambda: out.append(target.load(store, keys, BLOCKS, deadline))
    )
    loader.start()
    try:
        if held == "both":
            assert deadline.wait_for_layer("l0", 5)
            assert torch.equal(dst["l0"][BLOCKS], src["l0"][BLOCKS])
            assert all(_untouched(dst, f"l{i}") for i in range(1, LAYERS))
        else:
            end = time.monotonic() + 5
            while not all(
                torch.equal(_heads(dst, f"l{i}", 0), _heads(src, f"l{i}", 0))
                for i in range(LAYERS)
            ):
                assert time.monotonic() < end, "shard a never landed"
                time.sleep(0.01)
            assert not _heads(dst, "l0", 2).any()
        assert not deadline.wait_for_layer("l0" if held == "b" else "l1", 0.05)
    finally:
        store.release.set()
    loader.join(10)
    assert out == [[True] * 4]
    assert all(_same(dst, src, f"l{i}") for i in range(LAYERS))
    assert deadline.landed == {f"l{i}" for i in range(LAYERS)}
    assert store.sessions == 2  # one get session per shard
    assert [p.loads.spanned for p in target.parts] == [1, 1]


_OWNER = """
import json, sys, time
import torch
from connector.config import StoreConfig
from connector.store import Regions, StoreClient
client = StoreClient.open(StoreConfig.from_mapping(json.loads(sys.argv[1])))
src = torch.ones(8, 65536, dtype=torch.uint8)
client.register_tensor(src)
keys = [f"{sys.argv[2]}-{i}" for i in range(8)]
ptrs = [src[i].data_ptr() for i in range(8)]
print(all(client.put(keys, Regions(ptrs, [65536] * 8)).succeeded), flush=True)
time.sleep(120)
"""


def test_a_dead_peers_keys_fail_at_once(unique):
    """The owner of 8 blocks is SIGKILLed: a read of them in spans fails
    every key as a transfer failure within a second (its segment's probe
    fails, no ranged read is tried: Mooncake's ranged reads from a dead
    peer fail only after seconds, 6 s for 8 keys here), so a layer-wise
    load and the sick-peer memory learn of the death at once."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from connector.ops.master import EmbeddedMaster, store_config_for  # noqa: PLC0415
    from connector.store import Outcome, StoreClient  # noqa: PLC0415

    with EmbeddedMaster(client_ttl_s=30) as master:
        values = {
            "master_server_address": master.rpc_address,
            "metadata_server": master.metadata_server,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": 16 * 1024 * 1024,
            "local_buffer_size": 16 * 1024 * 1024,
            "local_hostname": "127.0.0.1",
            "log_level": "ERROR",
        }
        owner = subprocess.Popen(
            [sys.executable, "-c", _OWNER, json.dumps(values), unique],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert owner.stdout.readline().strip() == "True"
            reader_config = store_config_for(master, global_segment_size=0)
            with StoreClient.open(reader_config) as reader:
                buf = torch.zeros(8, 65536, dtype=torch.uint8)
                assert reader.register(buf.data_ptr(), buf.numel())
                keys = [f"{unique}-{i}" for i in range(8)]
                ptrs = [buf[i].data_ptr() for i in range(8)]
                spans = [(0, 16384), (16384, 65536)]
                assert (
                    reader.get_spans(keys, ptrs, spans).succeeded == [True] * 8
                )
                assert buf.all()
                owner.kill()
                owner.wait(10)
                started = time.monotonic()
                result = reader.get_spans(keys, ptrs, spans)
                took = time.monotonic() - started
                reader.unregister(buf.data_ptr())
            assert result.succeeded == [False] * 8
            assert set(result.outcomes) == {Outcome.TRANSFER_FAILED}
            assert took < 1.5
        finally:
            owner.kill()
            owner.wait(10)
