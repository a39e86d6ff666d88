"""One cluster instance in its own OS process, driven over a pipe.

`Node.spawn` starts a process (multiprocessing ``spawn``: a Mooncake
client must never be forked) that imports vLLM and waits for commands.
Each ``open`` builds a `harness.scheduler.Harness`: vLLM 0.33's real
scheduler with the project's connector, and the worker half in the same
process, so its store client contributes this process's own segment to
the master named in the extra config.  A process may open several
harnesses (one per master).  ``run`` plays a paced workload through a
harness and returns, per request, its status, time to first token (in
engine steps and in ms from arrival), external hit tokens and load
outcomes, plus every check the harness failed (wrong KV, leaked block,
unfinished request) as text.

Every wait on the pipe is bounded; `Node.kill` is SIGKILL; `Node.close`
asks the process to quit and kills it if it does not.  The process's
stderr (Mooncake's glog lines) goes to a log file.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

CONNECTOR = "connector.MooncakeLifecycleConnector"


class NodeError(RuntimeError):
    """A node did not answer in time, died, or raised."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"node {name}: {reason}")
        self.name = name
        self.reason = reason


class Node:
    """The parent's handle on one instance process."""

    def __init__(
        self, name: str, process: Any, conn: Connection, log_path: Path
    ) -> None:
        self.name = name
        self.process = process
        self.conn = conn
        self.log_path = log_path

    @classmethod
    def spawn(cls, name: str, log_dir: Path) -> Node:
        """Start the process; it imports vLLM before its first command."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        log_path = log_dir / f"{name}.log"
        process = ctx.Process(
            target=serve,
            args=(child, name, str(log_path)),
            name=f"cluster-{name}",
            daemon=True,
        )
        process.start()
        child.close()
        return cls(name, process, parent, log_path)

    @property
    def pid(self) -> int:
        """The process id."""
        return int(self.process.pid)

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return bool(self.process.is_alive())

    def send(self, command: str, **args: Any) -> None:
        """Send a command without waiting for its answer."""
        self.conn.send((command, args))

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """The answer to the last command sent.

        Raises:
            NodeError: no answer within `timeout_s`, the process died, or
                the command raised in the node.
        """
        end = time.monotonic() + timeout_s
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise NodeError(self.name, "died")
            if time.monotonic() > end:
                raise NodeError(self.name, f"no answer in {timeout_s} s")
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError as exc:
            raise NodeError(self.name, "pipe closed") from exc
        if "error" in reply:
            raise NodeError(self.name, str(reply["error"]))
        return reply

    def call(
        self, command: str, timeout_s: float = 120.0, **args: Any
    ) -> dict[str, Any]:
        """Send a command and wait (bounded) for its answer."""
        self.send(command, **args)
        return self.receive(timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (a crash: no clean-up of any kind)."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self, timeout_s: float = 15.0) -> None:
        """Ask the process to quit; SIGKILL it if it does not in time."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, NodeError):
                self.call("quit", timeout_s=timeout_s)
            self.process.join(timeout_s)
        self.kill()
        self.conn.close()


# ------------------------------------------------------------- in the node


def serve(conn: Connection, name: str, log_path: str) -> None:
    """The node's main loop: one command, one answer, until ``quit``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import vllm.v1.core.sched.scheduler  # noqa: F401, PLC0415 - warm up

    _same_model_everywhere(Path(log_path).parent)
    node = _NodeState(name)
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        if command == "quit":
            conn.send({"ok": True})
            break
        try:
            reply = getattr(node, f"do_{command}")(**args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            reply = {"error": f"{exc!r}\n{traceback.format_exc()}"}
        conn.send(reply)
    node.close()


def _same_model_everywhere(root: Path) -> None:
    """Give every node the same tiny model folder.

    Keys carry the model's full path; the harness makes a fresh
    temporary folder per process, so instances would never share a key.
    Every node writes the same `config.json`, each through its own
    temporary file and an atomic rename.
    """
    import harness.scheduler as scheduler_harness  # noqa: PLC0415

    make = scheduler_harness._tiny_model_dir  # noqa: SLF001

    @functools.cache
    def tiny_model_dir(num_layers: int, max_model_len: int) -> Path:
        source = make(num_layers, max_model_len)
        name = f"tiny-llama-{num_layers}l-{max_model_len}"
        folder = root / "models" / name
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f".config.json.{os.getpid()}"
        shutil.copy(source / "config.json", mine)
        mine.replace(folder / "config.json")
        return folder

    scheduler_harness._tiny_model_dir = tiny_model_dir  # noqa: SLF001


class _Counting(logging.Handler):
    """Counts connector log records of WARNING and above, by level."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[record.levelname] += 1


