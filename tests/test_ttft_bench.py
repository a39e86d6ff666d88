"""`benchmarks.ttft`'s load phase, read from a lifecycle trace."""

from __future__ import annotations

import json

from benchmarks.ttft import load_phases


def _write(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_load_phases_time_each_load_from_issue_to_report(tmp_path):
    """Per loaded request, in the order the loads began: ms from
    ``alloc_external`` to ``load_done``; requests that never loaded (a
    cold one) or whose load never ended are left out; files merge."""
    _write(
        tmp_path / "trace-1.jsonl",
        [
            {"meta": "start", "time": 0.0},
            {"time": 1.000, "req_id": "cold", "event": "alloc_local"},
            {"time": 2.000, "req_id": "b", "event": "alloc_external"},
            {"time": 2.0125, "req_id": "b", "event": "load_done"},
            {"time": 3.000, "req_id": "hung", "event": "alloc_external"},
        ],
    )
    _write(
        tmp_path / "trace-2.jsonl",
        [
            {"time": 1.500, "req_id": "a", "event": "alloc_external"},
            {"time": 1.5090, "req_id": "a", "event": "load_done"},
            # Issued again after its load ended: nothing more reported.
            {"time": 1.5095, "req_id": "a", "event": "alloc_external"},
        ],
    )
    phases = load_phases(sorted(tmp_path.glob("trace-*.jsonl")))
    assert phases == [9.0, 12.5]
