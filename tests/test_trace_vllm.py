"""The connector's lifecycle trace, inside vLLM 0.33's real scheduler.

A preempt-then-abort scenario runs with ``lifecycle_trace`` set; replaying
the file must give the scheduler half's own counts, edge for edge.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from harness import Harness
from lifecycle.kv import Event, State
from lifecycle.trace import ILLEGAL, replay, replay_file, summarize
from tests.connector_helpers import CONNECTOR, preempt_then_abort, side

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


@pytest.fixture
def extra(extra, tmp_path):
    """conftest's `extra`, tracing to ``tmp_path / "trace.jsonl"``."""
    return {**extra, "lifecycle_trace": str(tmp_path / "trace.jsonl")}


def preempt_then_abort_closed(extra):
    """tests.test_connector_vllm's scenario; returns the closed harness."""
    with Harness(CONNECTOR, extra_config=extra, num_blocks=12) as h:
        victim = preempt_then_abort(h)
    return h, victim


def test_replayed_trace_equals_the_scheduler_machine(extra, tmp_path):
    h, victim = preempt_then_abort_closed(extra)
    machine = side(h).machine
    assert h.scheduler_connector.trace.closed
    result = replay_file(tmp_path / "trace.jsonl")
    assert result.divergences == []
    assert result.dropped == 0
    assert result.machine.transition_counts() == machine.transition_counts()
    assert result.machine.illegal_counts == machine.illegal_counts
    assert result.machine.stale_counts == machine.stale_counts
    assert summarize(result.machine) == summarize(machine)
    counts = result.machine.transition_counts()
    assert sum(n for r, n in counts.items() if r.event is Event.PREEMPT) >= 1
    assert set(result.requests) == {f"r{i}" for i in range(4)}
    path = result.requests[victim].path()
    assert "-preempt-> PREEMPTED -reset-> RESET" in path
    assert path.endswith("-abort-> ABORTED")


def test_planted_illegal_line_in_a_real_trace(extra, tmp_path):
    h, victim = preempt_then_abort_closed(extra)
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    at = next(
        i
        for i, x in enumerate(lines)
        if json.loads(x).get("req_id") == victim
        and json.loads(x)["outcome"] == "RESET"
    )
    lines.insert(
        at + 1,
        json.dumps(
            {
                "time": 0.0,
                "req_id": victim,
                "epoch": json.loads(lines[at])["epoch"],
                "state": "RESET",
                "event": "save_done",
                "outcome": ILLEGAL,
            }
        ),
    )
    result = replay(lines)
    first = result.requests[victim].first_illegal
    assert first is not None
    assert first.line == at + 2
    assert (first.state, first.event) == (State.RESET, Event.SAVE_DONE)
    machine = side(h).machine
    assert result.machine.transition_counts() == machine.transition_counts()
    assert result.machine.illegal_total == machine.illegal_total + 1


def test_the_bound_holds_in_the_connector(extra, tmp_path):
    extra["lifecycle_trace_max_events"] = 25
    h, _ = preempt_then_abort_closed(extra)
    writer = h.scheduler_connector.trace
    machine = side(h).machine
    total = sum(machine.transition_counts().values())
    total += machine.illegal_total + sum(machine.stale_counts.values())
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    events = [x for x in lines if '"meta"' not in x]
    assert len(events) == 25
    assert writer.dropped == total - 25 > 0
    assert replay(lines).dropped == writer.dropped
