"""`lifecycle.sphinxext`: a real Sphinx build of a small project (-W)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifecycle.kv import TABLE
from lifecycle.sphinxext import (
    TableReferenceError,
    load_table,
    transition_rows,
)

ROOT = Path(__file__).resolve().parent.parent

# A connector author's own table, in its own module next to the docs.
USER_TABLE = textwrap.dedent(
    """
    import enum

    from lifecycle import Row, Table

    class S(enum.Enum):
        NEW = "new"
        SAVING = "saving"
        FINISHED = "finished"
        ABORTED = "aborted"

    class E(enum.StrEnum):
        ALLOC_LOCAL = "alloc_local"
        SAVE_ISSUED = "save_issued"
        FINISH = "finish"
        ABORT = "abort"

    def note(tracker, data):
        pass

    def ready(tracker, data):
        return True

    TABLE = Table(
        [
            Row(S.NEW, E.ALLOC_LOCAL, S.SAVING, after=(note,)),
            Row(S.NEW, E.FINISH, S.FINISHED),
            Row(S.NEW, E.ABORT, S.ABORTED),
            Row(S.SAVING, E.FINISH, S.FINISHED, guard=ready),
            Row(S.SAVING, E.ABORT, S.ABORTED),
            {extra}
        ],
        initial=S.NEW,
        terminal=(S.FINISHED, S.ABORTED),
        total_events=(E.FINISH, E.ABORT),
        name="mine",
    )
    """
)


def _write_table(src: Path, extra_row: str = "") -> None:
    (src / "mytable.py").write_text(USER_TABLE.replace("{extra}", extra_row))


def _write_project(src: Path) -> None:
    src.mkdir(parents=True, exist_ok=True)
    _write_table(src)
    (src / "conf.py").write_text(
        "import sys, pathlib\n"
        "sys.path.insert(0, str(pathlib.Path(__file__).parent))\n"
        'project = "demo"\n'
        'extensions = ["lifecycle.sphinxext"]\n'
    )
    (src / "index.rst").write_text(
        textwrap.dedent(
            """
            Lifecycles
            ==========

            .. lifecycle-diagram:: lifecycle.kv:TABLE
               :caption: The *KV* lifecycle.

            .. lifecycle-table:: lifecycle.kv:TABLE
               :caption: KV transitions

            .. lifecycle-diagram:: mytable:TABLE
               :title: My lifecycle

            .. lifecycle-diagram:: mytable:TABLE
               :format: mermaid

            .. lifecycle-table:: mytable:TABLE
            """
        )
    )


def _build(
    src: Path, out: Path, builder: str = "html"
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            builder,
            str(src),
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _tables(page: str) -> list[list[list[str]]]:
    """Every HTML table on the page as rows of cell texts."""
    found = []
    for table in re.findall(r"<table.*?</table>", page, re.DOTALL):
        rows = []
        for row in re.findall(r"<tr.*?</tr>", table, re.DOTALL):
            cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.DOTALL)
            rows.append(
                [
                    html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                    for c in cells
                ]
            )
        found.append(rows)
    return found


def test_html_build_renders_diagrams_and_tables(tmp_path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    _write_project(src)
    done = _build(src, out)
    assert done.returncode == 0, done.stderr
    page = (out / "index.html").read_text(encoding="utf-8")

    svgs = re.findall(r"<svg\b.*?</svg>", page, re.DOTALL)
    assert len(svgs) == 2
    kv_svg, user_svg = svgs
    for state in TABLE.states:  # graphviz titles every node with its id
        assert f"<title>{state.name}</title>" in kv_svg
    assert "<title>LOADING</title>" not in user_svg
    assert "My lifecycle" in user_svg
    assert "<?xml" not in page  # the SVG prologue is stripped
    assert "The <em>KV</em> lifecycle." in page  # the caption is parsed

    assert "stateDiagram-v2" in page  # :format: mermaid

    kv_table, user_table = _tables(page)
    assert kv_table[0] == ["From", "Event", "To", "Callbacks"]
    expected = [
        [src_, event, dst, cbs or "—"]
        for src_, event, dst, cbs in transition_rows(TABLE)
    ]
    assert kv_table[1:] == expected
    assert len(expected) == len(TABLE.rows)
    assert [
        "SAVING",
        "preempt",
        "PREEMPTED",
        "bump_epoch, release_blocks",
    ] in (kv_table)
    assert user_table[0] == ["From", "Event", "To", "Callbacks", "Guard"]
    assert ["NEW", "alloc_local", "SAVING", "note", "—"] in user_table
    assert ["SAVING", "finish", "FINISHED", "—", "ready"] in user_table
    assert [r[:3] for r in user_table[1:]] == [
        ["NEW", "abort", "ABORTED"],
        ["NEW", "alloc_local", "SAVING"],
        ["NEW", "finish", "FINISHED"],
        ["SAVING", "abort", "ABORTED"],
        ["SAVING", "finish", "FINISHED"],
    ]


def test_incremental_build_redraws_when_the_table_changes(tmp_path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    _write_project(src)
    assert _build(src, out).returncode == 0
    before = (out / "index.html").read_text(encoding="utf-8")
    assert "save_issued" not in _user_part(before)

    # Only the table's module changes, not the .rst: the page must follow.
    _write_table(src, "Row(S.SAVING, E.SAVE_ISSUED, S.SAVING),")
    mtime = (src / "mytable.py").stat().st_mtime + 5
    os.utime(src / "mytable.py", (mtime, mtime))
    done = _build(src, out)
    assert done.returncode == 0, done.stderr
    after = (out / "index.html").read_text(encoding="utf-8")
    assert "save_issued" in _user_part(after)


def _user_part(page: str) -> str:
    """The page after the KV table's diagram and table."""
    return page.split("My lifecycle", 1)[1]


def test_text_builder_shows_the_dot_source(tmp_path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    _write_project(src)
    done = _build(src, out, "text")
    assert done.returncode == 0, done.stderr
    text = (out / "index.txt").read_text(encoding="utf-8")
    assert "digraph lifecycle {" in text
    assert "<svg" not in text


@pytest.mark.parametrize(
    ("reference", "reason"),
    [
        ("lifecycle.kv", "expected MODULE:NAME"),
        ("no_such_module_xyz:TABLE", "cannot import no_such_module_xyz"),
        ("lifecycle.kv:NOPE", "has no attribute NOPE"),
        ("lifecycle.kv:TRANSITIONS", "tuple is not a lifecycle Table"),
    ],
)
def test_bad_reference_fails_the_build_naming_it(
    tmp_path, reference, reason
) -> None:
    with pytest.raises(TableReferenceError) as info:
        load_table(reference)
    assert info.value.reference == reference
    assert reason in info.value.reason

    src, out = tmp_path / "src", tmp_path / "out"
    _write_project(src)
    (src / "index.rst").write_text(
        f"Bad\n===\n\n.. lifecycle-diagram:: {reference}\n"
    )
    done = _build(src, out)
    assert done.returncode != 0
    assert reference in done.stderr
    assert reason in done.stderr
