"""Lifecycle and store figures through vLLM's own stats path.

vLLM asks both connector halves for `get_kv_connector_stats` every step:
the worker's answer travels in `KVConnectorOutput` (summed over ranks by
`aggregate`), the scheduler's is folded in by `Scheduler.update_from_output`,
and the result reaches the engine's stat loggers as a plain dict, which
vLLM turns back into `LifecycleConnectorStats` (`build_kv_connector_stats`)
to log a `reduce`d summary every interval, and hands to
`LifecyclePromMetrics.observe` for Prometheus.

The payload (`KVConnectorStats.data`) holds only str keys, ints, floats
and lists, so it survives pickling and msgpack::

    {"transitions": {"SAVING/preempt": 2, ...},   # by (state, event)
     "illegal": {"unknown/finish": 1, ...},       # of the scheduler half
     "stale": {"RESET/save_done": 1, ...},
     "worker_transitions": {...},                 # the worker half's own
     "worker_illegal": {...}, "worker_stale": {...},   # machine (per rank)
     "store": {"get": {"ops": 3, "keys": 12, "bytes": 3145728,
                       "short_circuited": 0, "failures": {"MISS": 1},
                       "latencies_s": [0.0012, ...]}, ...},
     "breaker_trips": 0,
     "store_faults": {"transfer": 3, "metadata_missing": 2,
                      "metadata_restored": 2},
     "groups": {"g0": {"hit_blocks": 4, "load_blocks": 4,    # per KV cache
                       "load_bytes": 262144, "save_blocks": 8,  # group
                       "save_bytes": 524288}, "g1": {...}},
     "lookups": {"started": 12, "answered": 12, "on_arrival": 12,
                 "waited": 3, "wait_missed": 1, "wait_skipped": 0, ...}}

``store_faults`` counts what a store that answers but cannot transfer
looks like (`connector.store.faults`): keys that failed although the
master answered, and this client's transfer-metadata entries found
missing from the metadata server and restored
(`connector.store.metadata`).

``lookups`` counts the scheduler half's admission lookups by outcome
(`connector.scheduler.side.SchedulerSide.lookup_counts`): sent
(``started``, ``on_arrival`` of them as the request arrived), answered,
waited for within ``lookup_wait_ms`` (``waited``), not answered within it
(``wait_missed``), not waited for while the store call hung
(``wait_skipped``), and the rest of that counter's keys.

``groups`` counts, per KV cache group (`connector.groups`), the blocks the
scheduler half issued loads for (store hits) and the blocks and bytes the
worker half loaded and saved.

A half may run several lifecycle tables (the scheduler half also runs the
admission lookups, `connector.scheduler.admission.LOOKUPS`).  Counts of
the KV table (`KV_TABLE`) are keyed ``"STATE/event"``; those of any other
table ``"<table>:STATE/event"``
(``"admission-lookup:IN_FLIGHT/answer"``), and Prometheus carries the
table's name in a ``table`` label.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from lifecycle.kv import TABLE as _KV
from lifecycle.trace import pair_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from prometheus_client import Counter, Histogram

    from connector.store import OpCounters, StoreCounters
    from lifecycle import LifecycleMachine

    AnyMachine = LifecycleMachine[Any, Any, Any, Any]

KV_TABLE: Final = _KV.name
"""The table whose counts are keyed without a table name."""
KINDS: Final = ("transitions", "illegal", "stale")
HALF_PREFIXES: Final = {"scheduler": "", "worker": "worker_"}
"""Each half's machine counts under its own prefix: both see one event."""
COUNTS: Final = tuple(f"{p}{k}" for p in HALF_PREFIXES.values() for k in KINDS)
"""The lifecycle sections of the payload, keyed by ``"STATE/event"``."""
OP_COUNTERS: Final = ("ops", "keys", "bytes", "short_circuited")
MAX_LATENCY_SAMPLES: Final = 4096
"""Latency samples kept per operation while an interval accumulates."""

LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class MetricName:
    """Prometheus names, in vLLM's ``vllm:`` convention."""

    TRANSITIONS = "vllm:kv_lifecycle_transitions_total"
    ILLEGAL = "vllm:kv_lifecycle_illegal_events_total"
    STALE = "vllm:kv_lifecycle_stale_events_total"
    STORE_OPS = "vllm:kv_lifecycle_store_operations_total"
    STORE_KEYS = "vllm:kv_lifecycle_store_keys_total"
    STORE_BYTES = "vllm:kv_lifecycle_store_bytes_total"
    STORE_FAILURES = "vllm:kv_lifecycle_store_failed_keys_total"
    STORE_LATENCY = "vllm:kv_lifecycle_store_operation_seconds"
    BREAKER_TRIPS = "vllm:kv_lifecycle_store_breaker_trips_total"
    STORE_FAULTS = "vllm:kv_lifecycle_store_faults_total"
    LOOKUPS = "vllm:kv_lifecycle_admission_lookups_total"


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {key: {} for key in COUNTS}
    data["store"] = {}
    data["breaker_trips"] = 0
    data["store_faults"] = {}
    data["groups"] = {}
    data["lookups"] = {}
    return data


def _is_empty(data: dict[str, Any]) -> bool:
    return not (
        any(data[key] for key in COUNTS)
        or data["store"]
        or data["breaker_trips"]
        or data["store_faults"]
        or data["groups"]
        or data["lookups"]
    )


def _add(into: dict[str, int], counts: dict[str, int]) -> None:
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n


@dataclass
class LifecycleConnectorStats(KVConnectorStats):
    """One interval's lifecycle counts and store figures (see module doc).

    Counters add up in `aggregate` (ranks, steps); latency samples are
    concatenated, keeping the latest `MAX_LATENCY_SAMPLES` per operation.
    """

    def __post_init__(self) -> None:
        # Own the payload: vLLM hands the same dict to several loggers,
        # and `aggregate` adds into this object's counters in place.
        given, self.data = self.data, _empty()
        self.data["breaker_trips"] = given.get("breaker_trips", 0)
        self.data["store_faults"] = dict(given.get("store_faults", {}))
        for key in COUNTS:
            self.data[key] = dict(given.get(key, {}))
        self.data["store"] = {
            op: {
                **{k: f.get(k, 0) for k in OP_COUNTERS},
                "failures": dict(f.get("failures", {})),
                "latencies_s": list(f.get("latencies_s", ())),
            }
            for op, f in given.get("store", {}).items()
        }
        self.data["groups"] = {
            g: dict(counts) for g, counts in given.get("groups", {}).items()
        }
        self.data["lookups"] = dict(given.get("lookups", {}))

    def reset(self) -> None:
        """Start an empty interval."""
        self.data = _empty()

    def clone_and_reset(self) -> LifecycleConnectorStats:
        """This interval's figures; this object starts a new one."""
        clone = LifecycleConnectorStats(data=self.data)
        self.reset()
        return clone

    def is_empty(self) -> bool:
        """Whether nothing was counted in this interval."""
        return _is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold `other` (another rank, half or step) into this one."""
        if other.is_empty():
            return self
        theirs = other.data
        for key in COUNTS:
            _add(self.data[key], theirs.get(key, {}))
        store = self.data["store"]
        for op, figures in theirs.get("store", {}).items():
            mine = store.setdefault(op, _empty_op())
            for key in OP_COUNTERS:
                mine[key] += figures.get(key, 0)
            _add(mine["failures"], figures.get("failures", {}))
            samples = [*mine["latencies_s"], *figures.get("latencies_s", ())]
            mine["latencies_s"] = samples[-MAX_LATENCY_SAMPLES:]
        self.data["breaker_trips"] += theirs.get("breaker_trips", 0)
        _add(self.data["store_faults"], theirs.get("store_faults", {}))
        for group, counts in theirs.get("groups", {}).items():
            _add(self.data["groups"].setdefault(group, {}), counts)
        _add(self.data["lookups"], theirs.get("lookups", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval as one line of ``name=value`` for vLLM's log."""
        out: dict[str, int | float] = {
            "Lifecycle transitions": sum(self.data["transitions"].values()),
            "Illegal events": sum(self.data["illegal"].values()),
            "Stale events": sum(self.data["stale"].values()),
        }
        for pair, n in sorted(self.data["illegal"].items()):
            out[f"Illegal {pair}"] = n
        if any(self.data[f"worker_{k}"] for k in KINDS):
            worker = {k: self.data[f"worker_{k}"] for k in KINDS}
            out["Worker transitions"] = sum(worker["transitions"].values())
            out["Worker illegal events"] = sum(worker["illegal"].values())
            out["Worker stale events"] = sum(worker["stale"].values())
        for op, f in sorted(self.data["store"].items()):
            samples = sorted(f["latencies_s"])
            out[f"Store {op} ops"] = f["ops"]
            out[f"Store {op} avg ms"] = _ms(sum(samples) / len(samples))
            out[f"Store {op} p90 ms"] = _ms(_percentile(samples, 0.9))
            out[f"Store {op} MB"] = round(f["bytes"] / 2**20, 3)
            out[f"Store {op} failed keys"] = sum(f["failures"].values())
            if f["short_circuited"]:
                out[f"Store {op} short-circuited"] = f["short_circuited"]
        if self.data["breaker_trips"]:
            out["Store breaker trips"] = self.data["breaker_trips"]
        for kind, n in sorted(self.data["store_faults"].items()):
            out[f"Store faults {kind.replace('_', ' ')}"] = n
        out.update(_group_and_lookup_lines(self.data))
        return out


