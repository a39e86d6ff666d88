"""`benchmarks.ttft`'s load phase (read from a lifecycle trace) and its
row-over-row ratios."""

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


def test_row_ratios_are_a_rows_median_over_another():
    """``*_over_embedded`` divide by the main row's median and
    ``*_over_embedded_beside_peer`` by the peer row's; a missing row or
    median gives None, never a division error."""
    from benchmarks.ttft import _over, _over_row  # noqa: PLC0415

    dummy = {"hit_ttft_median_s": 0.072, "hit_load_phase_ms_median": 12.8}
    peer = {"hit_ttft_median_s": 0.087, "hit_load_phase_ms_median": 30.2}
    assert _over(dummy, 0.064) == 1.125
    assert _over(dummy, 8.0, "hit_load_phase_ms_median") == 1.6
    key = "hit_load_phase_ms_median"
    assert _over_row(dummy, peer, key) == round(12.8 / 30.2, 3)
    assert _over_row(dummy, None, key) is None
    assert _over_row(None, peer, key) is None
    assert _over_row(dummy, {**peer, key: None}, key) is None
    assert _over({**dummy, key: None}, 8.0, key) is None
