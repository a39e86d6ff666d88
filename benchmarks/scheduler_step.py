"""Scheduler-side connector cost per step inside vLLM 0.33's real `Scheduler`.

``python -m benchmarks.scheduler_step --json`` runs the plain `Scheduler`
(via `harness.scheduler`), a steady decode of N running requests
(prompts of 56-71 tokens, no preemption), and per step the time of
`schedule()` + `update_from_output()` and, separately, the time spent
inside the connector's scheduler-side hooks (each hook of the connector
instance is wrapped by a timing shim).
Three set-ups run side by side on the same requests, at each N:

- ``none``: no KV connector;
- ``noop``: a connector whose hooks do nothing (vLLM's plumbing alone);
- ``ours``: `MooncakeLifecycleConnector` (scheduler role), prefix lookups
  against a real embedded `mooncake_master`;
- ``theirs``: vLLM 0.33's own `MooncakeStoreConnector` scheduler side; its
  admission lookup goes over ZMQ to a stand-in lookup server answering
  "0 hits" in the wire format of its `protocol.py`.

No worker runs: a stand-in worker reports every save job of step k done
in step k+1 (to both connectors, in their own worker-metadata format).
Reported numbers are medians over the measured steps, after warm-up.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from harness.extra_config import store_extra
from harness.prompts import random_tokens

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

if TYPE_CHECKING:
    from collections.abc import Callable

SIZES = (256, 1024, 4096)
GOAL_N = 1024
GOAL_SHARE = 0.05
MODES = ("none", "noop", "ours", "theirs")
_MAX_PROMPT = 71
_BLOCK = 16
_THEIRS = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"

#: Scheduler-side hooks vLLM 0.33's scheduler may call on a connector.
HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "request_finished_all_groups",
    "update_connector_output",
    "take_events",
    "get_kv_connector_stats",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_finished_count",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "register_finished_partial_tail",
)


class HookTimer:
    """Wraps a connector instance's hooks; sums the time spent inside."""

    def __init__(self, connector: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        for name in HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(method))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
                self._depth -= 1

        return timed


class LookupStandIn:
    """A ZMQ REP server answering every `MooncakeStoreConnector` lookup
    with 0 hits (`protocol.py` wire format), in a thread of this process.
    """

    def __init__(self, path: str) -> None:
        import zmq  # noqa: PLC0415

        protocol = importlib.import_module(f"{_THEIRS}.protocol")
        data = importlib.import_module(f"{_THEIRS}.data")

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.bind(path)
        self._zmq = zmq
        self._miss = protocol.encode_lookup_response(
            data.MooncakeLookupResult(0)
        )
        self._ok = protocol.RESP_OK
        self._lookup = protocol.LOOKUP_MSG
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._socket, self._zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._socket.recv_multipart()
            reply = self._miss if frames[0] == self._lookup else self._ok
            self._socket.send(reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._context.term()


def _harness_class() -> type:
    """`harness.scheduler.Harness` without a worker-role connector.

    Only the scheduler side is measured, so no worker connector (and no
    KV tensor registration) is made; ``connector=None`` builds a scheduler
    with no KV connector at all.
    """
    from harness import Harness  # noqa: PLC0415

    class SchedulerOnly(Harness):  # type: ignore[misc]
        no_connector = False

        def _make_vllm_config(self, *args: Any, **kwargs: Any) -> Any:
            config = super()._make_vllm_config(*args, **kwargs)
            if self.no_connector:
                config.kv_transfer_config = None
            return config

        def _make_worker_connector(self) -> Any:
            self.kv_caches = {}
            return None

        def _spy_on_scheduler_connector(self) -> None:
            """No spy: its wrapper would be timed as connector time."""

    return SchedulerOnly


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, rng.randint(56, _MAX_PROMPT)) for _ in range(n)]


