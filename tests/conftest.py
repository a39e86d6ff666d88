"""Shared fixtures: an embedded ``mooncake_master`` and store helpers.

The session master runs with a 500 ms lease TTL and a 2 s client TTL so
removal and eviction are quick. Tests that kill or pause a master, or need
a tiny store, start their own through ``start_master`` (stopped at the end
of the test or module that asked). No test assumes fixed ports, and the
session ends by checking that no master this run started is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Mooncake reads MC_LOG_LEVEL at the first setup() in the
# process; set it before any client exists.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from connector.config import MiB, StoreConfig
from connector.errors import MasterBinaryNotFoundError
from connector.ops.master import (
    EmbeddedMaster,
    find_binary,
    process_alive,
    store_config_for,
)
from connector.store import Regions, StoreClient
from tests.connector_helpers import store_extra
from tests.scheduler_guard import SchedulerThreadGuard

_MASTERS: list[EmbeddedMaster] = []

# The Python matrix (scripts/pymatrix.sh) runs the suite in venvs that
# lack the packages KV_PYMATRIX names (torch, vllm): a test module whose
# import stops at one of those, or a test whose set-up or body does, is
# skipped there, naming the package.  Any other import error, or any
# other missing module, still fails.
_MATRIX_ABSENT = frozenset(
    name for name in os.environ.get("KV_PYMATRIX", "").split(",") if name
)


def _absent(exc: BaseException | None) -> str | None:
    """The matrix-absent package whose import raised `exc`, or None."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    root = (exc.name or "").partition(".")[0]
    return root if root in _MATRIX_ABSENT else None


