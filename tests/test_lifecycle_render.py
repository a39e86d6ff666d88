"""Diagrams are generated from the table, deterministic and fresh."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle import render
from lifecycle.kv import TABLE, Event, State

ROOT = Path(__file__).resolve().parent.parent
DIAGRAM_DIR = ROOT / "diagrams"


def _dot_edges(dot: str) -> set[tuple[str, str, str]]:
    edges = set()
    for src, dst, label in re.findall(
        r"^  \"(\w+)\" -> \"(\w+)\" \[label=\"([^\"]*)\"", dot, re.MULTILINE
    ):
        for part in label.split("\\n"):
            edges.add((src, part.split(" / ")[0], dst))
    return edges


def test_dot_nodes_are_states_and_edges_are_rows() -> None:
    dot = render.to_dot(TABLE)
    nodes = set(re.findall(r"^  \"(\w+)\" \[label=", dot, re.MULTILINE))
    assert nodes == {s.name for s in TABLE.states}
    assert _dot_edges(dot) == {
        (r.source.name, r.event.value, r.dest.name) for r in TABLE.rows
    }


def test_mermaid_covers_every_row() -> None:
    mmd = render.to_mermaid(TABLE)
    assert mmd.startswith("stateDiagram-v2\n    [*] --> NEW\n")
    for row in TABLE.rows:
        line = next(
            ln
            for ln in mmd.splitlines()
            if ln.strip().startswith(
                f"{row.source.name} --> {row.dest.name} :"
            )
        )
        events = line.split(" : ", 1)[1].split(", ")
        assert row.event.value in events


def test_markdown_table_has_one_line_per_row() -> None:
    md = render.to_markdown(TABLE).splitlines()
    assert len(md) == 2 + len(TABLE.rows)
    assert "| PREEMPTED | `reset` | RESET | `clear_progress` |" in md


def test_output_is_deterministic() -> None:
    assert render.artifacts(TABLE) == render.artifacts(TABLE)


def test_committed_diagrams_are_fresh() -> None:
    diffs, _ = render.check(DIAGRAM_DIR, TABLE)
    assert diffs == []


def test_live_diagram_weights_and_illegal_edges() -> None:
    counts = dict.fromkeys(TABLE.rows, 0)
    counts[TABLE.rows[0]] = 9
    dot = render.to_dot(
        TABLE,
        counts=counts,
        illegal={(State.FINISHED, Event.FINISH): 2, (None, Event.ABORT): 1},
    )
    assert "lookup\\nlookup_done\\nx9" in dot  # NEW -> NEW edge
    assert "penwidth=6.00" in dot
    assert '"FINISHED" -> "FINISHED" [label="finish ✗2", style=dashed' in dot
    assert '"__unknown" -> "__unknown"' in dot


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lifecycle", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_check_cli_passes_then_fails_after_a_hand_edit(tmp_path) -> None:
    out = tmp_path / "diagrams"
    assert _cli("render", "--out", str(out)).returncode == 0
    ok = _cli("render", "--check", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    dot = out / "lifecycle.dot"
    dot.write_text(
        dot.read_text().replace('"SAVING" -> "PREEMPTED"', '"SAVING" -> "NEW"')
    )
    stale = _cli("render", "--check", "--out", str(out))
    assert stale.returncode == 1
    assert '-  "SAVING" -> "NEW"' in stale.stderr
    assert '+  "SAVING" -> "PREEMPTED"' in stale.stderr
    assert "stale" in stale.stderr


def test_out_defaults_to_a_diagrams_folder_then_the_working_directory(
    tmp_path,
) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(
            [sys.executable, "-m", "lifecycle", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    assert cli("render").returncode == 0
    assert (tmp_path / "lifecycle.dot").is_file()
    (tmp_path / "diagrams").mkdir()
    assert cli("render").returncode == 0
    assert (tmp_path / "diagrams" / "lifecycle.dot").is_file()
    ok = cli("render", "--check")
    assert ok.returncode == 0, ok.stderr
    assert "diagrams in diagrams are up to date" in ok.stdout
    assert ROOT.joinpath("diagrams").is_dir()
    assert _cli("render", "--check").returncode == 0  # the repository's


@pytest.mark.skipif(shutil.which("dot") is None, reason="no graphviz `dot`")
def test_svg_is_rendered_and_checked(tmp_path) -> None:
    out = tmp_path / "d"
    render.write(out, TABLE)
    svg = (out / "lifecycle.svg").read_text()
    assert svg.lstrip().startswith("<?xml")
    assert all(s.name in svg for s in TABLE.states)
    edited = svg.replace("<title>PREEMPTED</title>", "<title>X</title>")
    assert edited != svg
    (out / "lifecycle.svg").write_text(edited)
    diffs, skipped = render.check(out, TABLE)
    assert skipped == []
    assert len(diffs) == 1
    assert "lifecycle.svg" in diffs[0]


def test_table_cli_prints_markdown() -> None:
    done = _cli("table")
    assert done.returncode == 0
    assert done.stdout == render.to_markdown(TABLE)
