"""Every module of `lifecycle` and `connector` imports on this Python.

Run by the Python matrix too (scripts/pymatrix.sh): there the modules
whose tests need torch or vLLM are still imported, so a module that
breaks on 3.12 or 3.13 at import time fails here even when its tests are
skipped.  Only a package the matrix venv lacks (KV_PYMATRIX) may stop an
import, and only in the vLLM glue (torch is imported where a tensor is
first touched).  A fresh interpreter imports them, with our own
deprecation warnings as errors (what the next Python removes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import importlib, json, pkgutil, sys, warnings

warnings.filterwarnings(
    "error", category=DeprecationWarning, module=r"(lifecycle|connector)(\.|$)"
)
absent = set(sys.argv[1].split(",")) - {""}
import lifecycle, connector

names, stopped = [], {}
for package in (lifecycle, connector):
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        names.append(m.name)
        try:
            importlib.import_module(m.name)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").partition(".")[0]
            if root not in absent:
                raise
            stopped[m.name] = root
print(json.dumps({"names": names, "stopped": stopped}))
"""


def test_every_module_imports_on_this_python() -> None:
    absent = os.environ.get("KV_PYMATRIX", "")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, absent],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    names, stopped = result["names"], result["stopped"]
    assert len(names) > 50, names
    assert {"lifecycle.kv", "connector.worker.transfer"} <= set(names)
    if not absent:
        assert stopped == {}
    for name, root in stopped.items():
        assert root == "vllm", (name, root)
        assert name.startswith("connector.integration."), name
