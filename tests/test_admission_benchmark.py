"""`python -m benchmarks.admission --json` runs and reports sane JSON.

A tiny run of every mode and all three outage faults (kill, SIGSTOP,
blackhole), on a real master; the values are checked for shape and
consistency, never for speed.  A benchmark that raises inside one
measurement reports it as an ``error`` row, so this test is what notices.
"""

import json

import pytest

pytest.importorskip("vllm")

from benchmarks import admission

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def test_tiny_run_prints_sane_json(capsys, master_binary):
    argv = ["--json", "--arrivals", "8", "--repeats", "1"]
    argv += ["--down-s", "0.5", "--tail-s", "1.0", "--forward-ms", "0"]

    assert admission.main(argv) == 0

    doc = json.loads(capsys.readouterr().out)
    rows = doc["results"]
    assert [r["mode"] for r in rows] == list(admission.MODES)
    for row in rows:
        assert "error" not in row, row
        assert row["arrivals"] == 8
        assert row["connector_us_per_admission"] >= 0
        assert 0 < row["step_ms_p50"] <= row["step_ms_p99"]
        hits = row["requests_with_external_hits"]
        # Store hits are loaded from the store (not vLLM's local cache);
        # only ours loads anything.
        assert (hits["store_hit"] > 0) == (row["mode"] == "ours"), row
        assert hits["cold"] == hits["recent_miss"] == 0, row
    for key in admission.OUTAGE_RUNS:
        run = doc[key]
        assert run["master_restarted"], (key, run)
        assert run["requests"] > 0
        assert run["requests_finished"] == run["requests"], (key, run)
        assert run["steps"] > 0
        assert sum(run["store_hits_by_phase"].values()) > 0, (key, run)
        with_gc = run["max_connector_ms_in_a_step"]
        assert with_gc >= run["max_connector_ms_in_a_step_without_gc"]
    assert {"met_us", "met_steps", "met_outage"} <= set(doc["goal"])


def test_node_pool_mode_hits_blocks_that_live_in_the_pool(
    capsys, master_binary
):
    """``node_pool``: prefixes put by a client with no segment (only the
    node-level pool can hold them) are store hits, as with ``ours``; so
    are ``mirror_pool``'s (a replica in the writer's segment, one in the
    pool; the connector's own clients mirror too)."""
    argv = ["--json", "--arrivals", "8", "--repeats", "1", "--no-outage"]
    argv += ["--forward-ms", "0", "--modes", "ours,node_pool,mirror_pool"]

    assert admission.main(argv) == 0

    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["mode"] for r in rows] == ["ours", "node_pool", "mirror_pool"]
    for row in rows:
        assert "error" not in row, row
        assert row["requests_with_external_hits"]["store_hit"] > 0, row


def test_unknown_mode_is_rejected():
    with pytest.raises(SystemExit):
        admission.main(["--modes", "ours,bogus"])
    with pytest.raises(SystemExit):
        admission.main(["--faults", "kill,flood"])


def test_an_outage_in_the_waited_mode(capsys, master_binary):
    """``--outage-mode waited --faults kill``: one outage run, with a
    lookup wait budget, every request finished after the restart."""
    argv = ["--json", "--arrivals", "4", "--repeats", "1", "--modes", ""]
    argv += ["--down-s", "0.5", "--tail-s", "1.0", "--forward-ms", "0"]
    argv += ["--outage-mode", "waited", "--faults", "kill"]

    assert admission.main(argv) == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["results"] == []
    assert [k for k in admission.OUTAGE_RUNS if k in doc] == ["outage"]
    run = doc["outage"]
    assert (run["mode"], run["fault"]) == ("waited", "kill")
    assert run["master_restarted"]
    assert run["requests_finished"] == run["requests"] > 0


def test_waited_mode_admits_in_the_arrival_step(capsys, master_binary):
    """``waited`` (``lookup_wait_ms``): the first requests of a burst
    that need a lookup (store hits, cold prompts) are admitted in the
    step they arrive; with ``layerwise`` none is (its lookups answer a
    step later). A generous budget: this checks the path, not speed."""
    argv = ["--json", "--arrivals", "8", "--repeats", "1", "--no-outage"]
    argv += ["--modes", "layerwise,waited", "--wait-ms", "500"]

    assert admission.main(argv) == 0

    rows = json.loads(capsys.readouterr().out)["results"]
    by_mode = {r["mode"]: r for r in rows}
    for row in rows:
        assert "error" not in row, row

    def asked_at_once(row):
        at_once = row["admitted_in_arrival_step"]
        return at_once["cold"] + at_once["store_hit"]

    assert asked_at_once(by_mode["layerwise"]) == 0, by_mode["layerwise"]
    assert asked_at_once(by_mode["waited"]) > 0, by_mode["waited"]
    assert by_mode["waited"]["requests_with_external_hits"]["store_hit"] > 0


def test_waited_mode_asks_a_burst_on_arrival_in_one_store_call(
    capsys, master_binary
):
    """``waited``: lookups leave as the requests arrive, so a burst of 32
    costs the master a call or two (it cost one per request that needed
    a lookup, sent as vLLM asked) and every request of it is admitted,
    and run, in its arrival step."""
    argv = ["--json", "--arrivals", "32", "--repeats", "1", "--no-outage"]
    argv += ["--modes", "waited", "--wait-ms", "500"]

    assert admission.main(argv) == 0

    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["results"]
    assert "error" not in row, row
    assert doc["goal"]["met_store_hit_in_arrival_step"] is True
    assert row["lookup_store_calls_per_burst"] <= 2, row
    assert sum(row["extra_steps_to_run"].values()) == 0, row
    assert sum(row["admitted_in_arrival_step"].values()) == 32, row
    assert row["requests_with_external_hits"]["store_hit"] > 0, row
