"""A subscriber to vLLM's KV-event publisher, as a KV-aware router runs one.

vLLM's `ZmqEventPublisher` binds a wildcard TCP endpoint (``tcp://*:P``)
or an ``ipc://`` path and connects to any other endpoint.  The tests hand
it an ``ipc://`` path in a temporary directory: vLLM binds it, the
subscriber connects, as a router does, and nothing listens on the network
at all.  (A publisher *connecting* to a subscriber bound on
``tcp://127.0.0.1:P`` lost every message sent after a second of silence
on this project's machines, so the tests do not use that direction.)

Each message is ``[topic, sequence (8 bytes, big endian), msgpack
KVEventBatch]``; `KVEventSubscriber` decodes the batches with vLLM's own
msgspec classes.

PUB/SUB drops what is published before the subscription reaches the
publisher (ZMQ's "slow joiner"): a batch sent in the first steps after
the engine binds may never arrive.  A router closes such gaps through
the publisher's replay socket (``replay_endpoint``: a ROUTER that resends
its buffered batches from a sequence number on); `wait_for` does the
same before it gives up on a condition, so a test never depends on how
fast the subscription propagated.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType


class KVEventSubscriber:
    """SUB socket connected to vLLM's publisher; decodes `KVEventBatch`es.

    Args:
        directory: Where the ``ipc://`` socket file lives (default: a new
            temporary directory, removed by `close`).
    """

    def __init__(self, directory: Path | None = None) -> None:
        import msgspec  # noqa: PLC0415 - the venvs with vLLM have it
        import zmq  # noqa: PLC0415
        from vllm.distributed.kv_events import (  # noqa: PLC0415
            KVEventBatch,
        )

        self._tmp = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kv-events-")
            directory = Path(self._tmp.name)
        self.path = directory / "kv-events.sock"
        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RECONNECT_IVL, 20)
        self._sub.connect(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._by_seq: dict[int, Any] = {}
        #: Sequence numbers in the order they arrived on the live socket.
        self.sequences: list[int] = []
        #: Batches received only through a replay (missed live).
        self.replayed = 0

    @property
    def endpoint(self) -> str:
        """``ipc://<path>``: vLLM's publisher binds it."""
        return f"ipc://{self.path}"

    @property
    def replay_endpoint(self) -> str:
        """``ipc://<path>`` of the publisher's replay (ROUTER) socket."""
        return f"ipc://{self.path.with_name('kv-events-replay.sock')}"

    @property
    def batches(self) -> list[Any]:
        """Every batch received, live or replayed, by sequence number."""
        return [self._by_seq[seq] for seq in sorted(self._by_seq)]

    def config(self, topic: str = "") -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` publishing to this subscriber."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": topic,
        }

    def poll(self, timeout_s: float = 0.0) -> int:
        """Receive what arrived within `timeout_s`; returns batches read."""
        zmq = self._zmq
        got = 0
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left_ms if got == 0 else 0):
                return got
            _topic, seq, payload = self._sub.recv_multipart(zmq.NOBLOCK)
            number = int.from_bytes(seq, "big", signed=True)
            self.sequences.append(number)
            self._by_seq[number] = self._decoder.decode(payload)
            got += 1

    def replay(self, timeout_s: float = 2.0) -> int:
        """Ask the publisher for every batch it still buffers.

        Returns the batches that had been missed live (0 when the
        publisher does not answer within `timeout_s`).
        """
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        missed = 0
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms):
                    return missed
                frames = dealer.recv_multipart()
                _empty, _topic, seq, payload = frames
                number = int.from_bytes(seq, "big", signed=True)
                if number < 0:  # the publisher's end-of-replay marker
                    return missed
                if number not in self._by_seq:
                    self._by_seq[number] = self._decoder.decode(payload)
                    missed += 1
        finally:
            dealer.close(linger=0)
            self.replayed += missed

    def events(self) -> list[Any]:
        """Every decoded event so far, in publishing order."""
        return [e for batch in self.batches for e in batch.events]

    def wait_for(
        self, found: Callable[[list[Any]], bool], timeout_s: float = 10.0
    ) -> list[Any]:
        """Poll until `found(events())` holds; the events (maybe short).

        Whenever the condition does not hold yet, batches missed live are
        asked for again through the replay socket (at most every second).
        """
        deadline = time.monotonic() + timeout_s
        next_replay = time.monotonic()
        while not found(self.events()) and time.monotonic() < deadline:
            if time.monotonic() >= next_replay:
                self.replay(min(2.0, max(0.1, deadline - time.monotonic())))
                next_replay = time.monotonic() + 1.0
                continue
            self.poll(0.1)
        return self.events()

    def close(self) -> None:
        """Close the socket (the process-wide context stays, as vLLM's)."""
        self._sub.close(linger=0)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