def _group_and_lookup_lines(data: dict[str, Any]) -> dict[str, int | float]:
    """`reduce`'s per-group and admission-lookup figures."""
    out: dict[str, int | float] = {}
    for group, counts in sorted(data["groups"].items()):
        for key, n in sorted(counts.items()):
            name = key.replace("_", " ")
            if key.endswith("_bytes"):
                out[f"Group {group} {name[:-6]} MB"] = round(n / 2**20, 3)
            else:
                out[f"Group {group} {name}"] = n
    for outcome, n in sorted(data["lookups"].items()):
        out[f"Lookups {outcome.replace('_', ' ')}"] = n
    return out


def _empty_op() -> dict[str, Any]:
    return {
        "ops": 0,
        "keys": 0,
        "bytes": 0,
        "short_circuited": 0,
        "failures": {},
        "latencies_s": [],
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted, possibly empty, list."""
    if not ordered:
        return 0.0
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _op_figures(stats: OpCounters) -> dict[str, Any]:
    return {
        "ops": stats.ops,
        "keys": stats.keys,
        "bytes": stats.bytes,
        "short_circuited": stats.short_circuited,
        "failures": {o.name: n for o, n in stats.failures.items() if n},
        "latencies_s": list(stats.latencies_s),
    }


def table_key(table: str, key: str) -> str:
    """``key`` (``"STATE/event"``) as the payload keys it for `table`."""
    return key if table == KV_TABLE else f"{table}:{key}"


def split_table_key(key: str) -> tuple[str, str, str]:
    """(table, state, event) of a payload key (see `table_key`)."""
    table, _, pair = key.rpartition(":")
    state, _, event = pair.partition("/")
    return table or KV_TABLE, state, event


@dataclass
class _Watched:
    """A machine a `StatsSource` reports, and what it reported last."""

    machine: AnyMachine
    rows: tuple[str, ...]
    seen_rows: Any
    seen: dict[str, dict[str, int]]


def _delta(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {
        k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0)
    }


class StatsSource:
    """Produces one half's `get_kv_connector_stats` answers.

    Each `take` returns what happened since the previous one: the
    machine's count increments and the store's counters (read with
    reset, so two halves sharing one client never count a call twice).

    Args:
        machine: The half's lifecycle machine, if any (`watch` adds one
            later, as the worker's, which comes late).
        also: More machines the half runs, reported beside it (the
            scheduler half's admission lookups).
        store: The store client's stats, if any.
        half: ``"scheduler"`` or ``"worker"``: which payload sections the
            machine's counts go to.
        groups: Returns the per-group counts since its last call (the
            ``groups`` section), if any.
        lookups: Returns the admission lookups' running counts by
            outcome (the ``lookups`` section reports their increments),
            if any.
    """

    def __init__(
        self,
        *,
        machine: AnyMachine | None = None,
        also: Iterable[AnyMachine] = (),
        store: StoreCounters | None = None,
        half: str = "scheduler",
        groups: Callable[[], dict[str, dict[str, int]]] | None = None,
        lookups: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        if half not in HALF_PREFIXES:
            msg = f"half must be one of {sorted(HALF_PREFIXES)}, got {half!r}"
            raise ValueError(msg)
        self._prefix = HALF_PREFIXES[half]
        self.groups = groups
        self._lookups = lookups
        self._lookups_seen: dict[str, int] = (
            dict(lookups()) if lookups is not None else {}
        )
        self._store = store
        self._trips = store.breaker_trips if store is not None else 0
        self._faults = store.faults_copy() if store is not None else {}
        self._fault_total = sum(self._faults.values())
        self._watched: list[_Watched] = []
        for watched in (machine, *also):
            if watched is not None:
                self.watch(watched)

    def watch(self, machine: AnyMachine) -> None:
        """Report `machine`'s counts from now on, beside those watched.

        Counts of a table other than `KV_TABLE` carry its name (see
        `table_key`).
        """
        name = machine.table.name

        def key(state: Any, event: Any) -> str:
            return table_key(name, pair_key(state, event))

        illegal, stale = machine.rejected_counts()
        self._watched.append(
            _Watched(
                machine,
                tuple(key(r.source, r.event) for r in machine.table.rows),
                machine.row_counts(),
                {
                    "illegal": {key(s, e): n for (s, e), n in illegal.items()},
                    "stale": {key(s, e): n for (s, e), n in stale.items()},
                },
            )
        )

    def take(self) -> LifecycleConnectorStats | None:
        """The figures since the last call, or None if there are none."""
        data = _empty()
        for watched in self._watched:
            self._take_lifecycle(watched, data)
        if self._store is not None and self._store.recorded:
            snapshot = self._store.snapshot(reset=True)
            data["store"] = {
                op.value: _op_figures(s) for op, s in snapshot.items() if s.ops
            }
        if self._store is not None:
            trips = self._store.breaker_trips
            if trips != self._trips:
                data["breaker_trips"] = trips - self._trips
                self._trips = trips
            if self._store.fault_total != self._fault_total:
                faults = self._store.faults_copy()
                data["store_faults"] = _delta(faults, self._faults)
                self._faults = faults
                self._fault_total = sum(faults.values())
        if self.groups is not None:
            data["groups"] = {g: c for g, c in self.groups().items() if c}
        if self._lookups is not None:
            now = dict(self._lookups())
            data["lookups"] = _delta(now, self._lookups_seen)
            self._lookups_seen = now
        return None if _is_empty(data) else LifecycleConnectorStats(data=data)

    def _take_lifecycle(self, watched: _Watched, data: dict[str, Any]) -> None:
        prefix, machine = self._prefix, watched.machine
        name = machine.table.name
        rows = machine.row_counts()
        if rows != watched.seen_rows:
            moved = data[f"{prefix}transitions"]
            for key, n, seen in zip(
                watched.rows, rows, watched.seen_rows, strict=True
            ):
                if n != seen:  # guarded alternatives share a key: summed
                    moved[key] = moved.get(key, 0) + n - seen
            watched.seen_rows = rows
        illegal, stale = machine.rejected_counts()
        for kind, counts in (("illegal", illegal), ("stale", stale)):
            if not counts:
                continue
            now = {
                table_key(name, pair_key(s, e)): n
                for (s, e), n in counts.items()
            }
            _add(data[f"{prefix}{kind}"], _delta(now, watched.seen[kind]))
            watched.seen[kind] = now


class LifecyclePromMetrics(KVConnectorPromMetrics):
    """Registers the connector's Prometheus metrics and records payloads.

    Counters by (half, table, state, event) for transitions, illegal and
    stale events;
    per store operation: calls, keys, bytes, failed keys by outcome and a
    latency histogram; breaker trips.
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        pair = [*labelnames, "half", "table", "state", "event"]
        op = [*labelnames, "operation"]
        # vLLM types the classes as a union; these are the two we use.
        counter = cast("type[Counter]", self._counter_cls)
        histogram = cast("type[Histogram]", self._histogram_cls)
        self._by_pair = {
            "transitions": counter(
                name=MetricName.TRANSITIONS,
                documentation="Lifecycle transitions applied, by the state "
                "the event arrived in and the event.",
                labelnames=pair,
            ),
            "illegal": counter(
                name=MetricName.ILLEGAL,
                documentation="Illegal lifecycle orderings ignored (state "
                "'unknown': an id the connector does not track).",
                labelnames=pair,
            ),
            "stale": counter(
                name=MetricName.STALE,
                documentation="Transfer completions from before a "
                "preemption, ignored.",
                labelnames=pair,
            ),
        }
        self._by_op = {
            "ops": counter(
                name=MetricName.STORE_OPS,
                documentation="Mooncake store batch calls.",
                labelnames=op,
            ),
            "keys": counter(
                name=MetricName.STORE_KEYS,
                documentation="Keys in Mooncake store batch calls.",
                labelnames=op,
            ),
            "bytes": counter(
                name=MetricName.STORE_BYTES,
                documentation="Bytes moved by Mooncake store calls.",
                labelnames=op,
            ),
        }
        self._failures = counter(
            name=MetricName.STORE_FAILURES,
            documentation="Keys a Mooncake store call did not serve, by "
            "outcome (MISS, STORE_FULL, MASTER_UNREACHABLE, ...).",
            labelnames=[*op, "outcome"],
        )
        self._latency = histogram(
            name=MetricName.STORE_LATENCY,
            documentation="Latency of Mooncake store batch calls.",
            labelnames=op,
            buckets=LATENCY_BUCKETS,
        )
        self._trips = counter(
            name=MetricName.BREAKER_TRIPS,
            documentation="Times the store's circuit breaker opened.",
            labelnames=list(labelnames),
        )
        self._faults = counter(
            name=MetricName.STORE_FAULTS,
            documentation="A store that answers but cannot transfer, by "
            "kind: transfer (keys failed although the master answered), "
            "metadata_missing / metadata_restored (this client's transfer "
            "metadata lost by the metadata server, e.g. after a master "
            "restart, and written back), metadata_stale (registered "
            "regions its published descriptor did not list; published "
            "again).",
            labelnames=[*labelnames, "kind"],
        )
        self._lookups = counter(
            name=MetricName.LOOKUPS,
            documentation="The scheduler half's admission lookups, by "
            "outcome: started (on_arrival: sent as the request arrived), "
            "answered, waited / wait_missed / wait_skipped (within "
            "lookup_wait_ms), timed_out, deferred, known_miss, local, ...",
            labelnames=[*labelnames, "outcome"],
        )

    def observe(
        self, transfer_stats_data: dict[str, Any], engine_idx: int = 0
    ) -> None:
        """Record one payload (`LifecycleConnectorStats.data`)."""
        engine = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        for half, prefix in HALF_PREFIXES.items():
            for kind, metric in self._by_pair.items():
                for key, n in data.get(f"{prefix}{kind}", {}).items():
                    table, state, event = split_table_key(key)
                    metric.labels(*engine, half, table, state, event).inc(n)
        for op, figures in data.get("store", {}).items():
            for key, metric in self._by_op.items():
                if figures.get(key):
                    metric.labels(*engine, op).inc(figures[key])
            for outcome, n in figures.get("failures", {}).items():
                self._failures.labels(*engine, op, outcome).inc(n)
            latency = self._latency.labels(*engine, op)
            for seconds in figures.get("latencies_s", ()):
                latency.observe(seconds)
        self._observe_store_health(data, engine)

    def _observe_store_health(
        self, data: dict[str, Any], engine: list[object]
    ) -> None:
        """Breaker trips and store faults of one payload."""
        if data.get("breaker_trips"):
            self._trips.labels(*engine).inc(data["breaker_trips"])
        for kind, n in data.get("store_faults", {}).items():
            self._faults.labels(*engine, kind).inc(n)
        for outcome, n in data.get("lookups", {}).items():
            self._lookups.labels(*engine, outcome).inc(n)
