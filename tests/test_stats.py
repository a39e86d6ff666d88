"""`connector.integration.stats`: deltas, aggregation, reduce, Prometheus.

No engine.

The machine and the store counters are the real ones; only the store calls
are recorded by hand (`BatchResult`s), as the store client would.
"""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.integration.stats import (
    MAX_LATENCY_SAMPLES,
    LifecycleConnectorStats,
    LifecyclePromMetrics,
    MetricName,
    StatsSource,
)
from connector.integration.vllm_connector import MooncakeLifecycleConnector
from connector.store import BatchResult, Op, Outcome, StoreCounters
from lifecycle import LifecycleMachine, Registry
from lifecycle.kv import TABLE, Event
from lifecycle.kv import KVTracker as Tracker

E = Event


def registry_bound(base, registry):
    """`base` registering into `registry` instead of the global one."""

    class Bound(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("registry", registry)
            super().__init__(*args, **kwargs)

    return Bound


def metric_types(registry):
    return {
        Gauge: registry_bound(Gauge, registry),
        Counter: registry_bound(Counter, registry),
        Histogram: registry_bound(Histogram, registry),
    }


def record(stats, op, outcomes, *, nbytes=0, elapsed_s=0.001):
    failed = sum(o not in {Outcome.HIT, Outcome.STORED} for o in outcomes)
    result = BatchResult(
        op, outcomes, [0] * len(outcomes), nbytes=nbytes, elapsed_s=elapsed_s
    )
    stats.record(result, failed)


def one_engine_prom():
    """The connector's metrics for engine ``0`` of model ``m`` on a fresh
    registry, and the registry's sample reader."""
    registry = CollectorRegistry()
    prom = MooncakeLifecycleConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    return prom, registry.get_sample_value


@pytest.fixture
def lifecycle():
    machine = LifecycleMachine(TABLE)
    return machine, Registry(machine, Tracker)


def test_source_reports_what_happened_since_the_last_take(lifecycle):
    machine, registry = lifecycle
    store = StoreCounters()
    source = StatsSource(machine=machine, store=store)
    assert source.take() is None
    registry.get_or_create("r")
    registry.fire("r", E.LOOKUP)
    registry.fire("r", E.LOOKUP)
    registry.fire("r", E.ALLOC_LOCAL)
    record(store, Op.GET, [Outcome.HIT, Outcome.MISS], nbytes=512)
    first = source.take()
    assert first is not None
    assert first.data["transitions"] == {"NEW/lookup": 2, "NEW/alloc_local": 1}
    assert first.data["illegal"] == {}
    get = first.data["store"]["get"]
    assert (get["ops"], get["keys"], get["bytes"]) == (1, 2, 512)
    assert get["failures"] == {"MISS": 1}
    assert get["latencies_s"] == [0.001]
    assert source.take() is None
    registry.fire("r", E.LOAD_DONE)  # illegal in SAVING
    registry.fire("gone", E.FINISH)  # unknown id
    registry.fire("r", E.SAVE_DONE, epoch=7)  # stale
    store.trip()
    second = source.take()
    assert second is not None
    assert second.data["transitions"] == {}
    assert second.data["illegal"] == {
        "SAVING/load_done": 1,
        "unknown/finish": 1,
    }
    assert second.data["stale"] == {"SAVING/save_done": 1}
    assert second.data["breaker_trips"] == 1
    assert second.data["store"] == {}


def test_the_worker_half_reports_its_own_machine_apart(lifecycle):
    machine, registry = lifecycle
    registry.get_or_create("early")
    registry.fire("early", E.LOOKUP)  # before `watch`: not reported
    source = StatsSource(half="worker")
    assert source.take() is None
    source.watch(machine)
    registry.get_or_create("r")
    registry.fire("r", E.ALLOC_EXTERNAL)
    registry.fire("r", E.LOAD_DONE, epoch=3)
    stats = source.take()
    assert stats is not None
    assert stats.data["worker_transitions"] == {"NEW/alloc_external": 1}
    assert stats.data["worker_stale"] == {"LOADING/load_done": 1}
    assert stats.data["transitions"] == {}
    reduced = stats.reduce()
    assert reduced["Worker transitions"] == 1
    assert reduced["Worker stale events"] == 1
    assert reduced["Lifecycle transitions"] == 0
    with pytest.raises(ValueError, match="half"):
        StatsSource(half="both")


def test_two_halves_sharing_a_client_never_count_a_call_twice():
    store = StoreCounters()
    scheduler, worker = StatsSource(store=store), StatsSource(store=store)
    record(store, Op.EXISTS, [Outcome.HIT])
    record(store, Op.PUT, [Outcome.STORED] * 3, nbytes=300)
    a = scheduler.take()
    record(store, Op.PUT, [Outcome.STORE_FULL])
    b = worker.take()
    assert a is not None
    assert b is not None
    both = a.aggregate(b)
    assert both.data["store"]["put"]["ops"] == 2
    assert both.data["store"]["put"]["keys"] == 4
    assert both.data["store"]["put"]["failures"] == {"STORE_FULL": 1}
    assert both.data["store"]["exists"]["ops"] == 1


def payload(transitions, *, get_ops=0, latencies=()):
    data = {"transitions": transitions, "illegal": {}, "stale": {}}
    data["store"] = (
        {
            "get": {
                "ops": get_ops,
                "keys": 2 * get_ops,
                "bytes": 1024 * get_ops,
                "short_circuited": 0,
                "failures": {"MISS": 1},
                "latencies_s": list(latencies),
            }
        }
        if get_ops
        else {}
    )
    return data


def test_aggregate_sums_ranks_and_reduce_summarises():
    rank0 = LifecycleConnectorStats(
        data=payload({"NEW/lookup": 2}, get_ops=1, latencies=[0.002])
    )
    rank1 = LifecycleConnectorStats(
        data=payload(
            {"NEW/lookup": 1, "SAVING/preempt": 1},
            get_ops=3,
            latencies=[0.001, 0.003, 0.004],
        )
    )
    total = rank0.aggregate(rank1)
    assert total is rank0
    assert total.data["transitions"] == {"NEW/lookup": 3, "SAVING/preempt": 1}
    reduced = total.reduce()
    assert reduced["Lifecycle transitions"] == 4
    assert reduced["Illegal events"] == 0
    assert reduced["Store get ops"] == 4
    assert reduced["Store get avg ms"] == 2.5
    assert reduced["Store get p90 ms"] == 4.0
    assert reduced["Store get failed keys"] == 2
    assert reduced["Store get MB"] == round(4096 / 2**20, 3)
    assert "Store get short-circuited" not in reduced
    rank1.data["store"]["get"]["short_circuited"] = 2
    assert rank1.reduce()["Store get short-circuited"] == 2
    assert rank1.data["transitions"] == {"NEW/lookup": 1, "SAVING/preempt": 1}


def test_empty_stats_and_clone_and_reset():
    stats = LifecycleConnectorStats()
    assert stats.is_empty()
    full = LifecycleConnectorStats(data=payload({"NEW/lookup": 1}))
    assert not full.is_empty()
    assert stats.aggregate(LifecycleConnectorStats()).is_empty()
    clone = full.clone_and_reset()
    assert full.is_empty()
    assert clone.data["transitions"] == {"NEW/lookup": 1}


def test_latency_samples_stay_bounded_while_an_interval_accumulates():
    stats = LifecycleConnectorStats()
    chunk = [0.001] * 1000
    for _ in range(6):
        stats.aggregate(
            LifecycleConnectorStats(
                data=payload({}, get_ops=1000, latencies=chunk)
            )
        )
    get = stats.data["store"]["get"]
    assert len(get["latencies_s"]) == MAX_LATENCY_SAMPLES
    assert get["ops"] == 6000


def test_payload_survives_json_and_is_rebuilt_by_the_connector():
    stats = LifecycleConnectorStats(
        data=payload({"RESET/finish": 2}, get_ops=1, latencies=[0.5])
    )
    stats.data["illegal"] = {"unknown/finish": 1}
    wire = json.loads(json.dumps(stats.to_dict()))
    rebuilt = MooncakeLifecycleConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, LifecycleConnectorStats)
    assert rebuilt.data == stats.data
    assert rebuilt.reduce() == stats.reduce()
    assert MooncakeLifecycleConnector.build_kv_connector_stats(None).is_empty()
    # Worker -> engine core: vLLM pickles the model runner's output.
    assert pickle.loads(pickle.dumps(stats)).data == stats.data  # noqa: S301


