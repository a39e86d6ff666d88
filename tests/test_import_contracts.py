"""The layering contracts in pyproject.toml hold, and catch a breach.

import-linter (pinned in requirements/base.txt) reads
`[tool.importlinter]`: `lifecycle` imports none of torch, vLLM, Mooncake
or `connector`; the connector's roles keep apart (only
`connector.integration` imports vLLM; `connector.scheduler` and
`connector.worker` never import each other; the worker's modules
import one way: side > shards > lanes > transfer > deadline > pieces;
`connector.store` imports neither side, the glue nor `connector.ops`;
`connector.ops` imports neither side; the shared modules import no
role); the runtime packages import no tests, demo, benchmarks, e2e or
harness code.  `make imports` (part of `make test`) runs the same
command.  Each contract is broken on purpose below, in a copy of the
packages.
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
    "only the vLLM glue (connector.integration) imports vLLM",
    "the scheduler side and the worker side never import each other",
    "the worker side's modules import one way",
    "the store imports neither side, the glue nor tooling",
    "operator tooling imports neither side",
    "shared connector modules import no role",
    "runtime packages import no test, demo, benchmark or harness code",
)
(
    GENERIC,
    VLLM_GLUE,
    SIDES_APART,
    WORKER_ONE_WAY,
    STORE_BELOW,
    OPS_APART,
    SHARED_BELOW,
    NO_TEST_CODE,
) = CONTRACTS


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


#: (module, the line appended to it, the contract it breaks).
BREACHES = [
    ("lifecycle/table.py", "import torch", GENERIC),
    ("lifecycle/machine.py", "import connector.metadata", GENERIC),
    ("connector/metadata.py", "import vllm", VLLM_GLUE),
    # Indirect: the scheduler reaches vLLM through a module it imports.
    (
        "connector/scheduler/failed_keys.py",
        "import vllm.config",
        VLLM_GLUE,
    ),
    ("connector/store/keys.py", "import vllm", VLLM_GLUE),
    ("connector/ops/master.py", "import vllm", VLLM_GLUE),
    (
        "connector/scheduler/jobs.py",
        "import connector.worker.lanes",
        SIDES_APART,
    ),
    (
        "connector/worker/transfer.py",
        "from connector.scheduler import failed_keys",
        SIDES_APART,
    ),
    # The circle the worker had: a transfer reaching up to head shards,
    # deadlines up to transfers, lanes up to shards.
    (
        "connector/worker/transfer.py",
        "from connector.worker.shards import head_pieces",
        WORKER_ONE_WAY,
    ),
    (
        "connector/worker/deadline.py",
        "from connector.worker.transfer import Staged",
        WORKER_ONE_WAY,
    ),
    (
        "connector/worker/lanes.py",
        "import connector.worker.shards",
        WORKER_ONE_WAY,
    ),
    ("connector/store/keys.py", "import connector.scheduler", STORE_BELOW),
    (
        "connector/store/client.py",
        "import connector.integration.stats",
        STORE_BELOW,
    ),
    ("connector/store/batch.py", "import connector.ops.master", STORE_BELOW),
    ("connector/ops/master.py", "import connector.worker.side", OPS_APART),
    ("connector/ops/cli.py", "import connector.scheduler.jobs", OPS_APART),
    ("connector/metadata.py", "import connector.store", SHARED_BELOW),
    ("connector/groups.py", "import connector.ops.master", SHARED_BELOW),
    ("connector/store/client.py", "import harness", NO_TEST_CODE),
    (
        "lifecycle/kv.py",
        "from tests import connector_helpers",
        NO_TEST_CODE,
    ),
]
#: Breaches that break a second contract too, by design: the store
#: reaching the glue reaches vLLM as well.
ALSO_BROKEN = {
    ("connector/store/client.py", "import connector.integration.stats"): (
        VLLM_GLUE,
    ),
}


def test_every_contract_is_broken_on_purpose():
    assert {contract for _, _, contract in BREACHES} == set(CONTRACTS)


@pytest.mark.parametrize(("module", "line", "contract"), BREACHES)
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
    also = ALSO_BROKEN.get((module, line), ())
    kept = [
        name for name in CONTRACTS if name != contract and name not in also
    ]
    for name in kept:
        assert f"{name} KEPT" in done.stdout
    for name in also:
        assert f"{name} BROKEN" in done.stdout
