"""A seeded serving workload through vLLM's real scheduler, two instances.

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

The harness checks after every step that each computed block holds the KV
recomputation would write; its findings are counted, never raised, so a
report of 0 mismatches means the checks ran and found none.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import attrs

from connector import clients
from connector.config import MiB, StoreConfig
from connector.master import EmbeddedMaster
from connector.metadata import JobKind
from connector.scheduler import RequestTracker, SchedulerSide
from connector.store import Op, StoreClient
from connector.worker import WorkerSide
from harness import FinishedRequest, Harness, HarnessError, KVRole
from lifecycle import Row
from lifecycle.kv import Event, KVTracker, State
from lifecycle.trace import pair_key

if TYPE_CHECKING:
    from connector.vllm_connector import MooncakeLifecycleConnector

CONNECTOR: Final = "connector.MooncakeLifecycleConnector"
#: Extra-config keys of the lifecycle trace (ignored by older connectors).
TRACE_KEYS: Final = frozenset(
    {"lifecycle_trace", "lifecycle_trace_max_events"}
)
MISMATCH: Final = "holds wrong KV"
_VOCAB: Final = 500
_ADMITTING: Final = frozenset({State.NEW, State.RESET})
_ADMIT: Final = frozenset({Event.ALLOC_LOCAL, Event.ALLOC_EXTERNAL})
_FORCED_ABORT_INDEX: Final = 1  # each instance's second request


@attrs.frozen
class WorkloadConfig:
    """What a session runs; every random draw comes from `seed`.

    Attributes:
        requests: Requests over both instances.
        seed: Seeds every draw.
        share_b: Share of the requests served by instance B.
        warmup: Requests A finishes before B gets its first one.
        prefixes: Shared prompt prefixes.
        prefix_blocks: (min, max) blocks of a shared prefix.
        unique_share: Share of requests with no shared prefix.
        suffix_tokens: (min, max) prompt tokens after the prefix.
        max_tokens: (min, max) generated tokens.
        num_blocks: KV blocks per instance (few, for preemptions).
        block_size: Tokens per block.
        kv_width: Floats per token per layer.
        max_num_seqs: Running requests per instance.
        concurrency: Requests an instance holds unfinished at most.
        abort_rate: Share of requests aborted 1-30 ticks after arrival,
            half of them in flight; each instance's second request is
            always aborted two ticks after arrival.
        replay_finish_rate: Share of finished requests that get a second
            `request_finished` (vLLM #43281); each instance's first
            finished request always does.
        load_failures: Loads that fail and are recomputed (B only).
        restart_master_after: Restart the master once, after this many
            finished requests (None: never).
        stall_s: Give up when nothing finished for this long.
    """

    requests: int = 2000
    seed: int = 0
    share_b: float = 0.5
    warmup: int = 8
    prefixes: int = 12
    prefix_blocks: tuple[int, int] = (2, 4)
    unique_share: float = 0.2
    suffix_tokens: tuple[int, int] = (1, 24)
    max_tokens: tuple[int, int] = (2, 24)
    num_blocks: int = 24
    block_size: int = 16
    kv_width: int = 32
    max_num_seqs: int = 8
    concurrency: int = 12
    abort_rate: float = 0.03
    replay_finish_rate: float = 0.01
    load_failures: int = 1
    restart_master_after: int | None = None
    stall_s: float = 60.0


@attrs.frozen
class RequestSpec:
    """One request of the workload."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    prefix: int  # shared prefix index, -1 for none
    abort_after: int  # ticks after arrival, 0 for never
    abort_in_flight: bool
    replay_finish: bool


@attrs.define
class Transfer:
    """Store calls of one kind, summed over the session."""

    calls: int = 0
    keys: int = 0
    failed_keys: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, figures: Mapping[str, Any]) -> None:
        """Add one interval's figures (the connector's stats payload)."""
        self.calls += figures.get("ops", 0)
        self.keys += figures.get("keys", 0)
        self.failed_keys += sum(figures.get("failures", {}).values())
        self.bytes += figures.get("bytes", 0)
        self.seconds += sum(figures.get("latencies_s", ()))

    @property
    def gb_per_s(self) -> float:
        """Bytes moved per second spent inside the calls (GB = 1e9 B)."""
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@attrs.define
class InstanceStats:
    """What one instance saw (filled by a lifecycle observer and the loop)."""

    name: str
    role: str
    submitted: int = 0
    finished: int = 0
    outcomes: collections.Counter[str] = attrs.Factory(collections.Counter)
    admissions: int = 0
    admitted_tokens: int = 0
    local_hit_tokens: int = 0
    external_admissions: int = 0
    external_hit_tokens: int = 0
    aborts_sent: int = 0
    replayed_finishes: int = 0
    load_failed_recomputed: list[str] = attrs.Factory(list)
    recovered: dict[str, str] = attrs.Factory(dict)

    def observe(
        self, tracker: KVTracker, source: State, event: Event, dest: State
    ) -> None:
        """Lifecycle observer: count admissions and recomputed loads."""
        del dest
        if source in _ADMITTING and event in _ADMIT:
            self.admissions += 1
            self.admitted_tokens += tracker.num_tokens
            if isinstance(tracker, RequestTracker):
                self.local_hit_tokens += tracker.num_local_tokens
            self.external_admissions += event is Event.ALLOC_EXTERNAL
        elif event is Event.LOAD_FAILED and source is State.LOADING:
            self.load_failed_recomputed.append(tracker.req_id)


