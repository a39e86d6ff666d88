"""The ``kv-lifecycle`` console script (``connector.ops.cli``).

``master`` runs as a subprocess, as an operator runs it: its JSON must let
a real store client connect, and SIGTERM or Ctrl-C must stop the master.
"""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from connector.config import StoreConfig
from connector.ops import cli
from connector.ops.master import MasterPorts, process_alive
from connector.store import Outcome, StoreClient
from connector.store.keys import KeyLayout, KeyScheme
from lifecycle import kv, pd, render

READY = re.compile(r"mooncake_master pid (\d+) ready")
BLOCK = 4096


class Command:
    """``python -m connector.ops.cli master ...``, stderr to a file."""

    def __init__(self, tmp_path, *args):
        self.err_path = tmp_path / "master.err"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "connector.ops.cli", "master", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )

    def json_line(self, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                return json.loads(self.proc.stdout.readline())
            if self.proc.poll() is not None:
                break
        pytest.fail(f"no JSON line; stderr: {self.err_path.read_text()}")

    def master_pid(self, timeout_s=5.0):
        """From the readiness line, written to stderr after the JSON."""
        deadline = time.monotonic() + timeout_s
        while (match := READY.search(self.err_path.read_text())) is None:
            assert time.monotonic() < deadline, self.err_path.read_text()
            time.sleep(0.05)
        return int(match.group(1))

    def stop(self, sig=signal.SIGTERM, timeout_s=15.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            self.proc.stdout.close()


@pytest.fixture
def command(tmp_path):
    made = []

    def start(*args):
        made.append(Command(tmp_path, *args))
        return made[-1]

    yield start
    for c in made:
        # SIGTERM, so the command stops its master (its own session).
        c.stop(signal.SIGTERM)
        match = READY.search(c.err_path.read_text())
        if match is not None and process_alive(int(match.group(1))):
            os.kill(int(match.group(1)), signal.SIGKILL)


@pytest.mark.mooncake
def test_master_config_connects_a_real_client_and_sigterm_stops_it(
    command, tmp_path, master_binary, kv_blocks, unique
):
    config_file = tmp_path / "conf" / "mooncake.json"
    run = command(
        f"--namespace={unique}",
        "--global-segment-size=32MiB",
        "--local-buffer-size=16MiB",
        f"--config-file={config_file}",
    )
    config = run.json_line()
    pid = run.master_pid()
    assert process_alive(pid)

    assert config["kv_connector"] == "MooncakeLifecycleConnector"
    assert "kv_connector_module_path" not in config
    assert config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    store = StoreConfig.from_extra_config(extra)
    assert store.namespace == unique
    assert store.protocol == "tcp"
    assert store.master_host == "127.0.0.1"
    # The MOONCAKE_CONFIG_PATH file says the same as the JSON.
    assert StoreConfig.from_file(config_file) == store
    assert StoreConfig.from_env({"MOONCAKE_CONFIG_PATH": str(config_file)})

    client = StoreClient.open(store)
    try:
        keys = KeyScheme(
            namespace=unique,
            model="cli",
            tp_rank=0,
            tp_size=1,
            layout=KeyLayout("uint8", 16, BLOCK),
        ).keys(range(4))
        src = kv_blocks(client, 4, BLOCK, seed=1)
        dst = kv_blocks(client, 4, BLOCK, seed=2)
        assert (
            list(client.put(keys, src.regions(range(4))))
            == [Outcome.STORED] * 4
        )
        assert (
            list(client.get(keys, dst.regions(range(4)))) == [Outcome.HIT] * 4
        )
        assert bytes(src.tensor.numpy()) == bytes(dst.tensor.numpy())
        src.release()
        dst.release()
    finally:
        client.close()

    assert run.stop(signal.SIGTERM) == 0
    assert not process_alive(pid)
    assert "signal 15" in run.err_path.read_text()


@pytest.mark.mooncake
def test_master_on_chosen_ports_stops_on_ctrl_c(command, master_binary):
    ports = MasterPorts.pick()
    run = command(
        f"--rpc-port={ports.rpc}",
        f"--http-port={ports.http}",
        f"--metrics-port={ports.metrics}",
        "--kv-role=kv_consumer",
    )
    config = run.json_line()
    extra = config["kv_connector_extra_config"]
    assert extra["master_server_address"] == f"127.0.0.1:{ports.rpc}"
    assert extra["metadata_server"] == (
        f"http://127.0.0.1:{ports.http}/metadata"
    )
    pid = run.master_pid()  # waits for the readiness line on stderr
    assert f"metrics http://127.0.0.1:{ports.metrics}/metrics" in (
        run.err_path.read_text()
    )
    assert config["kv_role"] == "kv_consumer"
    assert run.stop(signal.SIGINT) == 0
    assert not process_alive(pid)


@pytest.mark.mooncake
def test_master_exits_when_its_master_dies(command, master_binary):
    run = command()
    run.json_line()
    os.kill(run.master_pid(), signal.SIGKILL)
    assert run.proc.wait(timeout=10) == 1
    assert "exited" in run.err_path.read_text()


def test_master_start_failure_prints_no_config(tmp_path, capsys):
    missing = tmp_path / "no-such-master"
    status = cli.main(["master", f"--binary={missing}"])
    assert status == cli.EXIT_START_FAILED
    out, err = capsys.readouterr()
    assert out == ""
    assert str(missing) in err


def test_lifecycle_commands_get_their_argv_untouched(monkeypatch):
    seen = []

    def fake_main(argv):
        seen.append(argv)
        return 7

    import lifecycle.__main__  # noqa: PLC0415

    monkeypatch.setattr(lifecycle.__main__, "main", fake_main)
    argv = ["render", "--table", "pkg.mod:NAME", "--out", "d", "--check"]
    assert cli.main(argv) == 7
    assert cli.main(["replay", "t.jsonl", "--json"]) == 7
    assert seen == [argv, ["replay", "t.jsonl", "--json"]]


def test_table_and_render_run_the_lifecycle_commands(tmp_path, capsys):
    assert cli.main(["table"]) == 0
    assert capsys.readouterr().out == render.to_markdown(kv.TABLE)
    assert cli.main(["render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "lifecycle.dot").read_text() == render.to_dot(kv.TABLE)
    table = ["--table", "lifecycle.pd:PRODUCER"]
    assert cli.main(["render", *table, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "pd-producer.dot").read_text() == render.to_dot(
        pd.PRODUCER
    )


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("render", "table", "replay", "master"):
        assert name in out
    with pytest.raises(SystemExit):
        cli.main(["master", "--help"])
    assert "--config-file" in capsys.readouterr().out