class _NodeState:
    def __init__(self, name: str) -> None:
        self.name = name
        self.harnesses: dict[str, Any] = {}
        self.loads: dict[str, dict[str, list[bool]]] = {}
        self.store: dict[str, dict[str, collections.Counter[str]]] = {}
        self.partial: dict[str, collections.Counter[str]] = {}
        self.logs = _Counting()
        logging.getLogger("connector").addHandler(self.logs)

    def do_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def do_open(
        self, key: str, extra: dict[str, Any], **harness: Any
    ) -> dict[str, Any]:
        from connector.metadata import JobKind  # noqa: PLC0415
        from harness import Harness  # noqa: PLC0415

        h = Harness(CONNECTOR, extra_config=extra, **harness)
        self.harnesses[key] = h
        loads: dict[str, list[bool]] = collections.defaultdict(list)
        self.loads[key] = loads
        side = h.scheduler_connector.scheduler_side
        finish = side._finish_job  # noqa: SLF001

        def spy(settled: Any) -> bool:
            job, ok = settled
            if job.kind is JobKind.LOAD:
                loads[job.req_id].append(bool(ok))
            return bool(finish(settled))

        side._finish_job = spy  # noqa: SLF001
        memory = side.failed_keys
        ended = memory.loaded
        partial: collections.Counter[str] = collections.Counter()
        self.partial[key] = partial

        def loaded(keys: Any, failed: Any = ()) -> None:
            keys, failed = list(keys), list(failed)
            if failed:
                partial[f"{len(failed)}/{len(keys)}"] += 1
            ended(keys, failed)

        memory.loaded = loaded
        counts: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.store[key] = counts
        for connector in (h.scheduler_connector, h.worker_connector):
            _fold_store_stats(connector, counts)
        client = h.worker_connector._client  # noqa: SLF001
        return {"hostname": client.hostname if client else ""}

    def do_run(
        self,
        key: str,
        requests: list[tuple[str, list[int], int]],
        interval_s: float = 0.0,
        deadline_s: float = 60.0,
    ) -> dict[str, Any]:
        h = self.harnesses[key]
        loads = self.loads[key]
        pending = collections.deque(requests)
        added: dict[str, tuple[int, float]] = {}
        first: dict[str, tuple[int, float]] = {}
        started = time.monotonic()
        end = started + deadline_s
        next_at = started
        while (pending or not h.is_idle()) and time.monotonic() < end:
            now = time.monotonic()
            while pending and now >= next_at:
                req_id, prompt, max_tokens = pending.popleft()
                h.add_request(req_id, prompt, max_tokens)
                added[req_id] = (h.num_steps, now)
                next_at += interval_s
            if h.is_idle():
                time.sleep(min(max(next_at - now, 0.0), 0.01))
                continue
            report = h.step()
            now = time.monotonic()
            for req_id, (step, at) in added.items():
                if req_id not in first and h.requests[req_id].output_token_ids:
                    first[req_id] = (h.num_steps - step, (now - at) * 1e3)
            if not report.scheduled:
                time.sleep(0.002)  # only transfers pending
        failures: list[str] = []
        try:
            h.check()
        except AssertionError as exc:
            failures.append(str(exc))
        records = {
            req_id: {
                "status": h.finished_status.get(req_id, "UNFINISHED"),
                "ttft_steps": first.get(req_id, (-1, -1.0))[0],
                "ttft_ms": first.get(req_id, (-1, -1.0))[1],
                "external_hit_tokens": h.external_hits.get(req_id, 0),
                "loads_ok": sum(loads.get(req_id, [])),
                "loads_failed": len(loads.get(req_id, []))
                - sum(loads.get(req_id, [])),
                "output": h.output_token_ids(req_id),
            }
            for req_id in added
        }
        h.forget_finished()
        h.failures.clear()
        return {
            "records": records,
            "failures": failures,
            "unsent": len(pending),
            "seconds": time.monotonic() - started,
        }

    def do_stats(self, key: str) -> dict[str, Any]:
        side = self.harnesses[key].scheduler_connector.scheduler_side
        memory = side.failed_keys.stats()
        return {
            "store": {op: dict(c) for op, c in self.store[key].items()},
            "failed_keys": {
                "recorded": memory.recorded,
                "clipped": memory.clipped,
                "forgotten": memory.forgotten,
                "expired": memory.expired,
                "deferred": memory.deferred,
                "slow": memory.slow,
                "size": memory.size,
            },
            "failed_blocks_of_failed_loads": dict(self.partial[key]),
            "illegal": sum(side.machine.illegal_counts.values()),
            "open_jobs": side.open_jobs,
            "trackers": len(side.registry),
            "log_records": dict(self.logs.counts),
        }

    def close(self) -> None:
        for h in self.harnesses.values():
            with contextlib.suppress(Exception):
                h.close()


def _fold_store_stats(
    connector: Any, counts: dict[str, collections.Counter[str]]
) -> None:
    """Add each interval's store figures of `connector` into `counts`.

    The connector resets its store counters every time vLLM takes its
    stats; this keeps running totals ("keys" and outcome counts per op).
    """
    take = connector.get_kv_connector_stats

    def folded() -> Any:
        stats = take()
        if stats is not None:
            for op, figures in stats.data.get("store", {}).items():
                counts[op]["keys"] += figures.get("keys", 0)
                counts[op]["ops"] += figures.get("ops", 0)
                counts[op].update(figures.get("failures", {}))
        return stats

    connector.get_kv_connector_stats = folded
