"""Supervised store processes: ``etcd`` and the node-level ``mooncake_client``.

``Supervised`` runs one child process on loopback the way
``EmbeddedMaster`` runs the master (both on ``master._ChildProcess``:
spawn, log reader, ready wait, bounded stop): it waits until a readiness probe
passes, forwards the output to Python logging (or appends it to a file),
keeps the last lines, and always stops it again (``stop()``, a context
manager, a finalizer run at interpreter exit too). Unless started with
``dies_with_owner=False`` (which needs a ``log_file``: nobody reads a
pipe once the owner is gone), the kernel kills it when its owner dies
(``PR_SET_PDEATHSIG``). ``kill()``, ``pause()``, ``resume()`` and
``restart()`` (same argv, same ports) inject faults; ``detach()`` hands
the process over to nobody (``kv-lifecycle ... --detach``).

``EmbeddedEtcd`` is a one-member etcd (Debian's ``etcd-server``) with its
data in a temporary directory; ``NodePool`` is the wheel's
``mooncake_client``, the "real client" that owns a node's KV pool so
that engines contribute no segment of their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from connector.errors import ConfigError, ServiceStartError
from connector.ops.master import (
    _LOG_TAIL_LINES,
    HOST,
    _ChildProcess,
    _wait_stopped,
    find_binary,
    process_alive,
)
from connector.store.engine import hold_port
from connector.store.mooncake import probe_tcp

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from connector.ops.master import MasterAddresses

__all__ = [
    "EmbeddedEtcd",
    "NodePool",
    "Supervised",
    "free_port",
    "get_json",
]

log = logging.getLogger(__name__)


def free_port() -> int:
    """A free loopback TCP port (racy: retry the start if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def get_json(url: str, timeout_s: float = 0.5) -> dict[str, Any] | None:
    """GET ``url`` and parse a JSON object; ``None`` on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310
            body = json.loads(resp.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class Supervised(_ChildProcess):
    """One child process, ready-probed, logged, and stopped with its owner.

    Contracts: ``start()`` returns once ``ready()`` passes, or raises
    ``ServiceStartError`` (exited early, not ready within
    ``start_timeout_s``, no executable); ``stop()`` is idempotent and
    bounded (SIGTERM, SIGKILL after ``stop_timeout_s``); ``restart()``
    reuses the argv (and so the ports).  The first ``start()`` tries
    ``first_start_attempts`` times, with new ports from ``_repick``.

    Args:
        name: what the process is, in logs and errors.
        argv: the command (a callable is called at each start).
        ready: the readiness probe (called every 50 ms while starting).
        dies_with_owner: ``PR_SET_PDEATHSIG`` (Linux); ``False`` needs
            ``log_file``.
        log_file: append the output there instead of logging it.
        env: extra environment variables.
        picked_ports: the attributes holding ports picked by the owner
            (``free_port``), picked again when a first start fails.
        start_attempts: attempts of the first start with such ports.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str] | Callable[[], Sequence[str]],
        ready: Callable[[], bool],
        *,
        dies_with_owner: bool = True,
        log_file: Path | str | None = None,
        env: dict[str, str] | None = None,
        log_level: int = logging.DEBUG,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 5.0,
        picked_ports: Sequence[str] = (),
        start_attempts: int = 3,
    ) -> None:
        if not dies_with_owner and log_file is None:
            reason = "a process that outlives its owner needs a log file"
            key = "log_file"
            raise ConfigError(key, None, reason)
        super().__init__()
        self.name = name
        self._argv = argv
        self._ready = ready
        self.dies_with_owner = dies_with_owner
        self.log_file = Path(log_file) if log_file is not None else None
        self.env = dict(env or {})
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._picked_ports = tuple(picked_ports)
        #: Attempts of the first ``start()``: ``start_attempts`` when
        #: ports were picked here (one can be taken before the child binds
        #: it), else 1; later starts, ``restart`` included, keep the ports.
        self.first_start_attempts = (
            max(1, start_attempts) if self._picked_ports else 1
        )

    # -- state -------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The current (or last) process id."""
        return self._pids[-1] if self._pids else None

    @property
    def running(self) -> bool:
        """Whether the process is alive (stopped by SIGSTOP counts)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def log_tail(self) -> tuple[str, ...]:
        """The last output lines (read back from ``log_file`` if set)."""
        if self.log_file is not None:
            with contextlib.suppress(OSError):
                lines = self.log_file.read_text(errors="replace").splitlines()
                return tuple(lines[-_LOG_TAIL_LINES:])
            return ()
        return tuple(self._tail)

    def argv(self) -> list[str]:
        """The command line of the next start."""
        argv = self._argv() if callable(self._argv) else self._argv
        return [str(a) for a in argv]

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> Self:
        """Start it and wait until ready.

        Raises:
            ServiceStartError: no executable, early exit, or not ready in
                time (the process is stopped again).
        """
        with self._lock:
            if self.running:
                return self
            attempt = 1
            while True:
                try:
                    self._spawn()
                    self._wait_ready()
                except ServiceStartError as exc:
                    if attempt >= self.first_start_attempts:
                        raise
                    if not self._repick():
                        raise
                    log.warning(
                        "%s start attempt %d/%d failed (%s); trying new ports",
                        self.name,
                        attempt,
                        self.first_start_attempts,
                        exc,
                    )
                    attempt += 1
                    continue
                self.first_start_attempts = 1  # its ports are given out
                return self

    def _repick(self) -> bool:
        """New free ports in ``picked_ports``; False: none to pick."""
        for name in self._picked_ports:
            setattr(self, name, free_port())
        return bool(self._picked_ports)

    def restart(self) -> Self:
        """Stop it if it runs, then start it again with the same argv."""
        with self._lock:
            self._shutdown()
            deadline = time.monotonic() + self.start_timeout_s
            while True:
                try:
                    return self.start()
                except ServiceStartError:
                    # The old sockets may linger a moment; keep the ports.
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL; idempotent. Returns the exit status."""
        with self._lock:
            return self._shutdown()

    def kill(self) -> None:
        """SIGKILL it now, as a crash would (fault injection)."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=self.stop_timeout_s)

    def pause(self) -> None:
        """SIGSTOP it (keeps its sockets, answers nothing)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)
            _wait_stopped(proc.pid, stopped=True, timeout_s=2.0)

    def resume(self) -> None:
        """SIGCONT a paused process."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            _wait_stopped(proc.pid, stopped=False, timeout_s=2.0)

    def detach(self) -> int:
        """Leave the process running after this object and its owner.

        Needs ``dies_with_owner=False`` (the kernel would kill it) and a
        running process. Returns its pid.

        Raises:
            ConfigError: it dies with its owner, or it is not running.
        """
        with self._lock:
            proc = self._proc
            if self.dies_with_owner or proc is None or proc.poll() is not None:
                reason = "detach needs a running process started with "
                reason += "dies_with_owner=False"
                key = "dies_with_owner"
                raise ConfigError(key, self.dies_with_owner, reason)
            if self._finalizer is not None:
                self._finalizer.detach()
            self._proc, self._finalizer = None, None
            return proc.pid

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {self.name} {state} pid={self.pid}>"

    # -- internals ---------------------------------------------------------

    def _fail(self, reason: str, rc: int | None) -> ServiceStartError:
        return ServiceStartError(self.name, reason, rc, self.log_tail)

    def _spawn(self) -> None:
        argv = self.argv()
        binary = argv[0]
        if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
            reason = f"cannot execute {binary}: not an executable file"
            raise self._fail(reason, None)
        env = {**os.environ, "GLOG_minloglevel": "1", **self.env}
        self._tail.clear()
        out: Any = subprocess.PIPE
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_file.open("ab")
        log.debug("starting %s: %s", self.name, " ".join(argv))
        try:
            self._launch(
                argv,
                env=env,
                stdout=out,
                dies_with_owner=self.dies_with_owner,
                logger=f"{__name__}.{self.name}",
                level=self.log_level,
                thread_name=f"{self.name}-log",
            )
        except OSError as exc:
            reason = f"cannot execute {binary}: {exc}"
            raise self._fail(reason, None) from exc
        finally:
            if out is not subprocess.PIPE:
                out.close()

    def _wait_ready(self) -> None:
        proc = self._proc
        assert proc is not None  # _spawn set it
        self._await_ready(proc, self._ready, self.start_timeout_s, self._fail)
        log.info("%s pid %d ready", self.name, proc.pid)


def find_etcd() -> Path:
    """The ``etcd`` executable on ``PATH`` (Debian's ``etcd-server``).

    Raises:
        ServiceStartError: there is none.
    """
    found = shutil.which("etcd")
    if found is None:
        reason = "no etcd on PATH (Debian/Ubuntu: apt-get install etcd-server)"
        service = "etcd"
        raise ServiceStartError(service, reason, None, ())
    return Path(found)


class EmbeddedEtcd(Supervised):
    """A one-member etcd on free loopback ports, data in a temp directory.

    ``endpoint`` is ``127.0.0.1:<client port>``; ready when ``/health``
    says ``"health": "true"``. The data directory is removed at
    ``stop()`` unless ``data_dir`` was given.
    """

    def __init__(
        self,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        data_dir: Path | str | None = None,
        **kwargs: Any,
    ) -> None:
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        picked = [
            name
            for name, given in (
                ("client_port", client_port),
                ("peer_port", peer_port),
            )
            if given is None
        ]
        self._own_dir = data_dir is None
        self.data_dir = Path(
            data_dir if data_dir is not None else tempfile.mkdtemp("-etcd")
        )
        binary = str(find_etcd())

        def argv() -> list[str]:
            client = f"http://{HOST}:{self.client_port}"
            peer = f"http://{HOST}:{self.peer_port}"
            return [
                binary,
                "--name=kv-lifecycle",
                f"--data-dir={self.data_dir / 'data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=kv-lifecycle={peer}",
                "--log-level=warn",
            ]

        super().__init__(
            "etcd", argv, self._healthy, picked_ports=picked, **kwargs
        )

    def _repick(self) -> bool:
        """New ports, and a fresh data directory if it is etcd's own."""
        if not super()._repick():
            return False
        if self._own_dir:  # a member bootstrapped with the old URLs
            shutil.rmtree(self.data_dir / "data", ignore_errors=True)
        return True

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<client port>``."""
        return f"{HOST}:{self.client_port}"

    def _healthy(self) -> bool:
        body = get_json(f"http://{self.endpoint}/health")
        return body is not None and body.get("health") in {"true", True}

    def stop(self) -> int | None:
        """Stop etcd and remove its temporary data directory."""
        rc = super().stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return rc


def find_client_binary() -> Path:
    """The wheel's ``mooncake_client`` (beside ``mooncake_master``).

    Raises:
        ServiceStartError: there is none.
    """
    beside = find_binary().parent / "mooncake_client"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mooncake_client")
    if found is None:
        reason = f"no mooncake_client beside {beside.parent} or on PATH"
        service = "mooncake_client"
        raise ServiceStartError(service, reason, None, ())
    return Path(found)


class NodePool(Supervised):
    """The node-level ``mooncake_client``: it owns the node's KV pool.

    Engines on the node then run with ``global_segment_size = 0``
    (vLLM's ``mode: standalone-store``): the blocks they store live in
    this process, so they survive an engine's restart. Ready when the
    client's ``/health`` answers and its RPC port accepts, i.e. after it
    mounted its segment at the master.

    Args:
        master_server_address: ``host:port`` or ``etcd://...`` (HA).
        metadata_server: the transfer-engine metadata server.
        global_segment_size: bytes of the pool.
        cluster_id: the HA set's cluster id (``MC_STORE_CLUSTER_ID``).
        port: ``--port`` of its RPC service (free one by default).
        http_port: its ``/health`` and ``/metrics`` port.
        start_attempts: how many port picks the first ``start()`` tries
            when a port was picked here (a free port can be taken before
            the client binds it: the client then exits with status 1).

    Its segment is named ``127.0.0.1:<port>`` with a port picked at each
    start (`segment`), so engines can name the pool in ``pool_segment``
    (``placement: mirror``).  A restart gets a new name: the master keeps
    a SIGKILLed client's segment until ``client_ttl``, and a process
    mounting the same name meanwhile is refused, its puts failing (the
    wheel's 0.3.13 behaviour, seen in ``tests/test_ha.py``).
    """

    def __init__(
        self,
        *,
        master_server_address: str,
        metadata_server: str,
        global_segment_size: int = 256 * 1024 * 1024,
        local_buffer_size: int = 16 * 1024 * 1024,
        protocol: str = "tcp",
        cluster_id: str | None = None,
        port: int | None = None,
        http_port: int | None = None,
        extra_flags: Sequence[str] = (),
        start_attempts: int = 3,
        **kwargs: Any,
    ) -> None:
        self.master_server_address = master_server_address
        self.metadata_server = metadata_server
        self.global_segment_size = global_segment_size
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        picked = [
            name
            for name, given in (("port", port), ("http_port", http_port))
            if given is None
        ]
        self.segment_port = 0
        self._names: list[socket.socket] = []
        binary = str(find_client_binary())

        def argv() -> list[str]:
            self.segment_port = self._new_name()  # a new name each start
            return [
                binary,
                f"--master_server_address={master_server_address}",
                f"--metadata_server={metadata_server}",
                f"--host={self.segment}",
                f"--port={self.port}",
                f"--global_segment_size={global_segment_size}",
                f"--local_buffer_size={local_buffer_size}",
                f"--protocol={protocol}",
                "--enable_http_server=true",
                f"--http_port={self.http_port}",
                *extra_flags,
            ]

        env = dict(kwargs.pop("env", None) or {})
        env.setdefault("MC_RPC_TIMEOUT_MS", "2000")
        if cluster_id is not None:
            env["MC_STORE_CLUSTER_ID"] = cluster_id
        super().__init__(
            "mooncake_client",
            argv,
            self._ready_now,
            env=env,
            picked_ports=picked,
            start_attempts=start_attempts,
            **kwargs,
        )

    @classmethod
    def for_master(
        cls, master: MasterAddresses, global_segment_size: int, **kwargs: Any
    ) -> Self:
        """A pool (not started) on ``master``'s RPC and metadata servers.

        ``kwargs`` as for the constructor.
        """
        return cls(
            master_server_address=master.rpc_address,
            metadata_server=master.metadata_server,
            global_segment_size=global_segment_size,
            **kwargs,
        )

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, the real client's RPC address."""
        return f"{HOST}:{self.port}"

    @property
    def segment(self) -> str:
        """``127.0.0.1:<port>``, the segment name of its current start."""
        return f"{HOST}:{self.segment_port}"

    def _new_name(self) -> int:
        """A port for a new segment name, held here until `stop`.

        ``mooncake_client`` does not bind the port of its ``--host``, and
        a store client of this process names its segment after a port it
        holds: holding every name this pool used (an earlier start's
        segment outlives a SIGKILL until ``client_ttl``) keeps such a
        client from taking one.
        """
        while True:  # bounded: each pass holds a new port
            sock = hold_port(HOST)
            self._names.append(sock)
            port: int = sock.getsockname()[1]
            if port not in {self.port, self.http_port}:  # not yet bound
                return port

    def stop(self) -> int | None:
        """Stop the pool, then release the names it used."""
        rc = super().stop()
        while self._names:
            self._names.pop().close()
        return rc

    @property
    def health_url(self) -> str:
        """``http://127.0.0.1:<http port>/health``."""
        return f"http://{HOST}:{self.http_port}/health"

    def _ready_now(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=0.5):  # noqa: S310
                pass
        except OSError:
            return False
        try:
            probe_tcp(HOST, self.port, 0.5)
        except OSError:
            return False
        return True


def alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    return pid is not None and process_alive(pid)