class StandInWorker:
    """Reports each save job of step k as done in step k+1."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._pending: list[int] = []

    def output(self, scheduler_output: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput  # noqa: PLC0415

        done, self._pending = self._pending, self._job_ids(scheduler_output)
        if self.mode == "none":
            return None
        return KVConnectorOutput(kv_connector_worker_meta=self._report(done))

    def _job_ids(self, scheduler_output: Any) -> list[int]:
        meta = scheduler_output.kv_connector_metadata
        if self.mode == "ours":
            return [j.job_id for j in meta.meta.jobs]
        if self.mode == "theirs":
            return [
                r.store_job_id
                for r in meta.requests
                if getattr(r, "store_job_id", None) is not None
            ]
        return []

    def _report(self, done: list[int]) -> Any:
        if not done:
            return None
        if self.mode == "ours":
            from connector.integration.vllm_connector import (  # noqa: PLC0415
                LifecycleWorkerMetadata,
            )
            from connector.metadata import (  # noqa: PLC0415
                JobResult,
                WorkerReport,
            )

            return LifecycleWorkerMetadata(
                WorkerReport(tuple(JobResult(j, ok=1) for j in done))
            )
        data = importlib.import_module(f"{_THEIRS}.data")
        return data.MooncakeStoreWorkerMetadata(dict.fromkeys(done, 1))


def _model_output(scheduler: Any, so: Any, kv_output: Any) -> Any:
    """One sampled token for every request whose prompt is computed."""
    from vllm.v1.outputs import ModelRunnerOutput  # noqa: PLC0415

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )


def _extra_config(mode: str, master: Any) -> dict[str, Any]:
    if mode == "ours":
        namespace = uuid.uuid4().hex[:12]
        return store_extra(master, namespace, global_segment_size=0)
    if mode == "theirs":
        return {"lookup_rpc_port": f"bench{uuid.uuid4().hex[:8]}"}
    return {}


_CLASSES = {
    "none": "harness.noop.NoopConnector",
    "noop": "harness.noop.NoopConnector",
    "ours": "connector.MooncakeLifecycleConnector",
    "theirs": f"{_THEIRS}.connector.MooncakeStoreConnector",
}


def measure(
    mode: str,
    n: int,
    *,
    steps: int,
    warmup: int,
    master: Any,
    tmp: str,
) -> dict[str, float]:
    """Median step and connector time (ms, µs) of one set-up at N."""
    harness_cls = _harness_class()
    harness_cls.no_connector = mode == "none"
    extra = _extra_config(mode, master)
    server = None
    if mode == "theirs":
        os.environ["VLLM_RPC_BASE_PATH"] = tmp
    prompts = _prompts(n, seed=n)
    h = None
    try:
        if mode == "theirs":
            server = _theirs_server(extra, tmp)
        # Enough blocks that nobody is ever preempted: prefill, warm-up
        # and measured steps, plus slack.
        batch = max(16384, n)
        limit = warmup + steps + n * _MAX_PROMPT // batch + 20
        per_request = (_MAX_PROMPT + limit) // _BLOCK + 2
        h = harness_cls(
            _CLASSES[mode],
            extra_config=extra,
            num_blocks=n * per_request + 64,
            max_num_seqs=n,
            max_num_batched_tokens=batch,
            max_model_len=1024,
            check_every_step=False,
        )
        scheduler = h.scheduler
        connector = scheduler.connector
        timer = HookTimer(connector) if connector is not None else None
        worker = StandInWorker(mode)
        for i, tokens in enumerate(prompts):
            h.add_request(f"r{i}", tokens, max_tokens=limit + 1)
        step_s: list[float] = []
        hook_s: list[float] = []
        running = 0
        for _ in range(limit):
            before = timer.seconds if timer else 0.0
            started = time.perf_counter()
            so = scheduler.schedule()
            sched_s = time.perf_counter() - started
            kv_output = worker.output(so)
            output = _model_output(scheduler, so, kv_output)
            started = time.perf_counter()
            scheduler.update_from_output(so, output)
            total = sched_s + time.perf_counter() - started
            decoding = _settle_lookups(connector, so, n)
            running = running + 1 if decoding else 0
            if running > warmup:
                step_s.append(total)
                hook_s.append((timer.seconds if timer else 0.0) - before)
                if len(step_s) >= steps:
                    break
        if len(step_s) < steps:
            msg = f"{mode} at N={n}: no steady decode reached"
            raise RuntimeError(msg)
        return {
            "step_ms": round(statistics.median(step_s) * 1e3, 3),
            "connector_us": round(statistics.median(hook_s) * 1e6, 1),
        }
    finally:
        if h is not None:
            _close_lookup_client(h.scheduler.connector)
            h.close()
        if server is not None:
            server.close()


def _settle_lookups(connector: Any, so: Any, n: int) -> bool:
    """Whether the step was steady decode; before it (not measured), let
    admission lookups return, as the forward pass of an engine would.
    """
    decoding = len(so.num_scheduled_tokens) == n and (
        so.total_num_scheduled_tokens == n
    )
    wait = getattr(connector, "wait_for_lookups", None)
    if not decoding and callable(wait):
        wait(1.0)
    return bool(decoding)


def _close_lookup_client(connector: Any) -> None:
    """Close `MooncakeStoreConnector`'s ZMQ lookup client (its shutdown
    does not); a context collected with an open socket blocks forever.
    """
    side = getattr(connector, "connector_scheduler", None)
    client = getattr(side, "client", None)
    if client is not None:
        client.close()
        client.ctx.term()


def _theirs_server(extra: dict[str, Any], tmp: str) -> LookupStandIn:
    hostname = __import__("socket").gethostname()
    port = extra["lookup_rpc_port"]
    return LookupStandIn(
        f"ipc://{tmp}/lookup_rpc_port_{port}_host_{hostname}_dp_rank0"
    )


def run(
    sizes: tuple[int, ...], modes: tuple[str, ...], steps: int, warmup: int
) -> dict[str, Any]:
    """Measure every mode at every N; returns the JSON document."""
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    rows = []
    with (
        EmbeddedMaster() as master,
        tempfile.TemporaryDirectory(prefix="kvl-bench-") as tmp,
    ):
        for n in sizes:
            row: dict[str, Any] = {"n_running": n}
            for mode in modes:
                try:
                    got = measure(
                        mode, n, steps=steps, warmup=warmup, master=master,
                        tmp=tmp,
                    )  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - report, go on
                    row[f"{mode}_error"] = repr(exc)
                    continue
                row[f"{mode}_step_ms"] = got["step_ms"]
                if mode != "none":
                    row[f"{mode}_connector_us"] = got["connector_us"]
                    row[f"{mode}_share"] = round(
                        got["connector_us"] / 1e3 / got["step_ms"], 4
                    )
            if "ours_connector_us" in row and "theirs_connector_us" in row:
                row["ours_over_theirs"] = round(
                    row["ours_connector_us"] / row["theirs_connector_us"], 4
                )
            rows.append(row)
    goal_row = next((r for r in rows if r["n_running"] == GOAL_N), None)
    goal: dict[str, Any] = {"n_running": GOAL_N, "max_share": GOAL_SHARE}
    if goal_row and "ours_share" in goal_row:
        goal["ours_share"] = goal_row["ours_share"]
        goal["met_share"] = goal_row["ours_share"] <= GOAL_SHARE
    if goal_row and "ours_over_theirs" in goal_row:
        goal["met_vs_theirs"] = goal_row["ours_over_theirs"] <= 1.0
    return {
        "benchmark": "scheduler_step",
        "unit": {"step": "ms (median)", "connector": "µs per step (median)"},
        "steps": steps,
        "warmup": warmup,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "results": rows,
        "goal": goal,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print JSON with `--json`, a table otherwise."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--n",
        type=int,
        action="append",
        help=f"running requests (repeatable; default {list(SIZES)})",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)}",
    )
    parser.add_argument("--steps", type=int, default=30, help="measured")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {sorted(unknown)}")
    logging.basicConfig(level=logging.ERROR)
    doc = run(tuple(args.n or SIZES), modes, args.steps, args.warmup)
    if args.json:
        print(json.dumps(doc))
    else:
        for row in doc["results"]:
            print(row)
        print(doc["goal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
