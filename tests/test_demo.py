"""`python -m demo` and `benchmarks.soak` at a tiny size.

Both run vLLM 0.33's real scheduler (two instances) with the connector
over a real `mooncake_master`; the harness checks KV content every step.
"""

from __future__ import annotations

import collections
import json
import shutil

import pytest

pytest.importorskip("vllm")

from benchmarks import soak
from demo.__main__ import main as demo_main
from lifecycle.kv import Event
from lifecycle.trace import replay_file

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def test_demo_shows_every_fault_and_no_mismatch(
    master_binary, tmp_path, capsys
):
    rc = demo_main(
        [
            "--requests=120",
            "--seed=3",
            f"--out={tmp_path}",
            "--json",
            "--no-progress",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["finished"] == 120
    assert sum(report["outcomes"].values()) == 120
    assert report["outcomes"]["FINISHED_ABORTED"] >= 1
    assert report["preemptions"] >= 1
    assert report["resumed"] >= 1
    assert report["cross_instance_hits"]["requests"] >= 1
    assert report["tokens_loaded"] > 0
    assert report["tokens_saved"] > 0
    loads = report["load_failures"]
    assert loads["injected"] >= 1
    assert loads["recomputed"] >= 1
    assert loads["recovered"] >= 1
    assert report["illegal"]["unknown/finish"] >= 1
    assert report["transitions"]["SAVING --preempt--> PREEMPTED"] >= 1
    assert report["transitions"]["LOADING --load_failed--> RESET"] >= 1
    assert report["mismatches"] == 0
    assert report["failures"] == []
    assert report["crashes"] == []
    assert report["live_trackers"] == 0
    assert report["leaked_blocks"] == 0
    assert report["ok"] is True
    assert rc == 0
    assert (tmp_path / "demo.log").stat().st_size > 0
    assert report["trace_files"] == [
        str(tmp_path / "demo-trace-A.jsonl"),
        str(tmp_path / "demo-trace-B.jsonl"),
    ]
    # The traces alone reproduce the report's scheduler-side counts.
    replayed: collections.Counter[str] = collections.Counter()
    illegal: collections.Counter[str] = collections.Counter()
    for name in report["trace_files"]:
        summary = replay_file(name).summary()
        assert summary["dropped"] == summary["divergences"] == 0
        replayed.update(summary["transitions"])
        illegal.update(summary["illegal"])
    fired = {row: n for row, n in report["transitions"].items() if n}
    assert dict(replayed) == fired
    assert dict(illegal) == {k: n for k, n in report["illegal"].items() if n}
    trace_b = (tmp_path / "demo-trace-B.jsonl").read_text().splitlines()
    assert any('"event":"load_failed"' in line for line in trace_b)
    dot = (tmp_path / "demo-lifecycle.dot").read_text()
    assert "preempt / bump_epoch, release_blocks\\nx" in dot
    assert f"finish ✗{report['illegal']['unknown/finish']}" in dot
    if shutil.which("dot") is not None:
        assert report["diagram"] == str(tmp_path / "demo-lifecycle.svg")
        svg = (tmp_path / "demo-lifecycle.svg").read_text()
        assert "<svg" in svg
        assert "unknown id" in svg


def test_demo_table_report(master_binary, tmp_path, capsys):
    rc = demo_main(["--requests=40", f"--out={tmp_path}", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "Requests by outcome" in text
    assert "data mismatches                       0" in text
    assert "RESULT: OK" in text


def test_soak_json_fields(master_binary, capsys):
    rc = soak.main(["--requests=60", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 60
    assert result["crashes"] == 0
    assert result["master_restarts"] == 1
    assert result["restart_after_requests"] == 20
    assert result["trackers"]["start"] == 0
    assert result["trackers"]["end"] == 0
    assert result["trackers"]["peak"] > 0
    assert result["open_jobs_end"] == 0
    assert result["leaked_blocks"] == 0
    assert result["mismatches"] == 0
    assert result["failed_checks"] == 0
    assert result["illegal"][f"unknown/{Event.FINISH.value}"] >= 1
    rss = result["rss_mb"]
    assert rss["start"] > 0
    assert rss["checkpoint"] > 0
    assert rss["end"] > 0
    assert rss["after_close"] > 0
    assert result["checkpoint_requests"] == 30
    assert isinstance(result["rss_growth_checkpoint_to_end_pct"], float)
    assert rc == (0 if result["goal_met"] else 1)


def test_python_m_demo_ends_with_its_report(master_binary, tmp_path):
    """`python -m demo` as `make demo` runs it: its status, and nothing
    after the report (the Mooncake clients' teardown at exit, after the
    demo stopped its master, logged four error lines)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    argv = ["-m", "demo", "--requests=40", f"--out={tmp_path}"]
    done = subprocess.run(
        [sys.executable, *argv, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT: OK" in done.stdout
    errors = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("E") and ".cpp:" in line
    ]
    assert errors == [], errors
