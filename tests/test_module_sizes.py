"""No runtime module grows into a grab-bag: each file of `lifecycle/` and
`connector/` stays at most `MAX_LINES` lines (split by concept instead)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 700
MODULES = sorted(
    p for pkg in ("lifecycle", "connector") for p in (ROOT / pkg).rglob("*.py")
)


def test_the_packages_are_found():
    assert len(MODULES) > 20


@pytest.mark.parametrize(
    "path", MODULES, ids=lambda p: str(p.relative_to(ROOT))
)
def test_module_is_small(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
