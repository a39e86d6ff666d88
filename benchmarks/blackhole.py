"""A loopback TCP relay that can blackhole a Mooncake master, for faults.

A killed master refuses connections and a SIGSTOPped one leaves them
open but silent; a master behind a network partition (a firewall rule
dropping packets, a dead switch) looks like the second to open
connections, except that the server process never notices.  `Blackhole`
reproduces that on 127.0.0.1 without privileges: clients are pointed at
the relay, which forwards both ways until `drop()`, then stops reading
from either side (bytes wait in the kernel's socket buffers, nothing is
lost or reordered) until `restore()`.

The relay runs in its own process (``python -m benchmarks.blackhole``),
so its work never takes the GIL of the process being measured; SIGUSR1
drops, SIGUSR2 restores, SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from types import TracebackType
from typing import Self

HOST = "127.0.0.1"
_READY = "blackhole: ready"
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_CHUNK = 1 << 16


class Blackhole:
    """A relay from a free loopback port to ``host:port``, in a child.

    Use as a context manager; `address` is what clients connect to.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        if host != HOST or not port.isdigit():
            msg = f"target must be {HOST}:<port>, got {target!r}"
            raise ValueError(msg)
        self.target = target
        self.address = ""
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> Self:
        """Start the relay and wait until it listens (bounded)."""
        self._proc = subprocess.Popen(  # noqa: S603 - our own module
            [sys.executable, "-m", "benchmarks.blackhole", self.target],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # noqa: PTH100, PTH120
        )
        assert self._proc.stdout is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self._proc.stdout.readline()
            if line.startswith(_READY):
                self.address = line.split()[-1]
                return self
            if not line and self._proc.poll() is not None:
                break
        self.stop()
        msg = f"blackhole relay to {self.target} did not start"
        raise RuntimeError(msg)

    def drop(self) -> None:
        """From now on nothing passes, either way."""
        self._signal(signal.SIGUSR1)

    def restore(self) -> None:
        """Forward again, starting with what waited."""
        self._signal(signal.SIGUSR2)

    def stop(self) -> None:
        """End the relay (bounded); its connections close."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(_STOP_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()

    def _signal(self, signum: int) -> None:
        if self._proc is None:
            msg = "the relay is not running"
            raise RuntimeError(msg)
        self._proc.send_signal(signum)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    open_: asyncio.Event,
) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while True:
            await open_.wait()
            data = await reader.read(_CHUNK)
            if not data:
                break
            await open_.wait()
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError):
        writer.close()


async def _relay(target: str) -> None:
    host, _, port = target.rpartition(":")
    open_ = asyncio.Event()
    open_.set()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, open_.clear)
    loop.add_signal_handler(signal.SIGUSR2, open_.set)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    tasks: set[asyncio.Task[None]] = set()

    async def accept(
        c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter
    ) -> None:
        await open_.wait()  # a connection made while dropped waits too
        try:
            s_reader, s_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            c_writer.close()
            return
        for pump in (
            _pump(c_reader, s_writer, open_),
            _pump(s_reader, c_writer, open_),
        ):
            task = asyncio.create_task(pump)
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(accept, HOST, 0)
    listen_port = server.sockets[0].getsockname()[1]
    print(f"{_READY} {HOST}:{listen_port}", flush=True)
    async with server:
        await done.wait()
    for task in list(tasks):
        task.cancel()


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.blackhole 127.0.0.1:PORT``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.blackhole 127.0.0.1:PORT")
        return 2
    asyncio.run(_relay(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
