"""An embedded ``mooncake_master``: ``kv-lifecycle master``, tests, demos.

Part of the product: ``kv-lifecycle master`` (``connector.ops.cli``) is
an operator command that runs a single-node master through this module,
so it lives in ``connector/`` (and ships in the wheel)
with its errors in ``connector.errors`` and its config constructor
(``store_config_for``) beside it, rather than moving to the test harness.
Tests, demos and benchmarks use it too, through the same public API.

``EmbeddedMaster`` starts the master binary shipped in the Mooncake wheel on
chosen or free loopback ports, waits until it serves requests, forwards its
output to Python logging and always stops it again (context manager,
explicit ``stop()``, and a finalizer that also runs at interpreter exit).
On Linux the master also dies with its owner when the owner cannot stop
it (SIGKILL, an unhandled SIGTERM, a crash): it is started with a
parent-death signal (``PR_SET_PDEATHSIG``), so no orphaned master keeps
its ports. ``kill()``, ``pause()``, ``resume()`` and ``restart()``
inject faults.

Example::

    with EmbeddedMaster(lease_ttl_ms=500) as master:
        config = store_config_for(master)
        ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import importlib.util
import json
import logging
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Protocol, Self

import attrs

from connector.config import StoreConfig
from connector.errors import (
    ConfigError,
    MasterBinaryNotFoundError,
    MasterNotRunningError,
    MasterStartError,
)
from connector.store.mooncake import probe_tcp

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

__all__ = [
    "EmbeddedMaster",
    "MasterAddresses",
    "MasterPorts",
    "MasterState",
    "find_binary",
    "store_config_for",
]

log = logging.getLogger(__name__)

BINARY_NAME = "mooncake_master"
HOST = "127.0.0.1"
_LOG_TAIL_LINES = 50
_POLL_S = 0.05
_MiB = 1024 * 1024


# Runs between the owner and the master binary: asks the kernel to
# SIGKILL this process when its parent dies (PR_SET_PDEATHSIG = 1; kept
# across execve), gives up if the owner died already, then becomes the
# master (same pid, so signals and /proc reach the master itself).
_LAUNCHER: Final = """\
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.stderr.write("W0000 00:00:00 launcher: PR_SET_PDEATHSIG failed\\n")
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _dies_with_owner(argv: list[str]) -> list[str]:
    """`argv` behind the parent-death launcher (Linux; else unchanged)."""
    if not sys.platform.startswith("linux"):
        return argv
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER]
    return [*launcher, str(os.getpid()), *argv]


class _Spawner:
    """Starts masters from one thread that lives as long as the process.

    Linux sends the parent-death signal when the *thread* that forked
    the child exits, not the process: a master started from a
    short-lived thread would die with that thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[
            tuple[
                concurrent.futures.Future[subprocess.Popen[bytes]],
                list[str],
                dict[str, Any],
            ]
        ] = queue.SimpleQueue()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(argv, **kwargs)``, run on the spawner thread.

        Raises:
            OSError: as ``Popen`` does.
        """
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve,
                    name="mooncake-master-spawner",
                    daemon=True,
                )
                self._thread.start()
        future: concurrent.futures.Future[subprocess.Popen[bytes]] = (
            concurrent.futures.Future()
        )
        self._jobs.put((future, argv, kwargs))
        return future.result()

    def _serve(self) -> None:
        while True:
            future, argv, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                proc = subprocess.Popen(argv, **kwargs)  # noqa: S603
            except BaseException as exc:  # noqa: BLE001 - handed over
                future.set_exception(exc)
            else:
                future.set_result(proc)


_SPAWNER: Final = _Spawner()


class MasterAddresses(Protocol):
    """What ``store_config_for`` needs of a master (duck-typed)."""

    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        ...  # pragma: no cover

    @property
    def metadata_server(self) -> str:
        """Transfer-engine metadata server URL."""
        ...  # pragma: no cover


