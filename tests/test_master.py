"""EmbeddedMaster: start, readiness, faults, restart and clean shutdown."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from connector.errors import (
    MasterBinaryNotFoundError,
    MasterNotRunningError,
    MasterStartError,
)
from connector.ops import master as master_mod
from connector.ops.master import (
    EmbeddedMaster,
    MasterPorts,
    MasterState,
    process_alive,
)

REPO = Path(__file__).resolve().parent.parent


def fake_binary(tmp_path, body: str) -> Path:
    path = tmp_path / "fake_master"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


@pytest.mark.mooncake
class TestRealMaster:
    def test_start_ready_stop(self, start_master):
        """Ready means /health says service_ready and RPC accepts."""
        master = start_master()
        ports = master.ports
        assert len({ports.rpc, ports.http, ports.metrics}) == 3
        assert f"127.0.0.1:{ports.rpc}" == master.rpc_address
        assert (
            f"http://127.0.0.1:{ports.http}/metadata" == master.metadata_server
        )
        assert master.metrics_url.endswith(f":{ports.metrics}/metrics")
        health = master.health_url  # always http://127.0.0.1:...
        with urllib.request.urlopen(health, timeout=2) as resp:  # noqa: S310
            assert json.loads(resp.read())["service_ready"] is True
        assert MasterState.RUNNING is master.state
        pid = master.pid
        assert process_alive(pid)

        assert master.stop() == 0
        assert not process_alive(pid)
        assert MasterState.STOPPED is master.state
        assert master.stop() is None  # idempotent

    def test_pause_resume_kill_restart(self, start_master):
        """Faults on demand; restart keeps the ports."""
        master = start_master()
        ports = master.ports
        master.pause()
        assert MasterState.PAUSED is master.state
        assert not master.is_ready()
        master.resume()
        assert master.is_ready()

        first = master.pid
        master.kill()
        assert MasterState.KILLED is master.state
        assert not master.running
        assert not process_alive(first)

        master.restart()
        assert ports == master.ports
        assert master.pid != first
        assert master.is_ready()
        assert (first, master.pid) == master.pids

    def test_context_manager_stops_on_error(self, master_binary):
        """Leaving the with-block by an exception stops the master."""
        master = EmbeddedMaster()
        seen: list[int] = []

        def fail_inside() -> None:
            with master:
                seen.append(master.pid)
                assert process_alive(master.pid)
                msg = "boom"
                raise RuntimeError(msg)

        with pytest.raises(RuntimeError, match="boom"):
            fail_inside()
        assert not process_alive(seen[0])

    def test_port_race_retries_with_new_ports(
        self, master_binary, monkeypatch, caplog
    ):
        """A port taken between pick and bind: retry on fresh ports.

        The failed attempt's output is forwarded to logging.
        """
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        real_pick = MasterPorts.pick
        picks: list[MasterPorts] = []

        def pick() -> MasterPorts:
            ports = real_pick()
            if not picks:
                taken = busy.getsockname()[1]
                ports = MasterPorts(ports.rpc, taken, ports.metrics)
            picks.append(ports)
            return ports

        monkeypatch.setattr(MasterPorts, "pick", staticmethod(pick))
        master = EmbeddedMaster(log_level=logging.INFO)
        with caplog.at_level(logging.INFO, logger="connector.ops.master"):
            try:
                master.start()
                assert len(picks) == 2
                assert picks[1] == master.ports
                assert len(master.pids) == 2
                assert not process_alive(master.pids[0])
            finally:
                master.stop()
                busy.close()
        forwarded = [
            r
            for r in caplog.records
            if r.name == f"connector.ops.master.{picks[0].rpc}"
        ]
        assert forwarded, "the failed master's output was not logged"
        assert any(r.levelno >= logging.ERROR for r in forwarded)

    def test_stopped_at_interpreter_exit(self, master_binary):
        """A script that never calls stop() (and fails) leaves no master."""
        script = textwrap.dedent(
            """
            from connector.ops.master import EmbeddedMaster
            master = EmbeddedMaster().start()
            print(master.pid, flush=True)
            raise SystemExit("demo failed")
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1, proc.stderr
        pid = int(proc.stdout.split()[0])
        deadline = time.monotonic() + 5
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(pid)


# An owner process: starts a master (from a thread that then exits, when
# asked), prints its pid and whether it still serves, then waits to die.
_OWNER = """
import sys, threading, time
from connector.ops.master import EmbeddedMaster
masters = []
def start():
    masters.append(EmbeddedMaster(start_timeout_s=30).start())
if sys.argv[1] == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()
    time.sleep(0.5)  # the starting thread is gone
else:
    start()
print(masters[0].pid, masters[0].is_ready(), flush=True)
time.sleep(120)
"""


