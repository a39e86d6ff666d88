"""Sphinx directives that draw a lifecycle table when the docs are built.

Add the extension to ``conf.py`` and name a table by ``MODULE:NAME``::

    extensions = ["lifecycle.sphinxext"]

.. code-block:: rst

    .. lifecycle-diagram:: lifecycle.kv:TABLE
       :caption: The KV request lifecycle.

    .. lifecycle-table:: lifecycle.kv:TABLE

``lifecycle-diagram`` renders the table with `lifecycle.render` at build
time: inline SVG in HTML (Graphviz's ``dot`` is needed; without it the
build warns and shows the DOT source), the DOT source in other builders.
``:format: dot`` or ``:format: mermaid`` shows the source text instead.
``lifecycle-table`` is the transition table, one row per transition.

Contracts: the picture is a pure function of the table (never of a running
machine); every document that uses a directive depends on the file that
defines the table, so an incremental build re-renders it when the table
changes; a bad reference is a build error naming it (``-W`` fails).
Importing this module needs Sphinx; ``import lifecycle`` never does.
"""

from __future__ import annotations

import enum
import importlib
import re
from pathlib import Path
from typing import Any, ClassVar, Final

import attrs
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from lifecycle import render
from lifecycle.table import Table, event_name

__all__ = [
    "LifecycleDiagram",
    "LifecycleTable",
    "TableReferenceError",
    "load_table",
    "setup",
]

log = logging.getLogger(__name__)

VERSION: Final = "1"
FORMATS: Final = ("svg", "dot", "mermaid")
_SVG_PROLOGUE: Final = re.compile(r"^.*?(?=<svg\b)", re.DOTALL)


@attrs.define(auto_exc=True, slots=False)
class TableReferenceError(ValueError):
    """A ``MODULE:NAME`` reference that does not name a `Table`.

    Attributes:
        reference: The reference as written.
        reason: Why it could not be used.
    """

    reference: str
    reason: str

    def __str__(self) -> str:
        return f"{self.reference!r}: {self.reason}"


def load_table(
    reference: str,
) -> tuple[Table[Any, Any, Any, Any], Path | None]:
    """Import the `Table` named by ``MODULE:NAME`` (NAME may be dotted).

    Returns:
        The table and the file of the module that defines it (None for a
        module without a file).

    Raises:
        TableReferenceError: malformed reference, module not importable,
            no such attribute, or the attribute is not a `Table`.
    """
    module_name, sep, name = reference.strip().partition(":")
    if not sep or not module_name or not name:
        raise TableReferenceError(reference, "expected MODULE:NAME")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        reason = f"cannot import {module_name}: {exc}"
        raise TableReferenceError(reference, reason) from exc
    obj: object = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            reason = f"{module_name} has no attribute {name}"
            raise TableReferenceError(reference, reason) from None
    if not isinstance(obj, Table):
        reason = f"{type(obj).__name__} is not a lifecycle Table"
        raise TableReferenceError(reference, reason)
    file = getattr(module, "__file__", None)
    return obj, Path(file) if file else None


def _label(member: enum.Enum) -> str:
    """An event's label: its string value, else its name."""
    value = member.value
    return value if isinstance(value, str) else member.name


def _callback_name(callback: object) -> str:
    if isinstance(callback, str):
        return callback
    name = getattr(callback, "__qualname__", None) or getattr(
        callback, "__name__", None
    )
    return str(name) if name else repr(callback)


def transition_rows(
    table: Table[Any, Any, Any, Any],
) -> list[tuple[str, str, str, str]]:
    """(from, event, to, callbacks) per row, in table-state then event order.

    The same order as `lifecycle.render.to_markdown`.
    """
    order = {state: i for i, state in enumerate(table.states)}
    rows = sorted(table.rows, key=lambda r: (order[r.source], _label(r.event)))
    return [
        (
            row.source.name,
            _label(row.event),
            row.dest.name,
            ", ".join(_callback_name(c) for c in row.after),
        )
        for row in rows
    ]


def row_guards(table: Table[Any, Any, Any, Any]) -> list[str]:
    """Each row's guard name ("" for none), in `transition_rows` order."""
    order = {state: i for i, state in enumerate(table.states)}
    rows = sorted(table.rows, key=lambda r: (order[r.source], _label(r.event)))
    return [
        _callback_name(row.guard) if row.guard is not None else ""
        for row in rows
    ]


class _TableDirective(SphinxDirective):
    """Shared part: resolve the argument and record the dependency."""

    required_arguments = 1
    optional_arguments = 0
    final_argument_whitespace = False

    def _table(self) -> Table[Any, Any, Any, Any]:
        reference = self.arguments[0]
        try:
            table, source = load_table(reference)
        except TableReferenceError as exc:
            msg = f"{self.name}: {exc}"
            raise self.error(msg) from exc
        for dependency in (source, Path(render.__file__)):
            if dependency is not None:
                self.env.note_dependency(str(dependency))
        return table

    def _caption(self, node: nodes.Element) -> None:
        caption = self.options.get("caption")
        if caption:
            parsed, _ = self.parse_inline(caption, lineno=self.lineno)
            node += nodes.caption(caption, "", *parsed)