def store_config_for(master: MasterAddresses, **overrides: Any) -> StoreConfig:
    """A loopback TCP ``StoreConfig`` for an embedded master (or HA set).

    Defaults: 256 MiB segment, 16 MiB buffer, ``127.0.0.1``, 2 s RPC
    timeout, one setup attempt, ``MC_LOG_LEVEL=ERROR``. ``overrides`` are
    field names, parsed and validated like the keys of a config file.

    Raises:
        ConfigError: an override is not a field, or a value is bad.
    """
    values: dict[str, object] = {
        "master_server_address": master.rpc_address,
        "metadata_server": master.metadata_server,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 256 * _MiB,
        "local_buffer_size": 16 * _MiB,
        "local_hostname": "127.0.0.1",
        "rpc_timeout_ms": 2000,
        "setup_retries": 1,
        "log_level": "ERROR",
    }
    cluster_id = getattr(master, "cluster_id", None)
    if master.rpc_address.startswith("etcd://") and cluster_id:
        values["cluster_id"] = cluster_id
    values.update(overrides)
    fields = attrs.fields_dict(StoreConfig)
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(key, value, "not a StoreConfig field")
    return StoreConfig.from_mapping(values, source="store_config_for")


class MasterState(enum.Enum):
    """Lifecycle of the embedded master process, as seen by its owner."""

    STOPPED = "stopped"
    RUNNING = "running"
    PAUSED = "paused"
    KILLED = "killed"


@attrs.frozen
class MasterPorts:
    """The three loopback ports a master listens on."""

    rpc: int
    http: int
    metrics: int

    @classmethod
    def pick(
        cls,
        *,
        rpc: int | None = None,
        http: int | None = None,
        metrics: int | None = None,
    ) -> MasterPorts:
        """Three distinct loopback ports: the given ones, the rest free.

        Free ports come from binding ``127.0.0.1:0`` (while the given ones
        are held too, where free, so none is picked twice); closing them
        races with other processes, and ``EmbeddedMaster.start`` retries
        with new free ports when that happens.
        """
        chosen = [rpc, http, metrics]
        socks: list[socket.socket] = []
        try:
            for port in chosen:
                if port is None:
                    continue
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                with contextlib.suppress(OSError):
                    s.bind((HOST, port))
            picked = []
            for port in chosen:
                if port is not None:
                    picked.append(port)
                    continue
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((HOST, 0))
                picked.append(s.getsockname()[1])
        finally:
            for s in socks:
                s.close()
        return cls(rpc=picked[0], http=picked[1], metrics=picked[2])


def find_binary() -> Path:
    """Locate the ``mooncake_master`` executable.

    Looks next to ``sys.executable`` (the venv's ``bin/``) first, then on
    ``PATH``, then inside the installed ``mooncake`` package.

    Raises:
        MasterBinaryNotFoundError: none of those places has it.
    """
    searched: list[str] = []
    beside = Path(sys.executable).parent / BINARY_NAME
    searched.append(str(beside.parent))
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    searched.append("PATH")
    on_path = shutil.which(BINARY_NAME)
    if on_path is not None:
        return Path(on_path)
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / BINARY_NAME
            searched.append(location)
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    raise MasterBinaryNotFoundError(tuple(searched))


def _stat_state(stat: Path) -> str | None:
    """The state letter of a Linux ``/proc/.../stat`` file (None: gone)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    return _stat_state(Path(f"/proc/{pid}/stat")) not in {None, "Z"}


def _task_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (Linux ``/proc``)."""
    tasks = Path(f"/proc/{pid}/task").glob("*/stat")
    return [s for s in map(_stat_state, tasks) if s is not None]


def _wait_stopped(pid: int, *, stopped: bool, timeout_s: float) -> None:
    """Wait until all threads of ``pid`` are (not) in the stopped state."""
    if not Path("/proc/self/task").is_dir():  # pragma: no cover - not Linux
        time.sleep(0.1)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        states = _task_states(pid)
        if states and all((s in {"T", "t"}) == stopped for s in states):
            return
        if time.monotonic() >= deadline:
            log.warning(
                "mooncake_master pid %d: threads not %s after %.1f s (%s)",
                pid,
                "stopped" if stopped else "running",
                timeout_s,
                "".join(states),
            )
            return
        time.sleep(0.005)