class LoadFault:
    """Wraps a worker's store: an armed `get` loses its last key first.

    The key is removed from the store right before the load reads it, as
    an eviction between lookup and load would: the store answers MISS,
    the load fails, and vLLM recomputes the block.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self.armed = 0
        self.injected = 0

    def get(self, keys: Sequence[str], regions: Any) -> Any:
        """Load `keys`; if armed, remove the last one first."""
        if self.armed > 0 and keys:
            self.armed -= 1
            self.injected += 1
            self._store.remove(list(keys[-1:]), force=True)
        return self._store.get(keys, regions)

    def put(self, keys: Sequence[str], regions: Any) -> Any:
        """Save `keys` unchanged."""
        return self._store.put(keys, regions)


@attrs.frozen
class SessionReport:
    """Everything a session measured; `to_json` for machines."""

    config: WorkloadConfig
    wall_s: float
    ticks: int
    instances: tuple[InstanceStats, ...]
    transitions: Mapping[Row[State, Event], int]
    illegal: Mapping[tuple[State | None, Event], int]
    stale: Mapping[tuple[State, Event], int]
    worker_illegal: Mapping[tuple[State | None, Event], int]
    worker_stale: Mapping[tuple[State, Event], int]
    preemptions: int
    resumed: int
    loads: Transfer
    saves: Transfer
    lookups: Transfer
    block_bytes: int
    load_faults_injected: int
    failed_load_jobs: int
    mismatches: int
    failures: tuple[str, ...]
    crashes: tuple[str, ...]
    live_trackers: int
    open_jobs: int
    leaked_blocks: int
    master_restarts: int
    trace_files: tuple[str, ...]

    @property
    def finished(self) -> int:
        """Requests that finished, over both instances."""
        return sum(i.finished for i in self.instances)

    @property
    def outcomes(self) -> collections.Counter[str]:
        """Finished requests by vLLM's final status."""
        total: collections.Counter[str] = collections.Counter()
        for inst in self.instances:
            total.update(inst.outcomes)
        return total

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens not recomputed (local + store)."""
        tokens = sum(i.admitted_tokens for i in self.instances)
        hits = sum(
            i.local_hit_tokens + i.external_hit_tokens for i in self.instances
        )
        return hits / tokens if tokens else 0.0

    @property
    def cross_instance(self) -> InstanceStats:
        """Instance B, whose store hits are all prefixes A saved."""
        return self.instances[1]

    @property
    def recovered_loads(self) -> int:
        """Failed loads whose request then finished normally."""
        return sum(
            status == "FINISHED_LENGTH_CAPPED"
            for inst in self.instances
            for status in inst.recovered.values()
        )

    def tokens(self, transfer: Transfer) -> int:
        """Tokens moved by whole-block transfers."""
        blocks = transfer.bytes // self.block_bytes if self.block_bytes else 0
        return blocks * self.config.block_size

    @property
    def ok(self) -> bool:
        """No crash, mismatch, failed check, leak or unfinished request."""
        return not (
            self.crashes
            or self.mismatches
            or self.failures
            or self.live_trackers
            or self.open_jobs
            or self.leaked_blocks
            or self.finished != self.config.requests
        )

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""
        b = self.cross_instance
        return {
            "requests": self.config.requests,
            "seed": self.config.seed,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.finished / self.wall_s, 1)
            if self.wall_s
            else 0.0,
            "finished": self.finished,
            "outcomes": dict(sorted(self.outcomes.items())),
            "prefix_hit_rate": round(self.prefix_hit_rate, 4),
            "cross_instance_hits": {
                "requests": b.external_admissions,
                "tokens": b.external_hit_tokens,
            },
            "tokens_loaded": self.tokens(self.loads),
            "tokens_saved": self.tokens(self.saves),
            "bytes_loaded": self.loads.bytes,
            "bytes_saved": self.saves.bytes,
            "load_gb_per_s": round(self.loads.gb_per_s, 4),
            "save_gb_per_s": round(self.saves.gb_per_s, 4),
            "store_calls": {
                "exists": self.lookups.calls,
                "get": self.loads.calls,
                "put": self.saves.calls,
            },
            "preemptions": self.preemptions,
            "resumed": self.resumed,
            "aborts_sent": sum(i.aborts_sent for i in self.instances),
            "load_failures": {
                "injected": self.load_faults_injected,
                "failed_load_jobs": self.failed_load_jobs,
                "recomputed": sum(
                    len(i.load_failed_recomputed) for i in self.instances
                ),
                "recovered": self.recovered_loads,
            },
            "replayed_finishes": sum(
                i.replayed_finishes for i in self.instances
            ),
            "transitions": {
                edge_name(row): n for row, n in self.transitions.items()
            },
            "illegal": {
                illegal_name(key): n for key, n in self.illegal.items()
            },
            "stale": {illegal_name(key): n for key, n in self.stale.items()},
            "worker_illegal": {
                illegal_name(key): n for key, n in self.worker_illegal.items()
            },
            "worker_stale": {
                illegal_name(key): n for key, n in self.worker_stale.items()
            },
            "mismatches": self.mismatches,
            "failures": list(self.failures),
            "crashes": list(self.crashes),
            "live_trackers": self.live_trackers,
            "open_jobs": self.open_jobs,
            "leaked_blocks": self.leaked_blocks,
            "master_restarts": self.master_restarts,
            "instances": {
                i.name: {
                    "role": i.role,
                    "submitted": i.submitted,
                    "finished": i.finished,
                    "outcomes": dict(sorted(i.outcomes.items())),
                    "admissions": i.admissions,
                    "local_hit_tokens": i.local_hit_tokens,
                    "store_hit_admissions": i.external_admissions,
                    "store_hit_tokens": i.external_hit_tokens,
                }
                for i in self.instances
            },
            "trace_files": list(self.trace_files),
            "ok": self.ok,
        }


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


def edge_name(row: Row[State, Event]) -> str:
    """`SOURCE --event--> DEST`, as `python -m lifecycle replay` keys it."""
    return str(row)


def illegal_name(key: tuple[State | None, Event]) -> str:
    """`STATE/event` (`unknown/event` for an untracked request)."""
    return pair_key(*key)


# ------------------------------------------------------------------ requests


def _prefixes(config: WorkloadConfig) -> list[tuple[int, ...]]:
    rng = random.Random(f"{config.seed}/prefixes")
    lo, hi = config.prefix_blocks
    return [
        tuple(
            rng.randrange(_VOCAB)
            for _ in range(rng.randint(lo, hi) * config.block_size)
        )
        for _ in range(config.prefixes)
    ]


def request_specs(
    config: WorkloadConfig, name: str, count: int
) -> Iterator[RequestSpec]:
    """The requests of one instance, drawn lazily from the seed."""
    rng = random.Random(f"{config.seed}/{name}")
    prefixes = _prefixes(config)
    for index in range(count):
        if prefixes and rng.random() >= config.unique_share:
            prefix_index = rng.randrange(len(prefixes))
            prefix = prefixes[prefix_index]
        else:
            prefix_index, prefix = -1, ()
        suffix = [
            rng.randrange(_VOCAB)
            for _ in range(rng.randint(*config.suffix_tokens))
        ]
        forced = index == _FORCED_ABORT_INDEX
        aborted = forced or rng.random() < config.abort_rate
        yield RequestSpec(
            req_id=f"{name}-{index:06d}",
            prompt=(*prefix, *suffix),
            max_tokens=rng.randint(*config.max_tokens),
            prefix=prefix_index,
            abort_after=(2 if forced else rng.randint(1, 30))
            if aborted
            else 0,
            abort_in_flight=not forced and rng.random() < 0.5,  # noqa: PLR2004
            replay_finish=index == 0
            or rng.random() < config.replay_finish_rate,
        )


# ------------------------------------------------------------------- session


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
    config = StoreConfig.for_master(
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
        self._transfers = {op: Transfer() for op in Op}
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
        original = connector.get_kv_connector_stats

        def tapped() -> Any:
            stats = original()
            if stats is not None:
                for op, figures in stats.data.get("store", {}).items():
                    self._transfers[Op(op)].add(figures)
            return stats

        # NOTE(demo): an instance attribute shadows the method, as the
        # harness's own spy does; vLLM and the harness call it by name.
        connector.get_kv_connector_stats = tapped  # type: ignore[method-assign]

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
        transitions: collections.Counter[Row[State, Event]] = (
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