def _skip_if_absent(item: pytest.Item, exc: BaseException) -> None:
    root = _absent(exc)
    if root is not None:
        pytest.skip(f"{item.nodeid} needs {root}, absent from the matrix venv")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        _skip_if_absent(item, exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        _skip_if_absent(item, exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if not (
        _MATRIX_ABSENT
        and report.failed
        and isinstance(collector, pytest.Module)
    ):
        return report
    root = _import_stopped_at(collector)
    if root is not None:
        report.outcome = "skipped"
        report.longrepr = (
            str(collector.path),
            0,
            f"Skipped: needs {root}, absent from the matrix venv",
        )
    return report


def _import_stopped_at(module: pytest.Module) -> str | None:
    """The matrix-absent package the import of `module` stopped at."""
    try:
        module.obj  # noqa: B018 - imports the module again
    except module.CollectError as exc:
        return _absent(exc.__cause__)
    except Exception:  # noqa: BLE001 - the failed report already says why
        return None
    return None


def _pgrep() -> set[int]:
    if shutil.which("pgrep") is None:
        return set()
    out = subprocess.run(
        ["pgrep", "-x", "mooncake_master"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return {int(pid) for pid in out.split()}


@pytest.fixture(autouse=True)
def scheduler_thread_guard():
    """Every test: no scheduler-side hook may call the store.

    See `tests.scheduler_guard`; a call is raised inside the hook and,
    in case something swallowed it, fails the test here.
    """
    guard = SchedulerThreadGuard()
    with guard.installed():
        yield guard
    assert guard.violations == [], guard.violations[:5]


@pytest.fixture(scope="session", autouse=True)
def _no_master_left_behind():
    """After the whole run, no ``mooncake_master`` we started survives."""
    before = _pgrep()
    yield
    spawned = {pid for master in _MASTERS for pid in master.pids}
    alive = {pid for pid in spawned if process_alive(pid)}
    assert not alive, f"mooncake_master left running: {sorted(alive)}"
    # Other suites on the machine may run masters; only ours are checked.
    assert not (_pgrep() - before) & spawned


@pytest.fixture(scope="session")
def master_binary() -> Path:
    try:
        return find_binary()
    except MasterBinaryNotFoundError as exc:
        pytest.skip(str(exc))


class MasterPool:
    """Starts masters and stops every one of them at teardown."""

    def __init__(self) -> None:
        self.masters: list[EmbeddedMaster] = []

    def start(self, **kwargs) -> EmbeddedMaster:
        master = EmbeddedMaster(**kwargs)
        self.masters.append(master)
        _MASTERS.append(master)
        return master.start()

    def stop_all(self) -> None:
        for master in self.masters:
            master.stop()


@pytest.fixture
def start_master(master_binary):
    """Test-scoped factory: ``start_master(lease_ttl_ms=...)``."""
    pool = MasterPool()
    yield pool.start
    pool.stop_all()


@pytest.fixture(scope="session")
def mooncake_master(master_binary):
    """The session's shared master (lease TTL 500 ms, client TTL 2 s)."""
    pool = MasterPool()
    master = pool.start(lease_ttl_ms=500, client_ttl_s=2)
    yield master
    pool.stop_all()


@pytest.fixture(scope="session")
def store_config(mooncake_master) -> StoreConfig:
    return store_config_for(
        mooncake_master,
        global_segment_size=256 * MiB,
        namespace="tests",
    )


@pytest.fixture(scope="session")
def store_client(store_config):
    """A session-wide client with a 256 MiB segment (regions checked)."""
    client = StoreClient.open(store_config, check_regions=True)
    yield client
    client.close()


@pytest.fixture
def unique() -> str:
    """A fresh token for namespaces and hashes, so tests never collide."""
    return uuid.uuid4().hex[:12]


@pytest.fixture
def extra(mooncake_master, unique) -> dict[str, str]:
    """The connector's extra config for the session master, own namespace."""
    return store_extra(mooncake_master, unique)


@pytest.fixture
def harnesses():
    """A list to append `Harness`es to; closed in reverse at teardown."""
    made: list = []
    yield made
    for h in reversed(made):
        h.close()


@pytest.fixture
def workers(store_client):
    """`tests.worker_helpers.Workers` on the session client: the workers
    added are shut down and their memory unregistered at teardown.
    """
    from tests.worker_helpers import Workers  # noqa: PLC0415

    made = Workers(store_client)
    yield made
    made.close()


class KVBlocks:
    """A registered CPU tensor of ``n`` KV blocks of ``block_bytes`` each."""

    def __init__(self, client, n: int, block_bytes: int, *, seed: int = 0):
        import torch  # noqa: PLC0415

        gen = torch.Generator().manual_seed(seed)
        self.client = client
        self.block_bytes = block_bytes
        self.tensor = torch.randint(
            0, 256, (n, block_bytes), dtype=torch.uint8, generator=gen
        )
        client.register_tensor(self.tensor)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def regions(self, ids) -> Regions:
        return Regions.blocks(self.base, self.block_bytes, list(ids))

    def zero(self) -> None:
        self.tensor.zero_()

    def release(self) -> None:
        if not self.client.closed:
            self.client.unregister(self.base)


@pytest.fixture
def kv_blocks():
    """Factory ``kv_blocks(client, n, block_bytes, seed=0)``.

    The tensors are unregistered when the test ends, so freed memory never
    stays registered (its addresses get reused by later allocations).
    """
    made: list[KVBlocks] = []

    def make(client, n: int, block_bytes: int, *, seed: int = 0) -> KVBlocks:
        blocks = KVBlocks(client, n, block_bytes, seed=seed)
        made.append(blocks)
        return blocks

    yield make
    for blocks in made:
        blocks.release()


@pytest.fixture(scope="module")
def own_and_reader(master_binary):
    """A client holding every replica (the only segment) and a reader
    with no segment, on a master of their own: ``(owner, reader)``."""
    import attrs  # noqa: PLC0415

    from connector.ops.master import store_config_for  # noqa: PLC0415
    from connector.store import StoreClient  # noqa: PLC0415

    del master_binary  # the wheel's master is there
    pool = MasterPool()
    try:
        master = pool.start(lease_ttl_ms=500, client_ttl_s=60)
        config = store_config_for(master, global_segment_size=16 * 1024 * 1024)
        with (
            StoreClient.open(config, check_regions=True) as owner,
            StoreClient.open(
                attrs.evolve(config, global_segment_size=0),
                check_regions=True,
            ) as reader,
        ):
            yield owner, reader
    finally:
        pool.stop_all()


REPO = Path(__file__).resolve().parent.parent


def pool_argv(master: EmbeddedMaster, *flags: str) -> list[str]:
    """``kv-lifecycle pool`` against ``master``: a 32 MB pool, ``flags``."""
    return [
        sys.executable,
        "-m",
        "connector.ops.cli",
        "pool",
        f"--master-server-address={master.rpc_address}",
        f"--metadata-server={master.metadata_server}",
        "--global-segment-size=32MB",
        *flags,
    ]


@contextlib.contextmanager
def pool_command(
    master: EmbeddedMaster, *flags: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """Run ``kv-lifecycle pool``; the process and the engines' extra
    config it printed.

    A body that ends normally has the command stopped by SIGTERM (unless
    it already exited) and its exit status asserted 0; the process is
    killed whatever happens.
    """
    proc = subprocess.Popen(
        pool_argv(master, *flags),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        printed = json.loads(proc.stdout.readline())
        yield proc, printed["kv_connector_extra_config"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """Listen on loopback ``port`` meanwhile, as a process that took it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        thief.bind(("127.0.0.1", port))
        thief.listen()
        yield
