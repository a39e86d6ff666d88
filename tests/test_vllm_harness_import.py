"""The vLLM harness module imports where vLLM is absent."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_harness_imports_without_vllm():
    """Importing the harness touches neither vLLM nor torch."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "import harness\n"
        "import harness.scheduler as h\n"
        "assert harness.Harness is h.Harness\n"
        "assert not h.vllm_available()\n"
        "assert 'torch' not in sys.modules\n"
        "print(h.Harness.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Harness"