class LifecycleDiagram(_TableDirective):
    """``.. lifecycle-diagram:: MODULE:NAME``: the table's state diagram.

    Options: ``:caption:`` (a figure caption), ``:title:`` (the graph's
    own label), ``:alt:`` (text for non-visual readers) and ``:format:``
    (``svg``, the default; ``dot`` or ``mermaid`` show the source text).
    """

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "caption": directives.unchanged,
        "title": directives.unchanged,
        "alt": directives.unchanged,
        "format": lambda arg: directives.choice(arg, FORMATS),
        "class": directives.class_option,
        "name": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        """Render the diagram into a figure."""
        table = self._table()
        fmt = self.options.get("format", "svg")
        title = self.options.get("title")
        dot = (
            render.to_dot(table, title=title)
            if title
            else render.to_dot(table)
        )
        figure = nodes.figure(
            classes=["lifecycle-diagram", *self.options.get("class", [])]
        )
        self.add_name(figure)
        if fmt == "mermaid":
            figure += _source_block(render.to_mermaid(table), "text")
        elif fmt == "dot":
            figure += _source_block(dot, "dot")
        else:
            figure += self._svg(dot)
        self._caption(figure)
        return [figure]

    def _svg(self, dot: str) -> list[nodes.Node]:
        svg = render.to_svg(dot)
        if svg is None:
            log.warning(
                "lifecycle-diagram: Graphviz's `dot` is not installed; "
                "showing the DOT source of %s instead",
                self.arguments[0],
                location=self.get_location(),
            )
            return [_source_block(dot, "dot")]
        alt = (
            self.options.get("alt") or f"State diagram of {self.arguments[0]}"
        )
        html = (
            f'<div class="lifecycle-svg" role="img" '
            f'aria-label="{_attr(alt)}" style="overflow-x: auto">\n'
            f"{_SVG_PROLOGUE.sub('', svg, count=1)}</div>\n"
        )
        only_html = addnodes.only(expr="html")
        only_html += nodes.raw("", html, format="html")
        other = addnodes.only(expr="not html")
        other += _source_block(dot, "dot")
        return [only_html, other]


class LifecycleTable(_TableDirective):
    """``.. lifecycle-table:: MODULE:NAME``: one row per transition.

    Columns: From, Event, To, Callbacks, and Guard when a row has one;
    the table's expected refusals follow it in a sentence.  Option
    ``:caption:`` titles it.
    """

    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "caption": directives.unchanged,
        "class": directives.class_option,
        "name": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        """Build the transition table."""
        source = self._table()
        rows = transition_rows(source)
        guards = row_guards(source)
        header = ["From", "Event", "To", "Callbacks"]
        widths = [14, 16, 14, 30]
        if any(guards):
            header.append("Guard")
            widths.append(14)
        table = nodes.table(
            classes=["lifecycle-table", *self.options.get("class", [])]
        )
        self.add_name(table)
        caption = self.options.get("caption")
        if caption:
            parsed, _ = self.parse_inline(caption, lineno=self.lineno)
            table += nodes.title(caption, "", *parsed)
        group = nodes.tgroup(cols=len(header))
        table += group
        for width in widths:
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += _row(tuple(header), code=())
        group += head
        body = nodes.tbody()
        for cells, guard in zip(rows, guards, strict=True):
            shown = [*cells[:3], cells[3] or "—"]
            if len(header) > len(shown):
                shown.append(guard or "—")
            body += _row(tuple(shown), code=(1, 3, 4))
        group += body
        declined = sorted(
            (s.name, event_name(e)) for s, e in source.expected_refusals
        )
        if not declined:
            return [table]
        note = nodes.paragraph(
            classes=["lifecycle-expected-refusals"],
        )
        note += nodes.Text("Expected refusals (declined, the state stays): ")
        for i, (state, event) in enumerate(declined):
            if i:
                note += nodes.Text(", ")
            note += nodes.Text(f"{state} ")
            note += nodes.literal(event, event)
        note += nodes.Text(".")
        return [table, note]


def _row(cells: tuple[str, ...], *, code: tuple[int, ...]) -> nodes.row:
    row = nodes.row()
    for i, text in enumerate(cells):
        entry = nodes.entry()
        para = nodes.paragraph()
        if i in code and text != "—":
            para += nodes.literal(text, text)
        else:
            para += nodes.Text(text)
        entry += para
        row += entry
    return row


def _source_block(text: str, language: str) -> nodes.literal_block:
    block = nodes.literal_block(text, text)
    block["language"] = language
    return block


def _attr(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    )


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directives (Sphinx extension entry point)."""
    app.add_directive("lifecycle-diagram", LifecycleDiagram)
    app.add_directive("lifecycle-table", LifecycleTable)
    return {
        "version": VERSION,
        "parallel_read_safe": True,
        "parallel_write_safe": True,
        "env_version": 1,
    }
