"""`python -m benchmarks.layerwise_save --json` runs and reports sane JSON.

A tiny prefill on a real master: every save of every set-up is checked
against the KV the forward wrote (the benchmark raises otherwise); the
figures are checked for shape only, never for speed.
"""

import json

import pytest

from benchmarks import layerwise_save

pytestmark = pytest.mark.mooncake


@pytest.mark.parametrize(
    ("heads", "shards", "groups"), [(1, 1, 1), (2, 2, 1), (1, 1, 3)]
)
def test_tiny_run_prints_sane_json(
    capsys, master_binary, heads, shards, groups
):
    """One object per block, one per head shard, or one per KV cache
    group (every object checked by the benchmark)."""
    argv = ["--json", "--reps", "2", "--tokens", "64", "--layers", "3"]
    argv += ["--kv-heads", str(heads), "--layer-ms", "1"]
    argv += ["--segment-mib", "64", "--shards", str(shards)]
    argv += ["--groups", str(groups)]
    assert layerwise_save.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["blocks"] == 4
    assert (doc["shards"], doc["groups"]) == (shards, groups)
    for key in ("forward_ms", "save_tail_ms", "tail_vs_staged"):
        assert set(doc[key]) == set(layerwise_save.VARIANTS)
        assert all(v > 0 for v in doc[key].values())
    assert doc["tail_vs_staged"]["staged"] == 1.0


def test_tokens_must_fill_blocks():
    with pytest.raises(SystemExit):
        layerwise_save.main(["--tokens", "30"])
    with pytest.raises(SystemExit):
        layerwise_save.main(["--kv-heads", "8", "--shards", "3"])
    with pytest.raises(SystemExit):
        layerwise_save.main(["--layers", "32", "--groups", "3"])
