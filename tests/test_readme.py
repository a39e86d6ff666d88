"""The README (a front page) and the docs pages its content moved to.

The README keeps the two set-up commands at the top, one example of each
part and links; the examples and references it used to hold live in
``docs/guide-lifecycle.md`` and ``docs/connector.md``, and run as written
there.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from lifecycle.kv import TABLE
from lifecycle.render import to_markdown

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"
LIBRARY = DOCS / "guide-lifecycle.md"
CONNECTOR = DOCS / "connector.md"


def _blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    lines = text.splitlines()
    # The two set-up commands first, exactly.
    assert lines[:5] == [
        "# kv-lifecycle",
        "",
        "```bash",
        "make demo   # bootstraps apt packages + .venv, then runs the demo",
        (
            "make test   # bootstraps, then ruff, mypy --strict, diagram "
            "freshness and the whole suite"
        ),
    ]
    assert lines[5] == "```"
    assert len(lines) < 120
    # Every link to a file points at one that exists.
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert len(links) >= 8
    for link in links:
        assert (README.parent / link).exists(), link
    for page in ("guide-lifecycle", "connector", "demo", "performance"):
        assert f"(docs/{page}.md)" in text
    assert "setups=" in text
    assert "key=" in text
    assert "editable_mode=compat" in text


def test_lifecycle_example_runs() -> None:
    (block,) = [
        b
        for b in _blocks()
        if "registry = Registry" in b
        and "trace" not in b
        and "PTracker" not in b
    ]
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["tracker"].state.name == "FINISHED"


def test_library_page_table_matches_the_generated_one() -> None:
    assert to_markdown(TABLE) in LIBRARY.read_text()


def test_library_page_documents_the_generated_tests_options() -> None:
    section = _section("Generated tests for your connector", LIBRARY)
    for needle in ("setups=", "key=", "data=", "(tracker, row) -> data"):
        assert needle in section, needle
    assert "at INFO" in _section(
        "Illegal orderings, strict mode and stale completions", LIBRARY
    )


def _section(title: str, page: Path = CONNECTOR) -> str:
    text = page.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _table(section: str) -> dict[str, list[str]]:
    """First-column key (backticks stripped) -> the other cells."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 1:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_trace_example_runs_and_prints_what_the_readme_shows(
    tmp_path, monkeypatch
) -> None:
    from lifecycle.trace import replay_file  # noqa: PLC0415

    (block,) = [b for b in _blocks(LIBRARY) if "TraceWriter.open" in b]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(block, str(LIBRARY), "exec"), namespace)  # noqa: S102
    shown = re.search(
        r"```\n(\d+ events.*?)```", LIBRARY.read_text(), re.DOTALL
    )
    assert shown is not None
    assert replay_file(tmp_path / "trace.jsonl").render() == shown.group(1)


def test_configuration_reference_lists_every_key_with_its_default() -> None:
    import attrs  # noqa: PLC0415

    from connector.config import (  # noqa: PLC0415
        EventsConfig,
        IdentityConfig,
        LoadConfig,
        LookupConfig,
        ParallelKVConfig,
        StoreConfig,
        TraceConfig,
        parse_size,
    )

    rows = _table(_section("Configuration reference"))
    expected: dict[str, object] = {
        f.name: f.default for f in attrs.fields(StoreConfig)
    }
    trace = TraceConfig()
    expected["lifecycle_trace"] = trace.path
    expected["lifecycle_trace_max_events"] = trace.max_events
    lookups = LookupConfig()
    expected["lookup_timeout_ms"] = lookups.timeout_ms
    expected["lookup_max_pending"] = lookups.max_pending
    expected["failed_load_ttl_s"] = lookups.failed_load_ttl_s
    expected["lookup_wait_ms"] = lookups.wait_ms
    expected["weights_version"] = IdentityConfig().weights_version
    for field in attrs.fields(LoadConfig):
        expected[field.name] = field.default
    for field in attrs.fields(ParallelKVConfig):
        expected[field.name] = field.default
    expected["kv_events_medium"] = EventsConfig().medium
    assert set(rows) == set(expected)
    for key, (default, meaning) in rows.items():
        assert meaning
        cell = default.strip("`")
        want = expected[key]
        if want is attrs.NOTHING:
            assert cell == "required", key
        elif cell == "null":
            assert want is None, key
        elif cell.startswith('"') or cell in {"true", "false"}:
            assert json.loads(cell) == want, key
        elif cell in {"true", "false"}:
            assert json.loads(cell) is want, key
        elif cell.startswith("["):
            assert tuple(json.loads(cell)) == want, key
        else:
            assert parse_size(key, cell) == want, key


def test_configuration_reference_is_generated_from_the_fields() -> None:
    """The connector page's table is ``readme_table()`` of
    docs/_ext/configref.py: edit the fields, then paste
    ``python docs/_ext/configref.py``."""
    sys.path.insert(0, str(README.parent / "docs" / "_ext"))
    from configref import readme_table  # noqa: PLC0415

    assert readme_table() in _section("Configuration reference")


def test_vllm_serve_example_is_a_valid_connector_config() -> None:
    from connector.config import StoreConfig, TraceConfig  # noqa: PLC0415
    from connector.integration.plugin import CONNECTOR_NAME  # noqa: PLC0415

    match = re.search(
        r"--kv-transfer-config '(\{.*?\})'", README.read_text(), re.DOTALL
    )
    assert match is not None
    config = json.loads(match.group(1))
    assert config["kv_connector"] == "MooncakeLifecycleConnector"
    assert config["kv_connector"] == CONNECTOR_NAME  # the plugin's name
    assert "kv_connector_module_path" not in config
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_role"] in {"kv_producer", "kv_consumer", "kv_both"}
    extra = config["kv_connector_extra_config"]
    store = StoreConfig.from_extra_config(extra)
    assert store.master_server_address == extra["master_server_address"]
    assert TraceConfig.from_extra_config(extra).path is None


def test_metrics_table_names_the_exported_metrics() -> None:
    pytest.importorskip("vllm")
    from connector.integration.stats import MetricName  # noqa: PLC0415

    names = {v for k, v in vars(MetricName).items() if not k.startswith("_")}
    assert set(_table(_section("Metrics"))) == names


def _own_lifecycle_block() -> str:
    (block,) = [b for b in _blocks(LIBRARY) if "class PTracker" in b]
    return block


def test_define_your_own_lifecycle_example_runs() -> None:
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(_own_lifecycle_block(), str(LIBRARY), "exec"), namespace)  # noqa: S102
    assert namespace["tracker"].state.name == "DONE"
    assert '"SENDING" -> "DONE"' in namespace["dot"]


def test_define_your_own_lifecycle_example_type_checks(tmp_path) -> None:
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    example = tmp_path / "readme_example.py"
    example.write_text(_own_lifecycle_block())
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(example),
        ],
        cwd=README.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout
