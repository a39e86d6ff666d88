"""Closing a store client never stalls the process for long.

Mooncake's ``close()`` holds the GIL for its whole duration (every Python
thread stalls): about 1 s with the master up, 10-18 s with it gone (its
ping thread reconnects, then an unmount fails).  `StoreClient.close`
leaves the client to process exit when the master does not answer, and
at exit such a client ends the process right after Python's finalization,
before Mooncake's native teardown (`connector.store.clients.close_all`).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from connector.ops.master import store_config_for
from connector.store import StoreClient

pytestmark = pytest.mark.mooncake

EXIT_BOUND_S = 3.0
"""A process whose master died exits at once (measured 0.1 s; before:
10-18 s, Mooncake's teardown joining its reconnecting threads)."""

_CHILD = textwrap.dedent(
    """
    import sys
    from connector.ops.master import store_config_for
    from connector.store import clients

    class Master:
        rpc_address, metadata_server = sys.argv[1], sys.argv[2]

    clients.acquire(store_config_for(Master))
    print("ready", flush=True)
    sys.stdin.readline()  # the master is killed, then we exit
    sys.exit(3)  # the status survives the early end
    """
)


def _wait_unhealthy(client, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while client.raw.health_check() == 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert client.raw.health_check() != 0


def test_close_with_the_master_gone_does_not_stall_other_threads(
    start_master, caplog
):
    master = start_master()
    client = StoreClient.open(store_config_for(master))
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    master.kill()
    _wait_unhealthy(client)
    start = time.monotonic()
    assert not client.close()  # left to process exit
    took = time.monotonic() - start
    stop.set()
    ticker.join(5)
    during = [start, *(t for t in ticks if t >= start), start + took]
    gap = max(b - a for a, b in itertools.pairwise(during))
    assert took < 2.0, f"close() took {took:.1f} s"
    assert gap < 1.0, f"other threads stalled {gap:.1f} s"
    assert "does not answer" in caplog.text
    assert client.closed


def test_process_exits_in_bounded_time_after_its_master_died(start_master):
    master = start_master()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CHILD,
            master.rpc_address,
            master.metadata_server,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        master.kill()
        time.sleep(1.0)  # the child's client notices (health flag)
        start = time.monotonic()
        child.stdin.write("\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert took < EXIT_BOUND_S, f"exit took {took:.1f} s"
    assert child.returncode == 3, err[-2000:]
    assert "does not answer" in err
