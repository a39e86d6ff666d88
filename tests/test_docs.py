"""The docs site: built with -W, diagrams drawn, config reference generated."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from connector.config import (
    VLLM_BUILT_IN_KEYS,
    VLLM_UNIMPLEMENTED_KEYS,
    IdentityConfig,
    LookupConfig,
    StoreConfig,
    TraceConfig,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

from configref import attribute_docs, config_rows  # noqa: E402


def _sphinx(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-E",
            "-b",
            "html",
            str(src),
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    done = _sphinx(ROOT / "docs", out)
    assert done.returncode == 0, done.stderr
    return out


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _rows(page: str, caption: str) -> list[list[str]]:
    """Body rows of the HTML table whose caption contains `caption`."""
    for table in re.findall(r"<table.*?</table>", page, re.DOTALL):
        cap = re.search(r"<caption.*?</caption>", table, re.DOTALL)
        if cap and caption in _text(cap.group(0)):
            body = re.search(r"<tbody>.*?</tbody>", table, re.DOTALL)
            assert body is not None
            return [
                [
                    " ".join(_text(c).split())
                    for c in re.findall(r"<td.*?</td>", row, re.DOTALL)
                ]
                for row in re.findall(r"<tr.*?</tr>", body.group(0), re.DOTALL)
            ]
    msg = f"no table captioned {caption!r}"
    raise AssertionError(msg)


def test_lifecycle_page_contains_the_rendered_diagrams(site) -> None:
    from connector.scheduler.admission import LOOKUPS  # noqa: PLC0415
    from lifecycle.kv import TABLE  # noqa: PLC0415
    from lifecycle.pd import CONSUMER, PRODUCER  # noqa: PLC0415

    page = (site / "lifecycles.html").read_text(encoding="utf-8")
    svg = re.search(r"<svg\b.*?</svg>", page, re.DOTALL)
    assert svg is not None
    for state in TABLE.states:
        assert f"<title>{state.name}</title>" in svg.group(0)
    rows = _rows(page, "Every transition of lifecycle.kv:TABLE")
    assert len(rows) == len(TABLE.rows)
    svgs = re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)
    # The KV table, the admission lookup, the P/D producer and consumer.
    assert len(svgs) == 4
    shown = (LOOKUPS, PRODUCER, CONSUMER)
    for table, svg_text in zip(shown, svgs[1:], strict=True):
        for state in table.states:
            assert f"<title>{state.name}</title>" in svg_text
        assert table.title in svg_text
    rows = _rows(page, "Every transition of connector.scheduler.admission")
    assert len(rows) == len(LOOKUPS.rows)


def test_configuration_reference_is_generated_from_the_fields(site) -> None:
    page = (site / "configuration.html").read_text(encoding="utf-8")
    rows = _rows(page, "connector.config.StoreConfig")
    fields = attrs.fields(StoreConfig)
    assert [r[0] for r in rows] == [f.name for f in fields]
    docs = {f.name: f.metadata["doc"] for f in fields}
    for row, field in zip(rows, fields, strict=True):
        if field.default is attrs.NOTHING:
            assert row[2] == "required"
        else:
            assert row[2].startswith(json.dumps(field.default))
        assert row[3] == " ".join(_text(docs[field.name]).split()).replace(
            "``", ""
        )
        assert row[3]
    by_key = {r[0]: r for r in rows}
    assert by_key["global_segment_size"][2] == '4294967296 ("4GiB")'
    assert by_key["protocol"][1:3] == ["str", '"rdma"']
    assert by_key["log_level"][1:3] == ["str | None", "null"]

    trace = _rows(page, "connector.config.TraceConfig")
    assert [r[0] for r in trace] == [
        "lifecycle_trace",
        "lifecycle_trace_max_events",
    ]
    assert trace[1][2] == str(TraceConfig().max_events)

    lookup = _rows(page, "connector.config.LookupConfig")
    assert [r[0] for r in lookup] == [
        "lookup_timeout_ms",
        "lookup_max_pending",
        "failed_load_ttl_s",
        "lookup_wait_ms",
    ]
    assert lookup[2][1:3] == ["float", "15.0"]
    assert lookup[3][1:3] == ["float", "0.0"]
    identity = _rows(page, "connector.config.IdentityConfig")
    assert [r[0] for r in identity] == ["weights_version"]
    for cls, table in (
        (TraceConfig, trace),
        (LookupConfig, lookup),
        (IdentityConfig, identity),
    ):
        for row, field in zip(table, attrs.fields(cls), strict=True):
            doc = " ".join(_text(field.metadata["doc"]).split())
            assert row[3] == doc.replace("``", "")
    listed = re.findall(r'<p class="config-keys">(.*?)</p>', page, re.DOTALL)
    assert [
        re.findall(r"<span class=\"pre\">(\w+)</span>", keys)
        for keys in listed
    ] == [sorted(VLLM_UNIMPLEMENTED_KEYS), sorted(VLLM_BUILT_IN_KEYS)]


def test_tensor_parallel_keys_are_documented(site) -> None:
    """The four TP keys: a generated table, each row its field's help."""
    from connector.config import ParallelKVConfig  # noqa: PLC0415

    page = (site / "configuration.html").read_text(encoding="utf-8")
    rows = _rows(page, "connector.config.ParallelKVConfig")
    fields = attrs.fields(ParallelKVConfig)
    assert [r[0] for r in rows] == [f.name for f in fields]
    for row, field in zip(rows, fields, strict=True):
        doc = " ".join(_text(field.metadata["doc"]).split())
        assert row[3] == doc.replace("``", "")


