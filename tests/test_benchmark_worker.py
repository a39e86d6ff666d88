"""`python -m benchmarks.worker --json` runs and prints a sane document."""

from __future__ import annotations

import json

import pytest

from benchmarks import worker as bench

pytestmark = pytest.mark.mooncake


def test_worker_benchmark_prints_json(master_binary, capsys):
    assert bench.main(["--json", "--reps", "1", "--segment-mib", "128"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["block_bytes"], r["batch"]) for r in doc["rows"]] == bench.ROWS
    for row in doc["rows"]:
        assert set(row["median_ms"]) == {
            f"{v}_{k}" for v in bench.VARIANTS for k in ("load", "save")
        }
        assert all(ms > 0 for ms in row["median_ms"].values())
        for v in ("worker", "staged"):
            for k in ("load", "save"):
                ratio = row[f"{v}_{k}_ratio"]
                want = (
                    row["median_ms"][f"{v}_{k}"]
                    / row["median_ms"][f"store_{k}"]
                )
                assert ratio == pytest.approx(want, rel=0.01, abs=0.002)
