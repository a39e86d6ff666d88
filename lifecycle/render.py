"""Diagrams and docs generated from the table, deterministically.

Everything here is a pure function of a `Table` (and, for live diagrams,
of observed counts): never of a running machine, whose current state would
leak into the picture.  Edges are grouped per (source, dest) and sorted, so
the output is stable and diffs read well.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from lifecycle.states import Event, State
from lifecycle.table import TABLE, Row, Table

DIAGRAM_DIR: Final = Path(__file__).resolve().parent.parent / "diagrams"
STEM: Final = "lifecycle"

_TERMINAL_STYLE = 'shape=doublecircle, style=filled, fillcolor="#e8e8e8"'
_STATE_STYLE = 'shape=circle, style=filled, fillcolor="#dbeafe"'


def _state_order(table: Table) -> dict[State, int]:
    return {s: i for i, s in enumerate(table.states)}


def _grouped(table: Table) -> list[tuple[State, State, list[Row]]]:
    """Rows grouped by (source, dest), in table-state order."""
    order = _state_order(table)
    groups: dict[tuple[State, State], list[Row]] = {}
    for row in table.rows:
        groups.setdefault((row.source, row.dest), []).append(row)
    return [
        (src, dst, sorted(rows, key=lambda r: r.event.value))
        for (src, dst), rows in sorted(
            groups.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])
        )
    ]


def _label(rows: list[Row]) -> str:
    return "\\n".join(
        r.event.value + (f" / {', '.join(r.after)}" if r.after else "")
        for r in rows
    )


def to_dot(
    table: Table = TABLE,
    *,
    counts: Mapping[Row, int] | None = None,
    illegal: Mapping[tuple[State | None, Event], int] | None = None,
    title: str = "KV request lifecycle",
) -> str:
    """The table as Graphviz DOT text.

    Args:
        table: The table to draw.
        counts: Optional firings per row: edges are labelled and weighted
            by them (a live diagram).
        illegal: Optional illegal (state, event) attempts, drawn as dashed
            red self-edges labelled with their count.
        title: The graph label.
    """
    lines = [
        "digraph lifecycle {",
        f'  label="{title}"; labelloc=t; fontname="Helvetica";',
        '  rankdir=LR; node [fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
        '  __start [shape=point, width=0.15, label=""];',
    ]
    for state in table.states:
        style = _TERMINAL_STYLE if state in table.terminal else _STATE_STYLE
        lines.append(f'  {state.name} [label="{state.name}", {style}];')
    lines.append(f"  __start -> {table.initial.name};")
    total = max(sum(counts.values()), 1) if counts else 1
    for src, dst, rows in _grouped(table):
        label = _label(rows)
        attrs = [f'label="{label}"']
        if counts is not None:
            n = sum(counts.get(r, 0) for r in rows)
            attrs = [f'label="{label}\\nx{n}"']
            width = 1.0 + 5.0 * n / total
            attrs.append(f"penwidth={width:.2f}")
            if n == 0:
                attrs.append('color="#bbbbbb", fontcolor="#999999"')
        lines.append(f"  {src.name} -> {dst.name} [{', '.join(attrs)}];")
    if illegal:
        if any(state is None for state, _ in illegal):
            lines.append(
                '  __unknown [label="unknown id", shape=box, '
                'style=dashed, color="#b91c1c"];'
            )
        for (seen_in, event), n in sorted(
            illegal.items(),
            key=lambda kv: (
                kv[0][0].name if kv[0][0] is not None else "",
                kv[0][1].value,
            ),
        ):
            where = seen_in.name if seen_in is not None else "__unknown"
            lines.append(
                f'  {where} -> {where} [label="{event.value} ✗{n}", '
                'style=dashed, color="#b91c1c", fontcolor="#b91c1c"];'
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(table: Table = TABLE) -> str:
    """The table as a Mermaid ``stateDiagram-v2``."""
    lines = ["stateDiagram-v2", f"    [*] --> {table.initial.name}"]
    for src, dst, rows in _grouped(table):
        label = ", ".join(r.event.value for r in rows)
        lines.append(f"    {src.name} --> {dst.name} : {label}")
    lines.extend(
        f"    {state.name} --> [*]"
        for state in table.states
        if state in table.terminal
    )
    return "\n".join(lines) + "\n"


def to_markdown(table: Table = TABLE) -> str:
    """The table as a Markdown table: one row per transition."""
    order = _state_order(table)
    out = [
        "| From | Event | To | Callbacks |",
        "|---|---|---|---|",
    ]
    out.extend(
        f"| {r.source.name} | `{r.event.value}` | {r.dest.name} | "
        f"{', '.join(f'`{c}`' for c in r.after) or '—'} |"
        for r in sorted(
            table.rows, key=lambda r: (order[r.source], r.event.value)
        )
    )
    return "\n".join(out) + "\n"


def to_svg(dot: str) -> str | None:
    """Render DOT text to SVG with the ``dot`` binary; None if absent."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    done = subprocess.run(  # noqa: S603 - fixed binary, our own input
        [exe, "-Tsvg"],
        input=dot.encode(),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return done.stdout.decode()


def artifacts(table: Table = TABLE) -> dict[str, str | None]:
    """File name → content for every committed diagram (None: no ``dot``)."""
    dot = to_dot(table)
    return {
        f"{STEM}.dot": dot,
        f"{STEM}.mmd": to_mermaid(table),
        f"{STEM}.svg": to_svg(dot),
    }


def write(out_dir: Path = DIAGRAM_DIR, table: Table = TABLE) -> list[Path]:
    """Write every diagram; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in artifacts(table).items():
        if content is None:
            continue
        path = out_dir / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def check(
    out_dir: Path = DIAGRAM_DIR, table: Table = TABLE
) -> tuple[list[str], list[str]]:
    """Compare committed diagrams with fresh ones.

    Returns:
        (diffs, skipped): a unified diff per stale or missing file, and the
        names that could not be checked (SVG without ``dot``).
    """
    diffs, skipped = [], []
    for name, fresh in artifacts(table).items():
        if fresh is None:
            skipped.append(name)
            continue
        path = out_dir / name
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if old != fresh:
            diff = "".join(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    fresh.splitlines(keepends=True),
                    fromfile=f"committed/{name}",
                    tofile=f"generated/{name}",
                    n=2,
                )
            )
            diffs.append(diff or f"{name}: missing\n")
    return diffs, skipped
