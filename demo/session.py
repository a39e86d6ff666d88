"""A demo session: two instances through vLLM's real scheduler, one master.

Instance A (`kv_producer`) and instance B (`kv_consumer`) are
`harness.scheduler.Harness` instances running vLLM 0.33's real
`Scheduler` with `connector.MooncakeLifecycleConnector` over one Mooncake
master.  Requests share prompt prefixes; A computes and saves them, B
starts once A has finished a few requests and loads what A saved
(cross-instance hits).  Few KV blocks per instance force preemptions.
Faults, all drawn from the seed:

- aborts a few steps after arrival, half of them "in flight" (landing
  while the step executes);
- load failures: a key is removed from the store between B's lookup and
  its load (as an eviction would), so the load fails and vLLM recomputes;
- ordering faults: a second `request_finished` for a request already gone
  (vLLM #43281), which the lifecycle counts as an illegal no-op;
- optionally one master restart, which loses every stored key.

The workload is `demo.spec`, the fault injector `demo.faults`, and the
report `demo.report`.  The harness checks after every step that each
computed block holds the KV recomputation would write; its findings are
counted, never raised, so a report of 0 mismatches means the checks ran
and found none.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import attrs

from connector.config import MiB, StoreConfig
from connector.metadata import JobKind
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.scheduler.side import SchedulerSide
from connector.store import Op, StoreClient, clients
from connector.worker.side import WorkerSide
from demo.faults import LoadFault
from demo.report import InstanceStats, SessionReport, TransferTotals
from demo.spec import RequestSpec, WorkloadConfig, request_specs
from harness import FinishedRequest, Harness, HarnessError, KVRole
from harness.spy import shadow_method
from lifecycle import Row
from lifecycle.kv import Event, State

if TYPE_CHECKING:
    from connector.integration.vllm_connector import MooncakeLifecycleConnector

CONNECTOR: Final = "connector.MooncakeLifecycleConnector"
#: Extra-config keys of the lifecycle trace (ignored by older connectors).
TRACE_KEYS: Final = frozenset(
    {"lifecycle_trace", "lifecycle_trace_max_events"}
)
MISMATCH: Final = "holds wrong KV"


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one thread (restored after).

    The harness's tensors are tiny: on a small, shared machine torch's
    intra-op threads only contend (3-5x slower steps, measured).
    """
    import torch  # noqa: PLC0415 - the harness needs it anyway

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@attrs.define(eq=False)
class _Instance:
    stats: InstanceStats
    harness: Harness
    connector: MooncakeLifecycleConnector
    worker: WorkerSide
    specs: Iterator[RequestSpec]
    total: int
    live: dict[str, RequestSpec] = attrs.Factory(dict)

    @property
    def side(self) -> SchedulerSide:
        return self.connector.scheduler_side


def extra_config(
    master: EmbeddedMaster,
    *,
    namespace: str,
    segment_size: int,
    trace: Path | None = None,
    trace_max_events: int = 1_000_000,
) -> dict[str, Any]:
    """`kv_connector_extra_config` for a connector on the embedded master."""
    config = store_config_for(
        master, global_segment_size=segment_size, namespace=namespace
    )
    extra: dict[str, Any] = attrs.asdict(config)
    if trace is not None:
        extra["lifecycle_trace"] = str(trace)
        extra["lifecycle_trace_max_events"] = trace_max_events
    return extra


