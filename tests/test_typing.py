"""The typing suite: `mypy --strict` over tests/typing/, one run.

Every ``*.py`` in tests/typing/ is checked.  A line that ends with
``  # E: <text>`` (two spaces before, as any inline comment) must get
a mypy error containing ``<text>`` (several markers on one line: one
error each); every other line must get none.
Files without markers hold ``assert_type`` checks, so they fail when an
inferred type changes (e.g. to ``Any``), not only when misuse passes.

The README's "Define your own lifecycle" block is checked too, as written
and followed by `assert_type` lines (README_CHECKS): the documented path
must keep its types, not merely type-check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.test_readme import _own_lifecycle_block

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "typing"
MARK = re.compile(r"(?<=\S)  # E: ")
ERROR = re.compile(r"^(?P<path>[^:]+\.py):(?P<line>\d+): error: (?P<msg>.*)$")

# Appended to the README's own example (its names, unannotated).
README_CHECKS = """
from collections.abc import Hashable
from typing import assert_type

assert_type(TABLE, Table[PState, PEvent, object, PTracker])
assert_type(machine, LifecycleMachine[PState, PEvent, PTracker, object])
assert_type(registry, Registry[PState, PEvent, PTracker, object])
assert_type(tracker, PTracker)
assert_type(strict.table, Table[PState, PEvent, object, PTracker])
registry.fire("req-1", "finish")  # E: type "str"; expected "PEvent"
registry.fire_on(tracker, 1)  # E: incompatible type "int"; expected "PEvent"
"""


def expected_errors(path: Path) -> dict[int, list[str]]:
    """The ``# E:`` markers of `path`, by line number."""
    found: dict[int, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        parts = MARK.split(line)
        if len(parts) > 1:
            found[number] = [p.strip() for p in parts[1:]]
    return found


def mypy_errors(modules: list[str], extra: Path | None = None) -> tuple:
    """mypy --strict's errors over `modules`, by (file name, line).

    Modules, not files: mypy then reports the errors of the helper
    modules the cases import (tests/user_lifecycle.py, ...) too.  `extra`
    is a folder of further modules (on MYPYPATH).
    """
    env = dict(os.environ)
    if extra is not None:
        env["MYPYPATH"] = str(extra)
    args = [a for m in modules for a in ("-m", m)]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode in {0, 1}, done.stdout + done.stderr
    errors: dict[tuple[str, int], list[str]] = {}
    for line in done.stdout.splitlines():
        m = ERROR.match(line)
        if m:
            key = (Path(m["path"]).name, int(m["line"]))
            errors.setdefault(key, []).append(m["msg"])
    return errors, done.stdout


def mismatches(files: list[Path], errors: dict) -> list[str]:
    """Where mypy's errors and the files' markers disagree."""
    problems = []
    expected = {
        (f.name, n): marks
        for f in files
        for n, marks in expected_errors(f).items()
    }
    for key in sorted(set(errors) | set(expected)):
        got, want = errors.get(key, []), expected.get(key, [])
        name, line = key
        if not want:
            problems.append(f"{name}:{line}: unexpected error: {got}")
        elif not got:
            problems.append(f"{name}:{line}: no error, expected {want}")
        elif len(got) != len(want) or not all(
            any(w in g for g in got) for w in want
        ):
            problems.append(f"{name}:{line}: got {got}, expected {want}")
    return problems


HELPERS = ["tests.user_lifecycle", "tests.docpath_lifecycle"]


def test_typing_suite(tmp_path) -> None:
    readme = tmp_path / "readme_define_your_own.py"
    readme.write_text(_own_lifecycle_block() + README_CHECKS)
    files = sorted(CASES.glob("*.py"))
    assert len(files) >= 5, files
    modules = [f"tests.typing.{f.stem}" for f in files]
    errors, out = mypy_errors(
        [*HELPERS, *modules, readme.stem], extra=tmp_path
    )
    helpers = [ROOT / (m.replace(".", "/") + ".py") for m in HELPERS]
    problems = mismatches([*helpers, *files, readme], errors)
    assert not problems, "\n".join(problems) + "\n\nmypy said:\n" + out


def test_markers_are_checked(tmp_path) -> None:
    """The comparison itself fails on a missing or an unexpected error."""
    case = tmp_path / "case.py"
    case.write_text(
        "x: int = 1\n"
        'y: int = ""  # E: Incompatible types in assignment\n'
        "z: int = 2  # E: never raised\n"
        "w: str = 3\n"
    )
    errors, _ = mypy_errors(["case"], extra=tmp_path)
    problems = mismatches([case], errors)
    assert problems == [
        "case.py:3: no error, expected ['never raised']",
        (
            "case.py:4: unexpected error: ['Incompatible types in assignment "
            '(expression has type "int", variable has type "str")  '
            "[assignment]']"
        ),
    ]