def test_api_reference_documents_the_public_names(site) -> None:
    page = _text((site / "api.html").read_text(encoding="utf-8"))
    for name in (
        "LifecycleMachine",
        "Registry",
        "Table",
        "Outcome",
        "fire_outcome",
        "atomic",
        "expected_refusals",
        "retire_at",
        "MooncakeLifecycleConnector",
        "StoreConfig",
        "parse_size",
    ):
        assert name in page


def test_operators_guide_names_the_connector_by_plugin(site) -> None:
    page = _text((site / "operators.html").read_text(encoding="utf-8"))
    assert '"kv_connector": "MooncakeLifecycleConnector"' in page
    assert "kv_connector_module_path" not in page
    assert "kv-lifecycle master" in page
    assert "histogram_quantile" in page


def test_failure_modes_page_is_part_of_the_site(site) -> None:
    page = _text(
        (site / "operators" / "failure-modes.html").read_text(encoding="utf-8")
    )
    for heading in (
        "A peer instance dies",
        "The master dies or hangs",
        "The store fills up",
    ):
        assert heading in page
    assert "vllm:kv_lifecycle_store_failed_keys_total" in page
    index = (site / "index.html").read_text(encoding="utf-8")
    assert "operators/failure-modes.html" in index


def test_attribute_docs_reads_google_style_sections() -> None:
    @attrs.define
    class Example:
        """Summary.

        Attributes:
            first: One line.
            second (int): Two
                lines.

        Note:
            Not an attribute: ignored.
        """

        first: int = 1
        second: int = 2

    assert attribute_docs(Example) == {
        "first": "One line.",
        "second": "Two lines.",
    }
    assert config_rows(Example, {"first": "renamed"})[0] == (
        "renamed",
        "int",
        "1",
        "One line.",
    )


def test_an_undocumented_field_fails_the_build(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        "import sys, pathlib\n"
        "here = pathlib.Path(__file__).parent\n"
        f"sys.path[:0] = [str(here), {str(ROOT / 'docs' / '_ext')!r}]\n"
        'extensions = ["configref"]\n'
    )
    (src / "mycfg.py").write_text(
        textwrap.dedent(
            '''
            import attrs

            @attrs.define
            class Config:
                """Settings.

                Attributes:
                    documented: Has a meaning.
                """

                documented: int = 1
                forgotten: int = attrs.field(default=2)
            '''
        )
    )
    (src / "index.rst").write_text(
        "Config\n======\n\n.. config-fields:: mycfg:Config\n"
    )
    done = _sphinx(src, tmp_path / "out")
    assert done.returncode != 0
    assert "mycfg:Config.forgotten has no documentation" in done.stderr


def test_define_your_own_shows_the_spill_pool_example(site) -> None:
    from examples.spill_pool import CHUNKS, READS  # noqa: PLC0415

    page = (site / "define-your-own.html").read_text(encoding="utf-8")
    svgs = re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)
    for table in (CHUNKS, READS):
        (svg,) = [s for s in svgs if table.title in s]
        for state in table.states:
            assert f"<title>{state.name}</title>" in svg
    text = " ".join(_text(page).split())
    assert "spill (declined)" in text  # the expected refusal, drawn
    assert "Expected refusals (declined, the state stays): RAM drop" in text
    # The example's code is on the page, from the file the tests run.
    assert "class SpillPool" in text
    assert "with atomic(*self.machines):" in text
    # Point 8: the set-up signature, pinned(), key= and data=, INFO.
    assert "def pinned(readers: int)" in text
    assert "def setup(tracker: YourTracker, row: Row[S, E, D])" in text
    assert "key=7" in text
    assert "data=" in text
    assert "at INFO" in text
    assert "retire_at" in text
    assert "thread_safe=False" in text