class Session:
    """Two instances, one master, one seeded workload; see the module doc.

    Args:
        config: The workload.
        master: A started master (restarted once if the config says so).
        namespace: Store namespace of both instances.
        segment_size: Bytes each client contributes to the store.
        trace_dir: Where each instance writes its lifecycle trace (when
            the connector supports `lifecycle_trace`), or None.
    """

    def __init__(
        self,
        config: WorkloadConfig,
        master: EmbeddedMaster,
        *,
        namespace: str = "demo",
        segment_size: int = 64 * MiB,
        trace_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.master = master
        self.master_restarts = 0
        self.crashes: list[str] = []
        self.ticks = 0
        self.trace_files: list[Path] = []
        self._aborts: list[tuple[int, str, int, bool]] = []
        self._transfers = {op: TransferTotals() for op in Op}
        total_b = round(config.requests * config.share_b)
        counts = {"A": config.requests - total_b, "B": total_b}
        roles: dict[str, KVRole] = {"A": "kv_producer", "B": "kv_consumer"}
        self.instances: list[_Instance] = []
        self._client: StoreClient | None = None
        try:
            for name in ("A", "B"):
                trace = None
                if trace_dir is not None:
                    trace = trace_dir / f"demo-trace-{name}.jsonl"
                    trace.unlink(missing_ok=True)
                    self.trace_files.append(trace)
                extra = extra_config(
                    master,
                    namespace=namespace,
                    segment_size=segment_size,
                    trace=trace,
                )
                if self._client is None:
                    # One contributing client for the process, opened
                    # first as a vLLM worker's would be: both halves of
                    # both instances share it.
                    store = StoreConfig.from_vllm(extra, ignore=TRACE_KEYS)
                    self._client = clients.acquire(store)
                self.instances.append(self._make(name, roles, counts, extra))
        except BaseException:
            self.close()
            raise
        worker = self.instances[1].worker
        # Fault injection, as tests/test_connector_vllm.py does.
        self.load_fault = LoadFault(worker._store)  # noqa: SLF001
        worker._store = self.load_fault  # noqa: SLF001
        self.block_bytes = worker.layout.block_bytes

    def _make(
        self,
        name: str,
        roles: Mapping[str, KVRole],
        counts: Mapping[str, int],
        extra: dict[str, Any],
    ) -> _Instance:
        config = self.config
        harness = Harness(
            CONNECTOR,
            kv_role=roles[name],
            extra_config=extra,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            kv_width=config.kv_width,
            max_num_seqs=config.max_num_seqs,
        )
        connector = cast(
            "MooncakeLifecycleConnector", harness.scheduler_connector
        )
        worker = cast(
            "MooncakeLifecycleConnector", harness.worker_connector
        ).worker_side
        if worker is None:
            harness.close()
            msg = f"instance {name}: the worker registered no KV caches"
            raise RuntimeError(msg)
        stats = InstanceStats(name, roles[name])
        connector.scheduler_side.machine.add_observer(stats.observe)
        self._tap_stats(connector)
        self._tap_stats(
            cast("MooncakeLifecycleConnector", harness.worker_connector)
        )
        return _Instance(
            stats,
            harness,
            connector,
            worker,
            request_specs(config, name, counts[name]),
            counts[name],
        )

    # ---------------------------------------------------------------- run

    @property
    def finished(self) -> int:
        """Requests finished so far, both instances."""
        return sum(i.stats.finished for i in self.instances)

    @property
    def live_trackers(self) -> int:
        """Trackers in the registries of both halves of both instances."""
        return sum(
            len(i.side.registry) + len(i.worker.registry)
            for i in self.instances
        )

    @property
    def preemptions(self) -> int:
        """Preemptions so far, both instances."""
        return sum(i.harness.num_preemptions for i in self.instances)

    def run(
        self, progress: Callable[[Session], None] | None = None
    ) -> SessionReport:
        """Run every request to its end; never raises for what it checks.

        `progress` is called after every tick.
        """
        started = time.perf_counter()
        last_finished, last_change = 0, started
        while not self._done() and not self.crashes:
            busy = self._tick()
            if progress is not None:
                progress(self)
            now = time.perf_counter()
            if self.finished != last_finished:
                last_finished, last_change = self.finished, now
            elif now - last_change > self.config.stall_s:
                self.crashes.append(
                    f"stalled: nothing finished for {self.config.stall_s} s"
                )
            elif not busy:
                time.sleep(0.001)  # only transfers pending: let them run
        wall = time.perf_counter() - started
        return self._report(wall)

    def _tick(self) -> bool:
        """One engine step of each busy instance; True if any computed."""
        self.ticks += 1
        self._admit()
        self._abort_due()
        busy = False
        for inst in self.instances:
            if inst.harness.is_idle():
                continue
            try:
                report = inst.harness.step()
            except HarnessError as exc:
                self.crashes.append(f"{inst.stats.name}: {exc}")
                return False
            busy = busy or bool(report.scheduled)
            self._collect(inst)
        self._maybe_inject()
        self._maybe_restart()
        return busy

    def _done(self) -> bool:
        return all(
            i.stats.submitted == i.total and not i.live and i.harness.is_idle()
            for i in self.instances
        )

    def _admit(self) -> None:
        a, b = self.instances
        for inst in self.instances:
            if inst is b and a.stats.finished < min(
                self.config.warmup, a.total
            ):
                continue
            while (
                inst.stats.submitted < inst.total
                and len(inst.live) < self.config.concurrency
            ):
                spec = next(inst.specs)
                inst.harness.add_request(
                    spec.req_id, spec.prompt, spec.max_tokens
                )
                inst.live[spec.req_id] = spec
                inst.stats.submitted += 1
                if spec.abort_after:
                    heapq.heappush(
                        self._aborts,
                        (
                            self.ticks + spec.abort_after,
                            spec.req_id,
                            self.instances.index(inst),
                            spec.abort_in_flight,
                        ),
                    )

    def _abort_due(self) -> None:
        while self._aborts and self._aborts[0][0] <= self.ticks:
            _, req_id, index, in_flight = heapq.heappop(self._aborts)
            inst = self.instances[index]
            request = inst.harness.requests.get(req_id)
            if (
                request is None
                or request.is_finished()
                or req_id in inst.stats.load_failed_recomputed
            ):
                continue
            inst.harness.abort(req_id, in_flight=in_flight)
            inst.stats.aborts_sent += 1

    def _collect(self, inst: _Instance) -> None:
        for done in inst.harness.forget_finished():
            self._finished(inst, done)

    def _finished(self, inst: _Instance, done: FinishedRequest) -> None:
        stats = inst.stats
        spec = inst.live.pop(done.req_id, None)
        stats.finished += 1
        stats.outcomes[done.status] += 1
        stats.external_hit_tokens += done.external_hit_tokens
        if done.req_id in stats.load_failed_recomputed:
            stats.recovered[done.req_id] = done.status
        if spec is not None and spec.replay_finish:
            # vLLM #43281: request_finished for a request already gone.
            inst.connector.request_finished(done.request, [])
            stats.replayed_finishes += 1

    def _maybe_inject(self) -> None:
        b = self.instances[1]
        fault = self.load_fault
        if (
            len(b.stats.load_failed_recomputed) < self.config.load_failures
            and fault.armed == 0
            and b.side.open_jobs == 0  # earlier injections have settled
        ):
            fault.armed = 1

    def _maybe_restart(self) -> None:
        after = self.config.restart_master_after
        if after is None or self.master_restarts or self.finished < after:
            return
        self.master.restart()
        self.master_restarts += 1

    def _tap_stats(self, connector: MooncakeLifecycleConnector) -> None:
        """Add up the store figures the connector reports to vLLM.

        Both halves read the shared client's counters with reset every
        step (vLLM's stats path), so the figures are taken from there.
        """

        def tap(original: Callable[[], Any]) -> Callable[[], Any]:
            def tapped() -> Any:
                stats = original()
                if stats is not None:
                    for op, figures in stats.data.get("store", {}).items():
                        self._transfers[Op(op)].add(figures)
                return stats

            return tapped

        # vLLM and the harness call it by name.
        shadow_method(connector, "get_kv_connector_stats", tap)

    # ------------------------------------------------------------- report

    def _report(self, wall: float) -> SessionReport:
        failures: list[str] = []
        for inst in self.instances:
            harness = inst.harness
            if not self.crashes:
                # The findings stay in harness.failures.
                with contextlib.suppress(HarnessError):
                    harness.check()
            failures.extend(
                f"{inst.stats.name}: {f}" for f in harness.failures
            )
        transitions: collections.Counter[Row[State, Event, Any, Any]] = (
            collections.Counter()
        )
        illegal: collections.Counter[tuple[State | None, Event]] = (
            collections.Counter()
        )
        stale: collections.Counter[tuple[State, Event]] = collections.Counter()
        worker_illegal: collections.Counter[tuple[State | None, Event]] = (
            collections.Counter()
        )
        worker_stale: collections.Counter[tuple[State, Event]] = (
            collections.Counter()
        )
        for inst in self.instances:
            machine = inst.side.machine
            transitions.update(machine.transition_counts())
            illegal.update(machine.illegal_counts)
            stale.update(machine.stale_counts)
            worker_illegal.update(inst.worker.machine.illegal_counts)
            worker_stale.update(inst.worker.machine.stale_counts)
        mismatches = sum(MISMATCH in f for f in failures)
        failed_loads = sum(
            i.worker.jobs_failed[JobKind.LOAD] for i in self.instances
        )
        usable = self.config.num_blocks - 1
        return SessionReport(
            config=self.config,
            wall_s=wall,
            ticks=self.ticks,
            instances=tuple(i.stats for i in self.instances),
            transitions=dict(transitions),
            illegal=dict(illegal),
            stale=dict(stale),
            worker_illegal=dict(worker_illegal),
            worker_stale=dict(worker_stale),
            preemptions=self.preemptions,
            resumed=sum(i.harness.num_resumed for i in self.instances),
            loads=self._transfers[Op.GET],
            saves=self._transfers[Op.PUT],
            lookups=self._transfers[Op.EXISTS],
            block_bytes=self.block_bytes,
            load_faults_injected=self.load_fault.injected,
            failed_load_jobs=failed_loads,
            mismatches=mismatches,
            failures=tuple(f for f in failures if MISMATCH not in f),
            crashes=tuple(self.crashes),
            live_trackers=self.live_trackers,
            open_jobs=sum(i.side.open_jobs for i in self.instances),
            leaked_blocks=sum(
                usable - i.harness.num_free_blocks for i in self.instances
            ),
            master_restarts=self.master_restarts,
            trace_files=tuple(str(p) for p in self.trace_files if p.exists()),
        )

    def close(self) -> None:
        """Shut both instances down and release the stats client."""
        for inst in self.instances:
            inst.harness.close()
        if self._client is not None:
            clients.release(self._client)
            self._client = None