def test_prometheus_metrics_follow_vllm_names_and_count():
    registry = CollectorRegistry()
    prom = MooncakeLifecycleConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    assert isinstance(prom, LifecyclePromMetrics)
    data = payload(
        {"SAVING/preempt": 2, "admission-lookup:IN_FLIGHT/answer": 5},
        get_ops=2,
        latencies=[0.002, 0.2],
    )
    data["illegal"] = {"unknown/finish": 1}
    data["worker_stale"] = {"RESET/save_done": 3}
    data["breaker_trips"] = 1
    prom.observe(data, engine_idx=1)
    prom.observe(data, engine_idx=1)
    engine = {"model_name": "m", "engine": "1"}
    value = registry.get_sample_value
    scheduler = {**engine, "half": "scheduler", "table": "lifecycle"}
    pair = {**scheduler, "state": "SAVING", "event": "preempt"}
    assert value(MetricName.TRANSITIONS, pair) == 4
    # Another table's counts carry its name; the KV table's keys do not.
    lookup = {**scheduler, "table": "admission-lookup"}
    asked = {**lookup, "state": "IN_FLIGHT", "event": "answer"}
    assert value(MetricName.TRANSITIONS, asked) == 10
    assert value(MetricName.TRANSITIONS, {**pair, **lookup}) is None
    unknown = {**scheduler, "state": "unknown", "event": "finish"}
    assert value(MetricName.ILLEGAL, unknown) == 2
    stale = {
        **engine,
        "half": "worker",
        "table": "lifecycle",
        "state": "RESET",
        "event": "save_done",
    }
    assert value(MetricName.STALE, stale) == 6
    assert value(MetricName.STALE, {**stale, "half": "scheduler"}) is None
    get = {**engine, "operation": "get"}
    assert value(MetricName.STORE_OPS, get) == 4
    assert value(MetricName.STORE_BYTES, get) == 4096
    assert value(MetricName.STORE_FAILURES, {**get, "outcome": "MISS"}) == 2
    histogram = MetricName.STORE_LATENCY
    assert value(f"{histogram}_count", get) == 4
    assert value(f"{histogram}_bucket", {**get, "le": "0.0025"}) == 2
    assert value(MetricName.BREAKER_TRIPS, engine) == 2
    zero = {"model_name": "m", "engine": "0", "operation": "get"}
    assert value(MetricName.STORE_OPS, zero) is None
    names = {m.name for m in registry.collect()}
    assert all(n.startswith("vllm:kv_lifecycle_") for n in names)