def _wait_gone(pid: int, timeout_s: float) -> float | None:
    """Seconds until `pid` is gone (or a zombie); None if it is not."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if not process_alive(pid):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


@pytest.mark.mooncake
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux"
)
class TestDiesWithOwner:
    """A master whose owner dies without stopping it is not orphaned."""

    @pytest.mark.parametrize(
        ("how", "sig"),
        [("main", "SIGKILL"), ("main", "SIGTERM"), ("thread", "SIGKILL")],
    )
    def test_owner_death_ends_the_master(self, master_binary, how, sig):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        owner = subprocess.Popen(
            [sys.executable, "-c", _OWNER, how],
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        pid = None
        try:
            assert owner.stdout is not None
            pid_text, ready = owner.stdout.readline().split()
            pid = int(pid_text)
            assert ready == b"True"  # started from any thread, it serves
            assert process_alive(pid)
            owner.send_signal(getattr(signal, sig))
            owner.wait(timeout=10)
            gone_after = _wait_gone(pid, 2.0)
            assert gone_after is not None, f"master {pid} outlived its owner"
        finally:
            if owner.poll() is None:
                owner.kill()
                owner.wait(timeout=10)
            if pid is not None and process_alive(pid):
                os.kill(pid, signal.SIGKILL)


class TestWithoutMaster:
    def test_exits_early_is_a_typed_error(self, tmp_path, caplog):
        """A master that dies at once: MasterStartError with its output."""
        binary = fake_binary(
            tmp_path, 'echo "E0101 00:00:00 bad flag"; exit 3'
        )
        master = EmbeddedMaster(binary=binary, start_attempts=2)
        with (
            caplog.at_level(logging.DEBUG, logger="connector.ops.master"),
            pytest.raises(MasterStartError) as info,
        ):
            master.start()
        assert info.value.returncode == 3
        assert info.value.attempts == 2
        assert info.value.log_tail == ("E0101 00:00:00 bad flag",)
        assert "bad flag" in str(info.value)
        assert not master.running
        lines = [r for r in caplog.records if "bad flag" in r.getMessage()]
        assert lines
        assert lines[0].levelno == logging.ERROR

    def test_missing_binary_is_a_start_error(self, tmp_path):
        master = EmbeddedMaster(binary=tmp_path / "nope", start_attempts=1)
        with pytest.raises(MasterStartError, match="cannot execute"):
            master.start()

    def test_never_ready_times_out(self, tmp_path):
        """A process that never serves /health fails within the bound."""
        binary = fake_binary(tmp_path, "exec sleep 30")
        master = EmbeddedMaster(
            binary=binary, start_timeout_s=0.5, start_attempts=1
        )
        started = time.monotonic()
        with pytest.raises(MasterStartError) as info:
            master.start()
        assert time.monotonic() - started < 5
        assert info.value.returncode is None
        assert "not ready" in info.value.reason
        assert not any(process_alive(pid) for pid in master.pids)

    def test_operations_need_a_started_master(self):
        master = EmbeddedMaster()
        for operation in (master.pause, master.kill, master.restart):
            with pytest.raises(MasterNotRunningError):
                operation()
        with pytest.raises(MasterNotRunningError):
            _ = master.rpc_address
        assert MasterState.STOPPED is master.state
        assert "no ports" in repr(master)

    def test_binary_lookup_order(self, tmp_path, monkeypatch):
        """Next to sys.executable first, then PATH, else a clear error."""
        beside = tmp_path / "venv" / "bin"
        beside.mkdir(parents=True)
        (beside / "python").touch()
        monkeypatch.setattr(sys, "executable", str(beside / "python"))
        on_path = tmp_path / "path"
        on_path.mkdir()
        monkeypatch.setenv("PATH", str(on_path))
        monkeypatch.setattr(
            master_mod.importlib.util, "find_spec", lambda _: None
        )
        with pytest.raises(MasterBinaryNotFoundError) as info:
            master_mod.find_binary()
        assert str(beside) in info.value.searched

        fake_binary(on_path, "exit 0").rename(on_path / "mooncake_master")
        assert on_path / "mooncake_master" == master_mod.find_binary()
        fake_binary(beside, "exit 0").rename(beside / "mooncake_master")
        assert beside / "mooncake_master" == master_mod.find_binary()

    def test_command_passes_flags_through(self):
        master = EmbeddedMaster(
            lease_ttl_ms=500,
            client_ttl_s=2,
            eviction_high_watermark_ratio=0.8,
            eviction_ratio=0.1,
            extra_flags=["--rpc_thread_num=2"],
            binary="/bin/true",
        )
        master._ports = MasterPorts(1, 2, 3)
        argv = master.command()
        for flag in (
            "--rpc_port=1",
            "--http_metadata_server_port=2",
            "--metrics_port=3",
            "--enable_metric_reporting=false",
            "--default_kv_lease_ttl=500",
            "--client_ttl=2",
            "--eviction_high_watermark_ratio=0.8",
            "--eviction_ratio=0.1",
            "--rpc_thread_num=2",
        ):
            assert flag in argv
