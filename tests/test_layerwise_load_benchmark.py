"""`python -m benchmarks.layerwise_load --json` runs and reports sane JSON.

A tiny prefix on a real master, read by a segmentless reader whole and
in spans of layers: every load is checked byte for byte against the
stored KV (the benchmark raises otherwise); the figures are checked for
shape only, never for speed.
"""

import json

import pytest

from benchmarks import layerwise_load

pytestmark = pytest.mark.mooncake


@pytest.mark.parametrize("shards", [1, 2])
def test_tiny_run_prints_sane_json(capsys, master_binary, shards):
    """One object per block, or two head shards read by one reader."""
    argv = ["--json", "--reps", "2", "--blocks", "4", "--layers", "4"]
    argv += ["--layer-ms", "1", "--segment-mib", "64"]
    argv += ["--shards", str(shards)]
    assert layerwise_load.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["blocks"] == 4
    assert doc["shards"] == shards
    row = doc["by_layer_ms"]["1.0"]
    assert set(row) == {*layerwise_load.MODES, "stall_ratio"}
    for mode in ("whole", "spans"):
        assert row[mode]["load_ms"] > 0
        assert row[mode]["forward_ms"] > 0
    assert row["no_load"]["forward_ms"] >= 4 * 1.0


def test_counts_must_be_positive():
    with pytest.raises(SystemExit):
        layerwise_load.main(["--blocks", "0"])
    with pytest.raises(SystemExit):
        layerwise_load.main(["--shards", "3"])  # 8 heads do not split in 3
