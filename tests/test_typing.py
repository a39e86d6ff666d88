"""`mypy --strict` accepts a user's lifecycle and rejects misuse.

One mypy run over two fixtures: `typing/ok_user.py` must have no error,
`typing/bad_user.py` exactly the errors listed here, by line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OK = "tests/typing/ok_user.py"
BAD = "tests/typing/bad_user.py"

EXPECTED = {
    12: '"type[JobEvent]" has no attribute "FINSH"',
    13: 'incompatible type "Event"; expected "JobEvent"',
    14: 'Argument 2 to "fire" of "Registry" has incompatible type "str"; '
    'expected "JobEvent"',
    15: 'Argument 2 to "fire" of "Registry" has incompatible type "Event"; '
    'expected "JobEvent"',
    16: '"JobTracker" has no attribute "attemps"',
    17: 'Argument "data" to "__call__" of "_Fire" has incompatible type '
    '"str"; expected "int | None"',
    18: 'Cannot infer value of type parameter "T" of "Registry"',
    19: 'incompatible type "KVTracker"; expected '
    '"Tracker[JobState, Hashable]"',
}


def test_mypy_accepts_user_code_and_rejects_misuse(tmp_path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            OK,
            BAD,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    errors: dict[str, dict[int, str]] = {OK: {}, BAD: {}}
    for line in done.stdout.splitlines():
        m = re.match(r"(tests/typing/\w+\.py):(\d+): error: (.*)", line)
        if m:
            errors[m[1]].setdefault(int(m[2]), m[3])
    assert errors[OK] == {}, done.stdout
    assert set(errors[BAD]) == set(EXPECTED), done.stdout
    for line_no, message in EXPECTED.items():
        assert message in errors[BAD][line_no], done.stdout