def test_replica_retries_are_counted_as_their_own_operation(lifecycle):
    """A get's keys read again from another replica count under
    ``replica_get``: keys tried, failures by outcome (successes are the
    difference), in the payload and in Prometheus."""
    machine, _ = lifecycle
    store = StoreCounters()
    source = StatsSource(machine=machine, store=store)
    record(store, Op.GET, [Outcome.HIT] * 3, nbytes=300)
    record(
        store,
        Op.REPLICA_GET,
        [Outcome.HIT, Outcome.HIT, Outcome.TRANSFER_FAILED],
        nbytes=200,
    )
    taken = source.take()
    assert taken is not None
    retried = taken.data["store"]["replica_get"]
    assert (retried["ops"], retried["keys"], retried["bytes"]) == (1, 3, 200)
    assert retried["failures"] == {"TRANSFER_FAILED": 1}
    assert taken.data["store"]["get"]["keys"] == 3
    assert taken.reduce()["Store replica_get failed keys"] == 1
    registry = CollectorRegistry()
    prom = MooncakeLifecycleConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types(registry),
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(taken.data)
    labels = {"engine": "0", "operation": "replica_get"}
    value = registry.get_sample_value
    assert value(MetricName.STORE_KEYS, labels) == 3
    failed = {**labels, "outcome": "TRANSFER_FAILED"}
    assert value(MetricName.STORE_FAILURES, failed) == 1


