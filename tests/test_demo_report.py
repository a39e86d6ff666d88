"""`SessionReport.to_json`: the demo's JSON, key for key and in order.

The expected dict was produced by the hand-written `to_json` this module's
`attrs.asdict` form replaced, from the same report.
"""

from __future__ import annotations

import collections
import json

from demo.report import InstanceStats, SessionReport, TransferTotals
from demo.spec import WorkloadConfig
from lifecycle.kv import TABLE, Event, State

EXPECTED = {
    "requests": 9,
    "seed": 3,
    "wall_s": 2.346,
    "requests_per_s": 3.8,
    "finished": 9,
    "outcomes": {"FINISHED_ABORTED": 1, "FINISHED_LENGTH_CAPPED": 8},
    "prefix_hit_rate": 0.192,
    "cross_instance_hits": {"requests": 3, "tokens": 48},
    "tokens_loaded": 48,
    "tokens_saved": 64,
    "bytes_loaded": 24576,
    "bytes_saved": 32768,
    "load_gb_per_s": 0.0123,
    "save_gb_per_s": 0.0109,
    "store_calls": {"exists": 7, "get": 3, "put": 4},
    "preemptions": 3,
    "resumed": 2,
    "aborts_sent": 1,
    "load_failures": {
        "injected": 1,
        "failed_load_jobs": 1,
        "recomputed": 1,
        "recovered": 1,
    },
    "replayed_finishes": 1,
    "transitions": {"NEW --lookup--> NEW": 5},
    "illegal": {"unknown/finish": 2},
    "stale": {"PREEMPTED/save_done": 1},
    "worker_illegal": {},
    "worker_stale": {},
    "mismatches": 0,
    "failures": ["x: y"],
    "crashes": [],
    "live_trackers": 0,
    "open_jobs": 0,
    "leaked_blocks": 0,
    "master_restarts": 1,
    "instances": {
        "A": {
            "role": "kv_producer",
            "submitted": 5,
            "finished": 5,
            "outcomes": {"FINISHED_ABORTED": 1, "FINISHED_LENGTH_CAPPED": 4},
            "admissions": 6,
            "local_hit_tokens": 32,
            "store_hit_admissions": 0,
            "store_hit_tokens": 0,
        },
        "B": {
            "role": "kv_consumer",
            "submitted": 4,
            "finished": 4,
            "outcomes": {"FINISHED_LENGTH_CAPPED": 4},
            "admissions": 4,
            "local_hit_tokens": 16,
            "store_hit_admissions": 3,
            "store_hit_tokens": 48,
        },
    },
    "trace_files": ["t-A.jsonl"],
    "ok": False,
}


def sample_report():
    a = InstanceStats(
        "A",
        "kv_producer",
        submitted=5,
        finished=5,
        outcomes=collections.Counter(
            {"FINISHED_LENGTH_CAPPED": 4, "FINISHED_ABORTED": 1}
        ),
        admissions=6,
        admitted_tokens=300,
        local_hit_tokens=32,
        aborts_sent=1,
        replayed_finishes=1,
    )
    b = InstanceStats(
        "B",
        "kv_consumer",
        submitted=4,
        finished=4,
        outcomes=collections.Counter({"FINISHED_LENGTH_CAPPED": 4}),
        admissions=4,
        admitted_tokens=200,
        local_hit_tokens=16,
        external_admissions=3,
        external_hit_tokens=48,
        load_failed_recomputed=["B-000002"],
        recovered={"B-000002": "FINISHED_LENGTH_CAPPED"},
    )
    return SessionReport(
        config=WorkloadConfig(requests=9, seed=3),
        wall_s=2.34567,
        ticks=77,
        instances=(a, b),
        transitions={next(iter(TABLE.rows)): 5},
        illegal={(None, Event.FINISH): 2},
        stale={(State.PREEMPTED, Event.SAVE_DONE): 1},
        worker_illegal={},
        worker_stale={},
        preemptions=3,
        resumed=2,
        loads=TransferTotals(calls=3, keys=9, bytes=3 * 8192, seconds=0.002),
        saves=TransferTotals(calls=4, keys=12, bytes=4 * 8192, seconds=0.003),
        lookups=TransferTotals(calls=7, keys=20),
        block_bytes=8192,
        load_faults_injected=1,
        failed_load_jobs=1,
        mismatches=0,
        failures=("x: y",),
        crashes=(),
        live_trackers=0,
        open_jobs=0,
        leaked_blocks=0,
        master_restarts=1,
        trace_files=("t-A.jsonl",),
    )


def test_to_json_keeps_every_key_value_and_order():
    got = sample_report().to_json()

    assert got == EXPECTED
    assert json.dumps(got) == json.dumps(EXPECTED)  # same key order


def test_to_json_is_plain_json():
    got = sample_report().to_json()

    assert json.loads(json.dumps(got)) == got
