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
        self.batches: list[Any] = []
        self.sequences: list[int] = []

    @property
    def endpoint(self) -> str:
        """``ipc://<path>``: vLLM's publisher binds it."""
        return f"ipc://{self.path}"

    def config(self, topic: str = "") -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` publishing to this subscriber."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
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
            self.sequences.append(int.from_bytes(seq, "big", signed=True))
            self.batches.append(self._decoder.decode(payload))
            got += 1

    def events(self) -> list[Any]:
        """Every decoded event so far, in publishing order."""
        return [e for batch in self.batches for e in batch.events]

    def wait_for(
        self, found: Callable[[list[Any]], bool], timeout_s: float = 10.0
    ) -> list[Any]:
        """Poll until `found(events())` holds; the events (maybe short)."""
        deadline = time.monotonic() + timeout_s
        while not found(self.events()) and time.monotonic() < deadline:
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