def _stop_process(
    proc: subprocess.Popen[bytes], timeout_s: float
) -> int | None:
    """SIGTERM (and SIGCONT, in case it is stopped), then SIGKILL."""
    if proc.poll() is not None:
        return proc.returncode
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
        # A SIGSTOPped process only acts on SIGTERM once
        # continued, so always continue it.
        proc.send_signal(signal.SIGCONT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning(
            "mooncake_master pid %d ignored SIGTERM for %.1f s; SIGKILL",
            proc.pid,
            timeout_s,
        )
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.exception("mooncake_master pid %d survived SIGKILL", proc.pid)
        return None


class _StartStop:
    """A context manager that starts on entry and stops on exit.

    ``__enter__`` returns ``start()``; ``__exit__`` calls ``stop()``.
    """

    def start(self) -> Self:
        """Start it; return ``self``."""
        raise NotImplementedError

    def stop(self) -> object:
        """Stop it (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _ChildProcess(_StartStop):
    """One supervised child at a time: spawn, log reader, bounded stop.

    Shared by ``EmbeddedMaster`` and ``connector.ops.procs.Supervised``:
    ``_launch`` starts the argv (behind the parent-death launcher where
    asked) on the spawner thread, registers its pid and a finalizer, and
    forwards a piped output to logging (keeping ``_tail``); ``_release``
    detaches the finalizer, stops the process (SIGTERM, then SIGKILL
    after ``stop_timeout_s``) and joins the reader.
    """

    stop_timeout_s: float

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._finalizer: weakref.finalize[..., _ChildProcess] | None = None
        self._pids: list[int] = []
        self._tail: collections.deque[str] = collections.deque(
            maxlen=_LOG_TAIL_LINES
        )
        self._lock = threading.RLock()

    def _launch(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        stdout: Any,
        dies_with_owner: bool,
        logger: str,
        level: int,
        thread_name: str,
    ) -> subprocess.Popen[bytes]:
        """Spawn ``argv`` and supervise it.

        Raises:
            OSError: as ``Popen`` does.
        """
        proc = _SPAWNER.popen(
            _dies_with_owner(argv) if dies_with_owner else argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._proc = proc
        self._pids.append(proc.pid)
        self._finalizer = weakref.finalize(
            self, _stop_process, proc, self.stop_timeout_s
        )
        if proc.stdout is not None:
            self._reader = threading.Thread(
                target=_forward_lines,
                args=(
                    proc.stdout,
                    logging.getLogger(logger),
                    level,
                    self._tail,
                ),
                name=f"{thread_name}-{proc.pid}",
                daemon=True,
            )
            self._reader.start()
        return proc

    def _await_ready(
        self,
        proc: subprocess.Popen[bytes],
        ready: Callable[[], bool],
        timeout_s: float,
        fail: Callable[[str, int | None], Exception],
    ) -> None:
        """Poll ``ready()`` every 50 ms until it passes.

        Raises:
            Exception: ``fail(reason, status)`` once ``proc`` exited or
                ``timeout_s`` passed (``status`` ``None``), after
                ``_shutdown()``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            rc = proc.poll()
            if rc is not None:
                self._shutdown()
                reason = "exited before becoming ready"
                raise fail(reason, rc)
            if ready():
                return
            if time.monotonic() >= deadline:
                self._shutdown()
                reason = f"not ready within {timeout_s:.1f} s"
                raise fail(reason, None)
            time.sleep(_POLL_S)

    def _shutdown(self) -> int | None:
        """Stop the current process; its exit status."""
        stopped = self._release()
        return None if stopped is None else stopped[1]

    def _release(self) -> tuple[int, int | None] | None:
        """Stop the current process; ``(pid, status)``, ``None``: none."""
        proc, self._proc = self._proc, None
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if proc is None:
            return None
        rc = _stop_process(proc, self.stop_timeout_s)
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.join(timeout=1.0)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.pid, rc


class EmbeddedMaster(_ChildProcess):
    """A ``mooncake_master`` child process on free loopback ports.

    Contracts:

    - ``start()`` returns only once ``/health`` reports ``service_ready``
      and the RPC port accepts connections; it retries with new ports when
      the process exits early (a port race), and raises
      ``MasterStartError`` otherwise. The process never outlives the
      interpreter: a ``weakref.finalize`` (run at exit too) stops it,
      and on Linux the kernel kills it when the owner process dies
      without stopping it (SIGKILL, an unhandled SIGTERM).
    - ``stop()`` is idempotent and bounded: SIGTERM, then SIGKILL after
      ``stop_timeout_s``.
    - ``restart()`` brings the master back on the *same* ports (clients
      re-mount automatically, but a restarted master has lost every key).
    - Output lines go to the logger ``connector.ops.master.<rpc_port>`` at
      ``log_level`` from a daemon reader thread (glog ``W``/``E``/``F``
      lines are raised to WARNING/ERROR/CRITICAL if that is higher); the
      last lines are kept in ``log_tail``.

    Args:
        lease_ttl_ms: ``--default_kv_lease_ttl`` (ms); ``None`` keeps 10 s.
        client_ttl_s: ``--client_ttl`` (s); ``None`` keeps 10 s.
        eviction_high_watermark_ratio: passed through when not ``None``.
        eviction_ratio: passed through when not ``None``.
        extra_flags: more ``--flag=value`` arguments, appended verbatim.
        log_level: level at which the master's output is logged.
        binary: the executable; default ``find_binary()``.
        start_timeout_s: readiness bound per start attempt.
        stop_timeout_s: SIGTERM grace period before SIGKILL.
        start_attempts: how many port picks ``start()`` tries (one when
            every port is given).
        rpc_port: fixed ``--rpc_port``; ``None`` picks a free one.
        http_port: fixed metadata-server port; ``None`` picks one.
        metrics_port: fixed ``--metrics_port``; ``None`` picks one.
        etcd_endpoints: HA mode (``--enable_ha``): the etcd endpoints
            (``host:port;host:port``) through which masters elect a
            leader; a standby counts as ready (``/health`` names its
            role), only the leader serves.
        cluster_id: ``--cluster_id`` of the HA set.
        enable_oplog: ``--enable_oplog`` in HA mode: the leader's
            metadata is replicated, so stored blocks survive failover.
    """

    def __init__(
        self,
        *,
        lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = None,
        eviction_high_watermark_ratio: float | None = None,
        eviction_ratio: float | None = None,
        extra_flags: Sequence[str] = (),
        log_level: int = logging.DEBUG,
        binary: Path | str | None = None,
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 5.0,
        start_attempts: int = 3,
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        etcd_endpoints: str | None = None,
        cluster_id: str = "mooncake_cluster",
        enable_oplog: bool = True,
    ) -> None:
        super().__init__()
        self.etcd_endpoints = etcd_endpoints
        self.cluster_id = cluster_id
        self.enable_oplog = enable_oplog
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.eviction_high_watermark_ratio = eviction_high_watermark_ratio
        self.eviction_ratio = eviction_ratio
        self.extra_flags = tuple(extra_flags)
        self.log_level = log_level
        self.binary = Path(binary) if binary is not None else None
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.start_attempts = max(1, start_attempts)
        chosen = {"rpc": rpc_port, "http": http_port, "metrics": metrics_port}
        self._fixed = {k: v for k, v in chosen.items() if v is not None}
        if len(self._fixed) == len(chosen):
            self.start_attempts = 1  # the same ports would fail the same
        self._ports: MasterPorts | None = None
        self._state = MasterState.STOPPED

    # -- addresses ---------------------------------------------------------

    @property
    def ports(self) -> MasterPorts:
        """The ports of the started master."""
        if self._ports is None:
            operation = "ports"
            raise MasterNotRunningError(operation)
        return self._ports

    @property
    def rpc_address(self) -> str:
        """``"127.0.0.1:<rpc port>"``, the clients' master address."""
        return f"{HOST}:{self.ports.rpc}"

    @property
    def metadata_server(self) -> str:
        """``"http://127.0.0.1:<http port>/metadata"`` (transfer engine)."""
        return f"http://{HOST}:{self.ports.http}/metadata"

    @property
    def metrics_url(self) -> str:
        """``"http://127.0.0.1:<metrics port>/metrics"``."""
        return f"http://{HOST}:{self.ports.metrics}/metrics"

    @property
    def health_url(self) -> str:
        """``"http://127.0.0.1:<metrics port>/health"``."""
        return f"http://{HOST}:{self.ports.metrics}/health"

    @property
    def pid(self) -> int | None:
        """The current (or last) process id; ``None`` before any start."""
        return self._pids[-1] if self._pids else None

    @property
    def pids(self) -> tuple[int, ...]:
        """Every process id this object spawned (restarts included)."""
        return tuple(self._pids)

    @property
    def state(self) -> MasterState:
        """What the owner last did to the process (or observed of it)."""
        with self._lock:
            if (
                self._state in {MasterState.RUNNING, MasterState.PAUSED}
                and self._proc is not None
                and self._proc.poll() is not None
            ):
                self._state = MasterState.STOPPED
            return self._state

    @property
    def running(self) -> bool:
        """Whether the process is alive (paused counts as alive)."""
        return self.state in {MasterState.RUNNING, MasterState.PAUSED}

    @property
    def log_tail(self) -> tuple[str, ...]:
        """The master's last output lines (at most 50)."""
        return tuple(self._tail)

    def command(self) -> list[str]:
        """The argv the master is started with (needs ports)."""
        ports = self.ports
        binary = self.binary if self.binary is not None else find_binary()
        argv = [
            str(binary),
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={ports.http}",
            f"--rpc_address={HOST}",
            f"--rpc_port={ports.rpc}",
            f"--metrics_host={HOST}",
            f"--metrics_port={ports.metrics}",
            "--enable_metric_reporting=false",
        ]
        if self.etcd_endpoints is not None:
            argv += [
                "--enable_ha=true",
                f"--etcd_endpoints={self.etcd_endpoints}",
                f"--cluster_id={self.cluster_id}",
                f"--enable_oplog={str(self.enable_oplog).lower()}",
            ]
        if self.lease_ttl_ms is not None:
            argv.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        if self.client_ttl_s is not None:
            argv.append(f"--client_ttl={self.client_ttl_s}")
        if self.eviction_high_watermark_ratio is not None:
            argv.append(
                "--eviction_high_watermark_ratio="
                f"{self.eviction_high_watermark_ratio}"
            )
        if self.eviction_ratio is not None:
            argv.append(f"--eviction_ratio={self.eviction_ratio}")
        argv.extend(self.extra_flags)
        return argv

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> Self:
        """Start the master on fresh free ports and wait until it is ready.

        Returns:
            ``self``, so ``master = EmbeddedMaster().start()`` works.

        Raises:
            MasterStartError: every attempt failed.
            MasterBinaryNotFoundError: no executable.
        """
        with self._lock:
            if self.running:
                return self
            last: MasterStartError | None = None
            for attempt in range(1, self.start_attempts + 1):
                self._ports = MasterPorts.pick(**self._fixed)
                try:
                    self._spawn_and_wait(attempt)
                except MasterStartError as exc:
                    last = exc
                    log.warning(
                        "mooncake_master start attempt %d/%d failed: %s",
                        attempt,
                        self.start_attempts,
                        exc.reason,
                    )
                    continue
                return self
            self._ports = None
            if last is None:  # pragma: no cover - start_attempts >= 1
                msg = "no start attempt was made"
                raise MasterStartError(msg, None, 0, ())
            raise last

    def restart(self) -> Self:
        """Stop the master if it runs, then start it again on the same ports.

        Raises:
            MasterNotRunningError: it was never started (no ports to reuse).
            MasterStartError: it did not come back within the bound.
        """
        with self._lock:
            if self._ports is None:
                operation = "restart"
                raise MasterNotRunningError(operation)
            self._shutdown()
            deadline = time.monotonic() + self.start_timeout_s
            attempt = 0
            while True:
                attempt += 1
                try:
                    self._spawn_and_wait(attempt)
                except MasterStartError:
                    # The old process's sockets may linger for
                    # a moment; the ports are ours, so keep trying them.
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
                    continue
                return self

    def stop(self) -> int | None:
        """Stop the master (SIGTERM, then SIGKILL); idempotent and bounded.

        Returns:
            The exit status, or ``None`` if it never ran.
        """
        with self._lock:
            rc = self._shutdown()
            self._state = MasterState.STOPPED
            return rc

    def kill(self) -> None:
        """SIGKILL the master now, as a crash would (fault injection)."""
        with self._lock:
            proc = self._require_proc("kill")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=self.stop_timeout_s)
            self._state = MasterState.KILLED

    def pause(self) -> None:
        """SIGSTOP the master: it keeps its sockets but answers nothing.

        Returns once every thread of the process is stopped (signals are
        delivered asynchronously; without the wait a request sent right
        after ``pause()`` may still be answered).
        """
        with self._lock:
            proc = self._require_proc("pause")
            proc.send_signal(signal.SIGSTOP)
            _wait_stopped(proc.pid, stopped=True, timeout_s=2.0)
            self._state = MasterState.PAUSED

    def resume(self) -> None:
        """SIGCONT a paused master; returns once it runs again."""
        with self._lock:
            proc = self._require_proc("resume")
            proc.send_signal(signal.SIGCONT)
            _wait_stopped(proc.pid, stopped=False, timeout_s=2.0)
            self._state = MasterState.RUNNING

    def health(self) -> dict[str, Any] | None:
        """The ``/health`` JSON (``None``: no answer).

        HA masters add ``role`` (``leader``/``standby``), ``ha_state``
        and ``leader_address``.
        """
        try:
            with urllib.request.urlopen(  # noqa: S310 - fixed http URL
                self.health_url, timeout=0.5
            ) as resp:
                body = json.loads(resp.read().decode("utf-8", "replace"))
        except (OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    def serving(self) -> bool:
        """Whether ``/health`` says ``service_ready`` (an HA leader)."""
        body = self.health()
        return body is not None and body.get("service_ready") is True

    def is_ready(self) -> bool:
        """One readiness probe: ``/health`` ready and RPC port accepting.

        In HA mode a master that answers ``/health`` with a role is ready
        (a standby never serves; ``HAMasters`` waits for the leader).
        """
        body = self.health()
        if body is None:
            return False
        if self.etcd_endpoints is not None:
            return body.get("role") in {"leader", "standby"}
        if body.get("service_ready") is not True:
            return False
        try:
            probe_tcp(HOST, self.ports.rpc, 0.5)
        except OSError:
            return False
        return True

    def __repr__(self) -> str:
        ports = self._ports
        where = "no ports" if ports is None else self.rpc_address
        return f"<EmbeddedMaster {self.state.value} {where} pid={self.pid}>"

    # -- internals ---------------------------------------------------------

    def _require_proc(self, operation: str) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise MasterNotRunningError(operation)
        return proc

    def _spawn_and_wait(self, attempt: int) -> None:
        argv = self.command()
        env = dict(os.environ)
        env.setdefault("GLOG_minloglevel", "1")
        log.debug("starting mooncake_master: %s", " ".join(argv))
        self._tail.clear()
        binary = Path(argv[0])
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            # Checked here: behind the launcher, a bad binary would only
            # show as an early exit of the launcher.
            reason = f"cannot execute {argv[0]}: not an executable file"
            raise MasterStartError(reason, None, attempt, ())
        try:
            proc = self._launch(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                dies_with_owner=True,
                logger=f"{__name__}.{self.ports.rpc}",
                level=self.log_level,
                thread_name="mooncake-master-log",
            )
        except OSError as exc:
            reason = f"cannot execute {argv[0]}: {exc}"
            raise MasterStartError(reason, None, attempt, ()) from exc

        def fail(reason: str, rc: int | None) -> MasterStartError:
            if rc is not None:
                reason = f"exited with status {rc} before becoming ready"
            return MasterStartError(reason, rc, attempt, self.log_tail)

        self._await_ready(proc, self.is_ready, self.start_timeout_s, fail)
        self._state = MasterState.RUNNING
        log.info(
            "mooncake_master pid %d ready at %s (metadata %s)",
            proc.pid,
            self.rpc_address,
            self.metadata_server,
        )

    def _shutdown(self) -> int | None:
        stopped = self._release()
        if stopped is None:
            return None
        pid, rc = stopped
        self._state = MasterState.STOPPED
        log.debug("mooncake_master pid %d exited with %s", pid, rc)
        return rc


_GLOG_LEVELS: Final = {
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}
_GLOG_RE: Final = re.compile(r"^([IWEF])\d{4} ")


def _line_level(line: str, level: int) -> int:
    """``level``, raised to the glog severity of the line (W/E/F)."""
    match = _GLOG_RE.match(line)
    if match is None:
        return level
    return max(level, _GLOG_LEVELS.get(match.group(1), level))


def _forward_lines(
    stream: IO[bytes],
    logger: logging.Logger,
    level: int,
    tail: collections.deque[str],
) -> None:
    """Reader thread body: log every output line until EOF."""
    with contextlib.suppress(ValueError, OSError):
        for raw in stream:
            line = raw.decode("utf-8", "replace").rstrip()
            if not line:
                continue
            tail.append(line)
            logger.log(_line_level(line, level), "%s", line)
