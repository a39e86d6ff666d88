"""`python -m benchmarks.scheduler_step --json` runs and reports sane JSON.

A tiny run (a few running requests, a few steps) of every set-up; the
values are checked for shape and consistency, never for speed.
"""

import json

import pytest

pytest.importorskip("vllm")

from benchmarks import scheduler_step

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def test_tiny_run_prints_sane_json(capsys, master_binary):
    argv = ["--json", "--n", "8", "--n", "16", "--steps", "3", "--warmup", "1"]

    assert scheduler_step.main(argv) == 0

    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "scheduler_step"
    assert (doc["steps"], doc["warmup"]) == (3, 1)
    assert [r["n_running"] for r in doc["results"]] == [8, 16]
    for row in doc["results"]:
        assert not [k for k in row if k.endswith("_error")], row
        for mode in scheduler_step.MODES:
            assert row[f"{mode}_step_ms"] > 0
        for mode in ("noop", "ours", "theirs"):
            connector_ms = row[f"{mode}_connector_us"] / 1e3
            assert 0 < connector_ms < row[f"{mode}_step_ms"]
            assert row[f"{mode}_share"] == pytest.approx(
                connector_ms / row[f"{mode}_step_ms"], abs=1e-3
            )
        assert row["ours_over_theirs"] == pytest.approx(
            row["ours_connector_us"] / row["theirs_connector_us"], rel=1e-2
        )
    assert doc["goal"] == {"n_running": 1024, "max_share": 0.05}


def test_unknown_mode_is_rejected():
    with pytest.raises(SystemExit):
        scheduler_step.main(["--modes", "ours,bogus"])
