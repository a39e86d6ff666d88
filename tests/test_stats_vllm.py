"""Connector stats through vLLM 0.33's own path, over a real master.

The worker half's stats ride in `KVConnectorOutput.kv_connector_stats`,
the real `Scheduler.update_from_output` folds in the scheduler half's and
puts the payload in `SchedulerStats`; that crosses vLLM's msgpack encoder,
then vLLM's `KVConnectorLogging` and `KVConnectorProm` consume it.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from connector.integration.stats import (
    LifecycleConnectorStats,
    MetricName,
    table_key,
)
from harness import Harness
from lifecycle.kv import Event
from lifecycle.trace import pair_key
from tests.connector_helpers import CONNECTOR, prompt, run, side
from tests.test_stats import registry_bound

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def capture_outputs(h):
    """Every `EngineCoreOutputs` the real scheduler returns, msgpack'd."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    payloads = []
    real = h.scheduler.update_from_output

    def update_from_output(*args, **kwargs):
        outputs = real(*args, **kwargs)
        for eco in outputs.values():
            wire = decoder.decode(encoder.encode(eco))
            stats = wire.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                payloads.append(stats.kv_connector_stats)
        return outputs

    h.scheduler.update_from_output = update_from_output
    return payloads


def counts_of(*machines):
    """Transition counts keyed as the payload keys them (`table_key`)."""
    counts = {}
    for machine in machines:
        for r, n in machine.transition_counts().items():
            key = table_key(machine.table.name, pair_key(r.source, r.event))
            if n:
                counts[key] = counts.get(key, 0) + n
    return counts


def vllm_log_line(h, payloads):
    """What vLLM's `KVConnectorLogging` logs for the payloads."""
    logging_ = KVConnectorLogging(h.vllm_config.kv_transfer_config)
    lines = []
    for data in payloads:
        logging_.observe(data)
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    return line


def vllm_prometheus(h, payloads):
    """vLLM's `KVConnectorProm` fed the payloads, on its own registry."""
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = registry_bound(Gauge, registry)
        _counter_cls = registry_bound(Counter, registry)
        _histogram_cls = registry_bound(Histogram, registry)

    prom = Prom(h.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    for data in payloads:
        prom.observe(data, 0)
    return registry


def check_prometheus(b, payloads):
    """vLLM's Prometheus hook registers and records the payloads."""
    registry = vllm_prometheus(b, payloads)
    engine = {"model_name": "tiny", "engine": "0"}
    value = registry.get_sample_value
    seen = LifecycleConnectorStats()
    for data in payloads:
        seen.aggregate(LifecycleConnectorStats(data=data))
    tables = set()
    for key, n in seen.data["transitions"].items():
        table, _, pair = key.rpartition(":")
        state, event = pair.split("/")
        tables.add(table or "lifecycle")
        labels = {**engine, "half": "scheduler", "state": state}
        labels |= {"event": event, "table": table or "lifecycle"}
        assert value(MetricName.TRANSITIONS, labels) == n
    # Both of the scheduler half's tables: the KV lifecycle and the
    # admission lookups.
    assert tables == {"lifecycle", "admission-lookup"}
    get = {**engine, "operation": "get"}
    assert (
        value(MetricName.STORE_KEYS, get) == seen.data["store"]["get"]["keys"]
    )
    gets = seen.data["store"]["get"]["ops"]
    assert gets in {1, 2}  # two: a load split between segments
    assert value(f"{MetricName.STORE_LATENCY}_count", get) == gets


def test_stats_flow_through_the_real_scheduler_and_vllm_loggers(
    extra, harnesses, caplog
):
    a = Harness(CONNECTOR, extra_config=extra, num_blocks=40)
    harnesses.append(a)
    a.add_request("a", prompt(5, 64), max_tokens=2)
    run(a)
    b = Harness(CONNECTOR, extra_config=extra, num_blocks=40, log_stats=True)
    harnesses.append(b)
    for connector in (b.scheduler_connector, b.worker_connector):
        connector._client.stats.snapshot(reset=True)  # a's calls
    payloads = capture_outputs(b)
    b.add_request("b", [*prompt(5, 64), 9], max_tokens=6)
    b.add_request("c", prompt(6, 40), max_tokens=6)
    b.step()
    assert side(b).registry.fire("nobody", Event.FINISH) is False
    run(b)
    assert b.finished_by_status() == {"FINISHED_LENGTH_CAPPED": 2}

    total = LifecycleConnectorStats()
    for data in payloads:
        total.aggregate(b.scheduler_connector.build_kv_connector_stats(data))
    for connector in (b.scheduler_connector, b.worker_connector):
        leftover = connector.get_kv_connector_stats()
        if leftover is not None:
            total.aggregate(leftover)
    # The scheduler half's two tables: the KV lifecycle and the lookups.
    scheduler = side(b)
    assert total.data["transitions"] == counts_of(
        scheduler.machine, scheduler.lookup_machine
    )
    assert any(
        k.startswith("admission-lookup:") for k in total.data["transitions"]
    )
    worker = b.worker_connector.worker_side.machine
    assert total.data["worker_transitions"] == counts_of(worker)
    assert total.data["worker_transitions"]["LOADING/load_done"] == 1
    assert total.data["illegal"] == {"unknown/finish": 1}
    store = total.data["store"]
    block_bytes = b.worker_connector.worker_side.layout.block_bytes
    assert store["get"]["keys"] == 4  # the 64-token prefix
    assert store["get"]["bytes"] == 4 * block_bytes
    assert store["exists"]["ops"] >= 1  # b's and c's lookups: one call
    # The lookups section: the scheduler half's own counts, all of them.
    assert total.data["lookups"] == {
        k: n for k, n in scheduler.lookup_counts.items() if n
    }
    assert total.data["lookups"]["started"] >= 2  # b's and c's
    assert store["exists"]["keys"] >= 4 + 2  # their full prompt blocks
    assert store["put"]["keys"] >= 2  # c's full prompt blocks
    assert len(store["get"]["latencies_s"]) == store["get"]["ops"]

    # vLLM's interval logger accepts the payloads.
    line = vllm_log_line(b, payloads)
    transitions = sum(sum(d["transitions"].values()) for d in payloads)
    assert f"Lifecycle transitions={transitions}," in line
    assert "Illegal unknown/finish=1" in line
    # One get, or two when the prefix's blocks were placed partly in
    # b's own segment (read zero-copy) and partly in a's (staged).
    assert store["get"]["ops"] in {1, 2}
    assert f"Store get ops={store['get']['ops']}" in line

    check_prometheus(b, payloads)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
