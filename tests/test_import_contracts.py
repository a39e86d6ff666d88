"""The layering contracts in pyproject.toml hold, and catch a breach.

import-linter (pinned in requirements/base.txt) reads
`[tool.importlinter]`: `lifecycle` imports none of torch, vLLM, Mooncake
or `connector`; the connector's scheduler, worker, transfer and metadata
modules import no vLLM; the runtime packages import no tests, demo,
benchmarks, e2e or harness code.  `make imports` (part of `make test`)
runs the same command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = (
    "lifecycle is generic: no torch, vLLM, Mooncake or connector",
    "the connector's lifecycle core imports no vLLM",
    "runtime packages import no test, demo, benchmark or harness code",
)


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_repository_keeps_every_contract():
    done = _lint_imports(ROOT)

    assert done.returncode == 0, done.stdout + done.stderr
    for name in CONTRACTS:
        assert f"{name} KEPT" in done.stdout


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "pyproject.toml", root)
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("lifecycle", "connector"):
        shutil.copytree(ROOT / package, root / package, ignore=ignore)
    return root


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + line + "\n")


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("lifecycle/table.py", "import torch", CONTRACTS[0]),
        ("lifecycle/machine.py", "import connector.store.keys", CONTRACTS[0]),
        ("connector/metadata.py", "import vllm", CONTRACTS[1]),
        # Indirect: the scheduler reaches vLLM through a module it imports.
        (
            "connector/scheduler/failed_keys.py",
            "import vllm.config",
            CONTRACTS[1],
        ),
        ("connector/store.py", "import harness", CONTRACTS[2]),
        (
            "lifecycle/kv.py",
            "from tests import connector_helpers",
            CONTRACTS[2],
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path, module, line, contract
):
    root = _copy_tree(tmp_path)
    target = root / module
    if not target.exists():  # a module that became a package
        target = target.with_suffix("") / "__init__.py"
    _append(target, line)

    done = _lint_imports(root)

    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{contract} BROKEN" in done.stdout
    kept = [name for name in CONTRACTS if name != contract]
    for name in kept:
        assert f"{name} KEPT" in done.stdout
