"""`python -m benchmarks.gpu_transfer --json` is ready for a device run.

On CPU (``--cpu``: the same staged code over host tensors) the row holds
the per-phase breakdown of both paths; with no CUDA device the plain run
prints ``device: null``.  Shapes and consistency only, never speed.
"""

import json

import pytest

from benchmarks import gpu_transfer

pytestmark = pytest.mark.mooncake

PHASES = {
    "save": ["device_gather", "d2h", "put"],
    "load": ["get", "h2d", "device_scatter"],
}


def test_cpu_row_breaks_both_paths_down(capsys, master_binary):
    argv = ["--json", "--cpu", "--blocks", "2", "--reps", "1"]
    assert gpu_transfer.main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["loaded_bytes_equal_saved"] is True
    for path, names in PHASES.items():
        phases = row["phases"][path]
        assert list(phases) == names
        assert all(p["ms"] > 0 and p["gbps"] > 0 for p in phases.values())
        assert sum(p["share"] for p in phases.values()) == pytest.approx(
            1.0, abs=0.01
        )


def test_no_device_prints_a_null_row(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_transfer.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] is None