def test_store_faults_reach_the_payload_the_log_line_and_prometheus():
    """A store that answers but cannot transfer is not a silent 0: its
    fault counts travel as deltas, add up over ranks, show in the
    interval's log line and in ``vllm:kv_lifecycle_store_faults_total``."""
    store = StoreCounters()
    store.fault("metadata_missing", 2)  # before the source: not reported
    source = StatsSource(store=store, half="worker")
    assert source.take() is None
    store.fault("transfer", 4)
    store.fault("metadata_missing", 2)
    store.fault("metadata_restored", 2)
    first = source.take()
    assert first is not None
    assert first.data["store_faults"] == {
        "transfer": 4,
        "metadata_missing": 2,
        "metadata_restored": 2,
    }
    assert source.take() is None
    other = LifecycleConnectorStats(data={"store_faults": {"transfer": 1}})
    first.aggregate(other)
    assert first.data["store_faults"]["transfer"] == 5
    line = first.reduce()
    assert line["Store faults transfer"] == 5
    assert line["Store faults metadata restored"] == 2
    rebuilt = LifecycleConnectorStats(data=json.loads(json.dumps(first.data)))
    assert rebuilt.data["store_faults"] == first.data["store_faults"]

    prom, value = one_engine_prom()
    prom.observe(first.data, engine_idx=0)
    prom.observe(first.data, engine_idx=0)
    engine = {"model_name": "m", "engine": "0"}
    assert value(MetricName.STORE_FAULTS, {**engine, "kind": "transfer"}) == 10
    restored = {**engine, "kind": "metadata_restored"}
    assert value(MetricName.STORE_FAULTS, restored) == 4


def test_lookup_outcomes_reach_the_payload_the_log_line_and_prometheus():
    """The scheduler half's lookup counts (`lookup_counts`) travel as
    increments, add up, show in the log line and in
    ``vllm:kv_lifecycle_admission_lookups_total`` by outcome."""
    counts = {"started": 2}  # before the source: not reported
    source = StatsSource(lookups=lambda: counts)
    assert source.take() is None
    counts.update(started=5, on_arrival=3, waited=2, wait_skipped=1)
    first = source.take()
    assert first is not None
    assert first.data["lookups"] == {
        "started": 3,
        "on_arrival": 3,
        "waited": 2,
        "wait_skipped": 1,
    }
    assert source.take() is None
    first.aggregate(LifecycleConnectorStats(data={"lookups": {"waited": 4}}))
    assert first.data["lookups"]["waited"] == 6
    line = first.reduce()
    assert line["Lookups on arrival"] == 3
    assert line["Lookups wait skipped"] == 1
    rebuilt = LifecycleConnectorStats(data=json.loads(json.dumps(first.data)))
    assert rebuilt.data["lookups"] == first.data["lookups"]

    prom, value = one_engine_prom()
    prom.observe(first.data, engine_idx=0)
    engine = {"model_name": "m", "engine": "0"}
    assert value(MetricName.LOOKUPS, {**engine, "outcome": "waited"}) == 6
    assert value(MetricName.LOOKUPS, {**engine, "outcome": "on_arrival"}) == 3
