"""Importing `lifecycle` loads no torch, mooncake, vllm or connector.

The static rule (no such import anywhere in `lifecycle/`, even inside a
function) is an import-linter contract: tests/test_import_contracts.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_importing_lifecycle_loads_no_heavy_module() -> None:
    code = textwrap.dedent(
        """
        import sys, lifecycle, lifecycle.testing, lifecycle.render
        heavy = [m for m in sys.modules
                 if m.split('.')[0] in ('torch', 'mooncake', 'vllm',
                                        'connector')]
        print(heavy)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_misspelled_event_is_a_type_error(tmp_path) -> None:
    """`mypy --strict` rejects an event that the table does not define."""
    good = tmp_path / "good.py"
    good.write_text(
        "from lifecycle import LifecycleMachine\n"
        "from lifecycle.kv import TABLE, Event, KVTracker\n"
        "LifecycleMachine(TABLE).fire(KVTracker('r'), Event.LOOKUP)\n"
    )
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from lifecycle import LifecycleMachine\n"
        "from lifecycle.kv import TABLE, Event, KVTracker\n"
        "LifecycleMachine(TABLE).fire(KVTracker('r'), Event.LOOKUPP)\n"
        "LifecycleMachine(TABLE).fire(KVTracker('r'), 'lookup')\n"
    )
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-incremental"]
    env_ok = subprocess.run(
        [*cmd, str(good)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert env_ok.returncode == 0, env_ok.stdout
    env_bad = subprocess.run(
        [*cmd, str(bad)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert env_bad.returncode == 1
    assert 'has no attribute "LOOKUPP"' in env_bad.stdout
    assert 'incompatible type "str"' in env_bad.stdout
