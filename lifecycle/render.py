"""Diagrams and docs generated from the table, deterministically.

Everything here is a pure function of a `Table` (and, for live diagrams,
of observed counts): never of a running machine, whose current state would
leak into the picture.  Edges are grouped per (source, dest) and sorted, so
the output is stable and diffs read well.
"""

from __future__ import annotations

import difflib
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from lifecycle.table import Row, Table, callback_name, event_name

_TERMINAL_STYLE = 'shape=doublecircle, style=filled, fillcolor="#e8e8e8"'
_STATE_STYLE = 'shape=circle, style=filled, fillcolor="#dbeafe"'
_START: Final = '"__start"'
_UNKNOWN: Final = '"__unknown"'

AnyTable = Table[Any, Any, Any, Any]
AnyRow = Row[Any, Any, Any, Any]


def dot_id(text: str) -> str:
    """`text` as a quoted DOT id (keywords like NODE or EDGE are safe)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_MERMAID_ID: Final = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_MERMAID_WORDS: Final = frozenset(
    {
        "as",
        "choice",
        "class",
        "classdef",
        "click",
        "default",
        "direction",
        "end",
        "fork",
        "join",
        "note",
        "state",
        "style",
    }
)


def mermaid_ids(table: AnyTable) -> dict[Any, str]:
    """A Mermaid id per state: its name, or ``s<i>`` if that is unsafe.

    Unsafe names (Mermaid keywords, other characters) keep their name as a
    quoted label: ``state "end" as s3``.
    """
    return {
        s: s.name
        if _MERMAID_ID.fullmatch(s.name)
        and s.name.lower() not in _MERMAID_WORDS
        else f"s{i}"
        for i, s in enumerate(table.states)
    }


def _state_order(table: AnyTable) -> dict[Any, int]:
    return {s: i for i, s in enumerate(table.states)}


def _grouped(table: AnyTable) -> list[tuple[Any, Any, list[AnyRow]]]:
    """Rows grouped by (source, dest), in table-state order."""
    order = _state_order(table)
    groups: dict[tuple[Any, Any], list[AnyRow]] = {}
    for row in table.rows:
        groups.setdefault((row.source, row.dest), []).append(row)
    return [
        (src, dst, sorted(rows, key=lambda r: event_name(r.event)))
        for (src, dst), rows in sorted(
            groups.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])
        )
    ]


def _guard(row: AnyRow) -> str:
    """`` [guard]`` for a guarded row, else empty."""
    return "" if row.guard is None else f" [{callback_name(row.guard)}]"


def _callbacks(row: AnyRow) -> str:
    """``after`` names, then ``always`` names marked as such."""
    names = [callback_name(c) for c in row.after]
    names += [f"always {callback_name(c)}" for c in row.always]
    return ", ".join(names)


def _label(rows: list[AnyRow]) -> str:
    return "\\n".join(
        _escape(
            event_name(r.event)
            + _guard(r)
            + (f" / {_callbacks(r)}" if _callbacks(r) else "")
        )
        for r in rows
    )


def _declined(table: AnyTable) -> list[tuple[Any, Any]]:
    """The table's expected refusals, in state then event order."""
    order = _state_order(table)
    return sorted(
        table.expected_refusals,
        key=lambda p: (order[p[0]], event_name(p[1])),
    )


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(
    table: AnyTable,
    *,
    counts: Mapping[AnyRow, int] | None = None,
    illegal: Mapping[tuple[Any, Any], int] | None = None,
    title: str | None = None,
) -> str:
    """The table as Graphviz DOT text.

    Args:
        table: The table to draw.
        counts: Optional firings per row: edges are labelled and weighted
            by them (a live diagram).
        illegal: Optional illegal (state, event) attempts, drawn as dashed
            red self-edges labelled with their count.
        title: The graph label (default: the table's title).
    """
    title = table.title if title is None else title
    lines = [
        "digraph lifecycle {",
        f'  label="{_escape(title)}"; labelloc=t; fontname="Helvetica";',
        '  rankdir=LR; node [fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
        f'  {_START} [shape=point, width=0.15, label=""];',
    ]
    for state in table.states:
        style = _TERMINAL_STYLE if state in table.terminal else _STATE_STYLE
        lines.append(
            f'  {dot_id(state.name)} [label="{_escape(state.name)}", {style}];'
        )
    lines.append(f"  {_START} -> {dot_id(table.initial.name)};")
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
        lines.append(
            f"  {dot_id(src.name)} -> {dot_id(dst.name)} [{', '.join(attrs)}];"
        )
    # An expected refusal is an outcome, not a state: a dotted self-loop.
    for state, event in _declined(table):
        node = dot_id(state.name)
        lines.append(
            f'  {node} -> {node} [label="{_escape(event_name(event))} '
            f'(declined)", style=dotted, color="#6b7280", '
            'fontcolor="#6b7280", arrowhead=none];'
        )
    if illegal:
        if any(state is None for state, _ in illegal):
            lines.append(
                f'  {_UNKNOWN} [label="unknown id", shape=box, '
                'style=dashed, color="#b91c1c"];'
            )
        for (seen_in, event), n in sorted(
            illegal.items(),
            key=lambda kv: (
                kv[0][0].name if kv[0][0] is not None else "",
                event_name(kv[0][1]),
            ),
        ):
            where = dot_id(seen_in.name) if seen_in is not None else _UNKNOWN
            lines.append(
                f"  {where} -> {where} "
                f'[label="{_escape(event_name(event))} ✗{n}", '
                'style=dashed, color="#b91c1c", fontcolor="#b91c1c"];'
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(table: AnyTable) -> str:
    """The table as a Mermaid ``stateDiagram-v2``.

    States whose name is not a safe Mermaid id are declared with their
    name as a quoted label (see `mermaid_ids`).
    """
    ids = mermaid_ids(table)
    lines = ["stateDiagram-v2"]
    lines.extend(
        f'    state "{_escape(s.name)}" as {ids[s]}'
        for s in table.states
        if ids[s] != s.name
    )
    lines.append(f"    [*] --> {ids[table.initial]}")
    for src, dst, rows in _grouped(table):
        label = ", ".join(event_name(r.event) + _guard(r) for r in rows)
        lines.append(f"    {ids[src]} --> {ids[dst]} : {label}")
    lines.extend(
        f"    {ids[state]} --> [*]"
        for state in table.states
        if state in table.terminal
    )
    lines.extend(
        f"    note right of {ids[state]} : {event_name(event)} may be "
        "declined (stays)"
        for state, event in _declined(table)
    )
    return "\n".join(lines) + "\n"


def to_markdown(table: AnyTable) -> str:
    """The table as a Markdown table: one row per transition.

    A table with guards gets a Guard column; guarded alternatives keep
    their table order (the order they are tried in).
    """
    order = _state_order(table)
    guarded = any(r.guard is not None for r in table.rows)
    out = (
        ["| From | Event | Guard | To | Callbacks |", "|---|---|---|---|---|"]
        if guarded
        else ["| From | Event | To | Callbacks |", "|---|---|---|---|"]
    )
    for r in sorted(
        table.rows, key=lambda r: (order[r.source], event_name(r.event))
    ):
        names = [f"`{callback_name(c)}`" for c in r.after]
        names += [f"always `{callback_name(c)}`" for c in r.always]
        guard = (
            f" `{callback_name(r.guard)}` |" if r.guard is not None else " — |"
        )
        out.append(
            f"| {r.source.name} | `{event_name(r.event)}` |"
            f"{guard if guarded else ''} {r.dest.name} | "
            f"{', '.join(names) or '—'} |"
        )
    declined = _declined(table)
    if declined:
        out.append("")
        out.append(
            "Expected refusals (the event is declined, the state stays): "
            + ", ".join(f"{s.name} `{event_name(e)}`" for s, e in declined)
            + "."
        )
    return "\n".join(out) + "\n"


def to_svg(dot: str) -> str | None:
    """Render DOT text to SVG through the `graphviz` package.

    None when the package (the ``diagrams`` extra) or Graphviz's ``dot``
    binary is not installed; the DOT and Mermaid text need neither.
    """
    try:
        import graphviz  # noqa: PLC0415 - optional: the diagrams extra
    except ImportError:
        return None
    try:
        svg: str = graphviz.Source(dot).pipe(format="svg", encoding="utf-8")
    except graphviz.ExecutableNotFound:
        return None
    return svg


def artifacts(
    table: AnyTable, stem: str | None = None
) -> dict[str, str | None]:
    """File name → content for every diagram (None: no ``dot`` binary).

    Files are ``<stem>.dot``, ``.mmd`` and ``.svg``; `stem` defaults to
    the table's name.
    """
    stem = table.name if stem is None else stem
    dot = to_dot(table)
    return {
        f"{stem}.dot": dot,
        f"{stem}.mmd": to_mermaid(table),
        f"{stem}.svg": to_svg(dot),
    }


def write(
    out_dir: Path, table: AnyTable, stem: str | None = None
) -> list[Path]:
    """Write every diagram of `table` into `out_dir`; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in artifacts(table, stem).items():
        if content is None:
            continue
        path = out_dir / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def svg_problems(svg: str, table: AnyTable) -> list[str]:
    """Why `svg` is not a drawing of `table` (empty: it is).

    Structural, never byte-for-byte (graphviz versions differ): the file
    parses as SVG and its node and edge titles are the table's states and
    (source, dest) pairs.
    """
    try:
        root = ET.fromstring(svg)  # noqa: S314 - our own graphviz output
    except ET.ParseError as exc:
        return [f"not well-formed XML: {exc}"]
    ns = "{http://www.w3.org/2000/svg}"
    if root.tag != f"{ns}svg":
        return [f"root element is {root.tag}, not svg"]
    nodes, edges = set(), set()
    for group in root.iter(f"{ns}g"):
        title = group.find(f"{ns}title")
        if title is None or title.text is None:
            continue
        kind = group.get("class")
        if kind == "node":
            nodes.add(title.text)
        elif kind == "edge":
            edges.add(title.text)
    want_nodes = {s.name for s in table.states} | {"__start"}
    want_edges = {f"{s.name}->{d.name}" for s, d, _ in _grouped(table)}
    want_edges.add(f"__start->{table.initial.name}")
    problems = []
    if nodes != want_nodes:
        problems.append(f"states differ: {sorted(nodes ^ want_nodes)}")
    if edges != want_edges:
        problems.append(f"edges differ: {sorted(edges ^ want_edges)}")
    return problems


def check(
    out_dir: Path, table: AnyTable, stem: str | None = None
) -> tuple[list[str], list[str]]:
    """Compare the diagrams in `out_dir` with fresh ones.

    ``.dot`` and ``.mmd`` are compared as text; the ``.svg`` is checked
    structurally (`svg_problems`), so another graphviz version passes.

    Returns:
        (diffs, skipped): a unified diff (or problem list) per stale or
        missing file, and the names that could not be checked (an absent
        SVG when there is no ``dot`` binary to make one).
    """
    diffs: list[str] = []
    skipped: list[str] = []
    stem = table.name if stem is None else stem
    fresh_text = {
        f"{stem}.dot": to_dot(table),
        f"{stem}.mmd": to_mermaid(table),
    }
    for name, fresh in fresh_text.items():
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
    svg_path = out_dir / f"{stem}.svg"
    if not svg_path.exists():
        if shutil.which("dot") is None:
            skipped.append(svg_path.name)
        else:
            diffs.append(f"{svg_path.name}: missing\n")
    else:
        problems = svg_problems(svg_path.read_text(encoding="utf-8"), table)
        diffs.extend(f"{svg_path.name}: {p}\n" for p in problems)
    return diffs, skipped
