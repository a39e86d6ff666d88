"""The transfer engine a store client owns, and raw reads of one replica.

Mooncake's get reads one replica of a key, the one its client picks (a
replica in the reader's own segment, else the first complete remote one
in the master's order), and never tries another.  To read a *chosen*
replica, the client sets the store up on a transfer engine it owns
(``MooncakeDistributedStore.setup(..., engine=...)``): the store's
segment and every ``register_buffer`` region are then registered with
that engine, and ``ReplicaReader.read`` moves a replica's bytes from its
owner's segment straight into a registered region.

The engine must publish the same segment name as the store: the store
records ``local_hostname`` (``ip:port``) as the transport endpoint of its
segment, and a peer opens the segment by that name.  So the name gets an
explicit port, held by a bound socket for the reader's lifetime (as
Mooncake's own port binder does), and the same name is given to both.
The port is held until the engine and every store set up on it are gone:
an engine deletes its entries from the metadata server only when it is
destroyed, so a port released earlier could give a later client the same
name and have its entries deleted under it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

__all__ = ["Replica", "ReplicaReader", "memory_replicas"]

log: Final = logging.getLogger(__name__)

READ_WAIT_S: Final = 60.0
"""Longest a raw read is waited for (the store's own wait for a get).

The transport ends a read itself well before (``MC_TCP_PROGRESS_TIMEOUT_SEC``,
set from the load deadline); past this bound a read counts as failed
while the transport may still complete it, exactly as a store get does.
"""

_POLL_S: Final = 0.0002


@attrs.frozen
class Replica:
    """One complete memory replica of a key.

    Attributes:
        endpoint: The owner's segment name (``ip:port``).
        address: The object's address in that segment.
        size: The object's size in bytes.
    """

    endpoint: str
    address: int
    size: int


def memory_replicas(descriptors: Iterable[Any]) -> tuple[Replica, ...]:
    """The complete memory replicas among ``ReplicaDescriptor`` objects.

    In the given (the master's) order; anything unreadable is skipped.
    """
    found = []
    for replica in descriptors:
        try:
            if not _complete(replica):
                continue
            if not replica.is_memory_replica():
                continue
            buffer = replica.get_memory_descriptor().buffer_descriptor
            found.append(
                Replica(
                    str(buffer.transport_endpoint),
                    int(buffer.buffer_address),
                    int(buffer.size),
                )
            )
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
    return tuple(found)


def read_here(descriptors: Iterable[Any], local: str) -> bool:
    """Whether a get reads the key from ``local``, a memcpy in-process.

    Among ``ReplicaDescriptor`` objects: True when a complete memory
    replica is in ``local`` and every complete replica is in memory.
    Mooncake's get reads a complete memory replica in the reader's own
    segment whenever there is one, whatever the master's order (0.3.13:
    checked by ``tests/test_mirror.py`` with the other replica's owner
    stopped); a complete replica on disk (the master's SSD tier) makes
    the key not local, as that choice is not checked.  False when none
    is complete, ``local`` is empty, or a descriptor is unreadable.
    """
    here = False
    try:
        for replica in descriptors:
            if not _complete(replica):
                continue
            if not replica.is_memory_replica():
                return False
            buffer = replica.get_memory_descriptor().buffer_descriptor
            here = here or str(buffer.transport_endpoint) == local
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    return bool(local) and here


def _complete(replica: Any) -> bool:
    """Whether a ``ReplicaDescriptor``'s status is COMPLETE.

    Compared with the status enum's member (a pybind enum's ``name`` is
    3x slower to read, and loads ask this of every key).
    """
    status = replica.status
    return bool(status == type(status).COMPLETE)


def read_from(replicas: Sequence[Replica], local: str) -> str:
    """The endpoint a store get reads (``""`` when there is none).

    ``local`` if it holds a replica, else the first.
    """
    if local and any(r.endpoint == local for r in replicas):
        return local
    return replicas[0].endpoint if replicas else ""


def other_replica(
    replicas: Sequence[Replica], local: str, avoid: Iterable[str] = ()
) -> Replica | None:
    """The first replica a store get would *not* read, off ``avoid``."""
    skip = {read_from(replicas, local), *avoid}
    return next((r for r in replicas if r.endpoint not in skip), None)


class NameHold:
    """The port of a segment name, held while any user of the name lives.

    Users are Python objects (the transfer engine, each store set up on
    it), tracked by weak reference: the socket closes when the last one
    is collected, so the name cannot be handed to another client while
    an engine that will delete its metadata entries still exists.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._users = 0
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The held port (0 once released)."""
        sock = self._sock
        return int(sock.getsockname()[1]) if sock is not None else 0

    def attach(self, user: object) -> None:
        """Hold the port at least as long as ``user`` lives."""
        with self._lock:
            if self._sock is None:
                return
            self._users += 1
        weakref.finalize(user, self._detach)

    def release(self) -> None:
        """Release the port now (no user ever took the name)."""
        with self._lock:
            sock, self._sock = self._sock, None
        _close(sock)

    def _detach(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
        self.release()


class ReplicaReader:
    """A transfer engine owned by a store client, for raw replica reads.

    Create with ``ReplicaReader.open``; hand ``inner`` to the store's
    ``setup`` under ``name`` and ``attach`` that store; ``close`` after
    the store is closed.  The name's port stays held until the engine
    and every attached store are collected (see the module docstring).
    """

    def __init__(self, engine: Any, name: str, hold: NameHold | None) -> None:
        self._engine = engine
        self.name = name
        self._hold = hold
        if hold is not None:
            hold.attach(engine)

    @classmethod
    def open(
        cls,
        host: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
    ) -> ReplicaReader:
        """Initialize an engine under ``host:port``.

        A ``host`` without a port gets a free one, held here until
        ``close``; one with a port is used as it is.

        Raises:
            OSError: no port could be held.
            RuntimeError: Mooncake's engine is missing or refused to start.
        """
        hold: NameHold | None = None
        _, sep, port = host.rpartition(":")
        if sep and port.isdigit():
            name = host
        else:
            hold = NameHold(hold_port(host))
            name = f"{host}:{hold.port}"
        try:
            from mooncake.engine import TransferEngine  # noqa: PLC0415

            engine = TransferEngine()
            rc = engine.initialize(
                name, metadata_server, protocol, device_name
            )
        except ImportError as exc:
            _release(hold)
            msg = f"mooncake.engine is not importable: {exc}"
            raise RuntimeError(msg) from exc
        except BaseException:
            _release(hold)
            raise
        if rc != 0:
            _release(hold)
            msg = f"TransferEngine.initialize({name!r}, ...) returned {rc}"
            raise RuntimeError(msg)
        return cls(engine, name, hold)

    @property
    def inner(self) -> Any:
        """The engine object ``MooncakeDistributedStore.setup`` accepts."""
        return self._engine.get_engine()

    def read(
        self,
        reads: Sequence[tuple[Replica, Sequence[tuple[int, int]]]],
        *,
        wait_s: float = READ_WAIT_S,
    ) -> list[bool]:
        """Read each replica into its pieces (``(ptr, nbytes)``, in order).

        The pieces must be registered memory and add up to the replica's
        size (the caller checks).  All reads are submitted at once; each
        is True only when every piece of it completed.  Returns when every
        piece succeeded or failed (Mooncake releases the GIL), or after
        ``wait_s`` (the pieces still running count as failed).
        """
        ok = [True] * len(reads)
        pending = self._submit(reads, ok)
        give_up = time.monotonic() + wait_s
        while pending:
            pending = self._poll(pending, ok)
            if not pending:
                break
            if time.monotonic() > give_up:
                log.warning(
                    "%d raw replica read(s) still running after %.0f s; "
                    "counted failed",
                    len(pending),
                    wait_s,
                )
                for index, _ in pending:
                    ok[index] = False
                break
            time.sleep(_POLL_S)
        return ok

    def _submit(
        self,
        reads: Sequence[tuple[Replica, Sequence[tuple[int, int]]]],
        ok: list[bool],
    ) -> list[tuple[int, int]]:
        """One async read per piece; ``(read, batch)`` of each submitted."""
        engine = self._engine
        pending: list[tuple[int, int]] = []
        for index, (replica, pieces) in enumerate(reads):
            offset = replica.address
            for ptr, nbytes in pieces:
                batch = engine.batch_transfer_async_read(
                    replica.endpoint, [ptr], [offset], [nbytes]
                )
                if not batch:
                    ok[index] = False
                    break
                pending.append((index, batch))
                offset += nbytes
        return pending

    def _poll(
        self, pending: list[tuple[int, int]], ok: list[bool]
    ) -> list[tuple[int, int]]:
        """The pieces still running; marks the reads of failed ones."""
        running = []
        for index, batch in pending:
            status = self._engine.transfer_check_status(batch)
            if status == 0:
                running.append((index, batch))
            elif status < 0:  # -1 failed, -2 timed out (slice bound)
                ok[index] = False
        return running

    def attach(self, store: object) -> None:
        """Keep the name's port held while ``store`` (set up on it) lives."""
        if self._hold is not None:
            self._hold.attach(store)

    def close(self) -> None:
        """Drop this reader's engine (no read after it).

        The engine goes with its last user; the port when it is gone.
        """
        self._engine = None


def _release(hold: NameHold | None) -> None:
    if hold is not None:
        hold.release()


def _close(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()


def hold_port(host: str) -> socket.socket:
    """A bound TCP socket on a free port of ``host`` (else any address)."""
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        hold.bind((host, 0))
    except OSError:
        hold.close()
        hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hold.bind(("", 0))
    return hold
