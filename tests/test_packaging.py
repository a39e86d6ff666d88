"""The wheel: metadata, and a clean venv where only the library installs.

Builds the wheel from a copy of the sources (``pip wheel --no-deps``),
checks its metadata, installs it with its declared dependencies into a
fresh venv (no system site-packages) and runs it there: ``import
lifecycle`` pulls in no torch, vLLM or Mooncake, and the console script
renders the diagrams into the working directory.
"""

import email
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "lifecycle", "connector")
HEAVY = ("torch", "vllm", "mooncake", "transformers", "numpy", "graphviz")
PIP = ("-m", "pip", "-q", "--disable-pip-version-check")


def run(argv, **kwargs):
    # A clean venv is clean only without PYTHONPATH: the Python matrix
    # sets it to the checkout, whose kv_lifecycle.egg-info (the editable
    # install) would make pip see the project as installed already and
    # the probes import the checkout instead of the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        **kwargs,
    )
    assert done.returncode == 0, (
        argv,
        done.stdout[-2000:],
        done.stderr[-4000:],
    )
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(
                path, src / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, *PIP, "wheel", "--no-deps", "-w", str(out), str(src)])
    [built] = out.glob("kv_lifecycle-*.whl")
    return built


def _read(wheel, suffix):
    with zipfile.ZipFile(wheel) as zf:
        [name] = [n for n in zf.namelist() if n.endswith(suffix)]
        return zf.read(name).decode()


def test_wheel_metadata(wheel):
    meta = email.message_from_string(_read(wheel, ".dist-info/METADATA"))
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "Typing :: Typed" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    core = sorted(r for r in requires if "extra ==" not in r)
    assert core == ["attrs>=23.1", "transitions<0.10,>=0.9.3"]
    assert not any(r.startswith(("torch", "vllm")) for r in requires)
    # SVG rendering is the `diagrams` extra, imported only when drawing.
    assert 'graphviz>=0.20; extra == "diagrams"' in requires
    assert not any("==" in r.split(";")[0] for r in requires), requires
    assert _read(wheel, "licenses/LICENSE").startswith(
        " " * 33 + "Apache License"
    )
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "kv-lifecycle = connector.ops.cli:main" in entry_points
    assert (
        "kv_lifecycle = connector.integration.plugin:register" in entry_points
    )
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {"lifecycle/py.typed", "connector/py.typed"} <= names
    assert not any(
        n.startswith(("tests/", "e2e/", "demo/", "harness/")) for n in names
    )


def _make_list(name):
    """The words of the Makefile's ``NAME := ...`` line."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{name} := (.*)$", text, re.MULTILINE)
    assert m, f"no {name} in the Makefile"
    return m[1].split()


def test_the_wheel_lists_exactly_the_tested_pythons(wheel):
    """Classifiers and Requires-Python: .venv's Python and the matrix's."""
    main = _make_list("MAIN_PYTHON")
    tested = sorted(
        {*main, *_make_list("PYMATRIX")},
        key=lambda v: tuple(map(int, v.split("."))),
    )
    meta = email.message_from_string(_read(wheel, ".dist-info/METADATA"))
    listed = [
        c.rpartition(" :: ")[2]
        for c in meta.get_all("Classifier")
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert listed == tested
    minors = [int(v.split(".")[1]) for v in tested]
    assert minors == list(range(minors[0], minors[-1] + 1)), "a gap"
    spec = SpecifierSet(meta["Requires-Python"])
    assert spec == SpecifierSet(f">=3.{minors[0]},<3.{minors[-1] + 1}")
    for minor in range(minors[0] - 2, minors[-1] + 3):
        assert (f"3.{minor}" in tested) == spec.contains(f"3.{minor}.0")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert here in tested
    if not os.environ.get("KV_PYMATRIX"):
        assert [here] == main, "the whole suite runs on MAIN_PYTHON"


@pytest.fixture(scope="module")
def clean_venv(wheel, tmp_path_factory):
    where = tmp_path_factory.mktemp("venv") / "v"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
    python = where / "bin" / "python"
    run([str(python), *PIP, "install", f"{wheel}[diagrams]"])
    return where


def test_import_lifecycle_pulls_in_no_serving_stack(clean_venv):
    probe = (
        "import json, sys\n"
        "import lifecycle, connector\n"
        "import connector.integration.plugin, connector.ops.cli\n"
        "r = connector.integration.plugin.register()\n"
        "print(json.dumps([r.name, sorted(sys.modules)]))\n"
    )
    out = run([str(clean_venv / "bin" / "python"), "-c", probe])
    registration, modules = json.loads(out)
    assert registration == "NO_VLLM"
    heavy = [m for m in modules if m.split(".")[0] in HEAVY]
    assert heavy == []


def test_console_script_renders_into_the_working_directory(
    clean_venv, tmp_path
):
    script = clean_venv / "bin" / "kv-lifecycle"
    assert script.is_file()
    out = run([str(script), "render"], cwd=tmp_path)
    assert "lifecycle.dot" in out
    dot = (tmp_path / "lifecycle.dot").read_text()
    assert dot.startswith("digraph")
    assert (tmp_path / "lifecycle.mmd").is_file()
    if shutil.which("dot") is not None:
        assert "<svg" in (tmp_path / "lifecycle.svg").read_text()
    assert "usage: kv-lifecycle master" in run([str(script), "master", "-h"])
