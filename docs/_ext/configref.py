"""``.. config-fields:: MODULE:CLASS``: a configuration table from attrs.

One source: every row comes from the class itself, when the docs build.

- Key: ``metadata["key"]`` of the field, else its name (``:keys:
  field=key ...`` renames).
- Type: the field's annotation as written.
- Default: the field's default as JSON (``required`` when it has none);
  a ``*_size`` default of whole MiB also shows as e.g. ``"4GiB"``.
- Meaning: ``metadata["doc"]`` of the field, else its entry in the class
  docstring's Google-style ``Attributes:`` section.

A field with no meaning is a build warning (an error under ``-W``), so a
new field cannot reach the docs undocumented.

``.. config-keys:: MODULE:NAME`` lists a collection of key names (the vLLM
keys the connector does not implement). ``readme_table()`` renders the
README's configuration table from the same fields; run this file to print
it (``tests/test_readme.py`` checks that the README holds it).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from typing import Any, ClassVar, Final

import attrs
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

log = logging.getLogger(__name__)

MiB: Final = 1024 * 1024
_ENTRY: Final = re.compile(
    r"^(\s*)([A-Za-z_][A-Za-z0-9_]*)(?: \([^)]*\))?:\s?(.*)$"
)


def attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the docstring's ``Attributes:`` section."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = lines.index("Attributes:") + 1
    except ValueError:
        return {}
    docs: dict[str, str] = {}
    name, indent = None, None
    for line in lines[start:]:
        if line and not line[0].isspace():
            break  # the next section
        match = _ENTRY.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            name = match.group(2)
            docs[name] = match.group(3).strip()
        elif name is not None and line.strip():
            docs[name] = f"{docs[name]} {line.strip()}".strip()
    return docs


def _type_text(field: attrs.Attribute[Any]) -> str:
    kind: object = field.type  # a string under postponed annotations
    if kind is None:
        return ""
    if isinstance(kind, str):
        return kind
    return getattr(kind, "__name__", None) or str(kind)


def _default_text(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return "(computed)"
    text = json.dumps(default)
    if (
        field.name.endswith("_size")
        and isinstance(default, int)
        and default >= MiB
        and default % MiB == 0
    ):
        size = default // MiB
        unit = "MiB"
        if size % 1024 == 0:
            size, unit = size // 1024, "GiB"
        text = f'{text} ("{size}{unit}")'
    return text


def config_rows(
    cls: type, keys: dict[str, str] | None = None
) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) per attrs field of ``cls``, in order."""
    keys = keys or {}
    docs = attribute_docs(cls)
    return [
        (
            keys.get(field.name, field.metadata.get("key") or field.name),
            _type_text(field),
            _default_text(field),
            str(field.metadata.get("doc") or docs.get(field.name, "")),
        )
        for field in attrs.fields(cls)
    ]


README_CLASSES: Final = (
    "connector.config:StoreConfig",
    "connector.config:TraceConfig",
    "connector.config:LookupConfig",
    "connector.config:IdentityConfig",
    "connector.config:LoadConfig",
    "connector.config:ParallelKVConfig",
    "connector.config:EventsConfig",
)


def _import(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    return getattr(importlib.import_module(module_name), name)


def _markdown_default(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if field.name.endswith("_size") and default and default % MiB == 0:
        size, unit = default // MiB, "MiB"
        if size % 1024 == 0:
            size, unit = size // 1024, "GiB"
        return f"`{size}{unit}`"
    return f"`{json.dumps(default)}`"


def readme_table() -> str:
    """The README's configuration table (Markdown), from the fields."""
    lines = ["| Key | Default | Meaning |", "|---|---|---|"]
    for spec in README_CLASSES:
        for field in attrs.fields(_import(spec)):
            key = field.metadata.get("key") or field.name
            doc = str(field.metadata["doc"]).replace("``", "`")
            lines.append(f"| `{key}` | {_markdown_default(field)} | {doc} |")
    return "\n".join(lines) + "\n"


def _keys_option(argument: str | None) -> dict[str, str]:
    if not argument:
        msg = "expected FIELD=KEY pairs"
        raise ValueError(msg)
    pairs = argument.split()
    out = {}
    for pair in pairs:
        name, sep, key = pair.partition("=")
        if not sep or not name or not key:
            msg = f"expected FIELD=KEY, got {pair!r}"
            raise ValueError(msg)
        out[name] = key
    return out


class ConfigFields(SphinxDirective):
    """The directive: one table row per attrs field."""

    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        "keys": _keys_option,
        "caption": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        """Import the class and build its table."""
        module_name, _, name = self.arguments[0].partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as exc:
            msg = f"config-fields: cannot import {self.arguments[0]}: {exc}"
            raise self.error(msg) from exc
        if not attrs.has(cls):
            msg = f"config-fields: {self.arguments[0]} is not an attrs class"
            raise self.error(msg)
        self.env.note_dependency(inspect.getfile(cls))
        table = nodes.table(classes=["config-fields"])
        caption = self.options.get("caption")
        if caption:
            table += nodes.title(caption, caption)
        group = nodes.tgroup(cols=4)
        table += group
        for width in (24, 12, 20, 44):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += self._row(("Key", "Type", "Default", "Meaning"), head=True)
        group += head
        body = nodes.tbody()
        for row in config_rows(cls, self.options.get("keys")):
            if not row[3]:
                log.warning(
                    "config-fields: %s.%s has no documentation "
                    '(metadata["doc"] or the Attributes: section)',
                    self.arguments[0],
                    row[0],
                    location=self.get_location(),
                )
            body += self._row(row, head=False)
        group += body
        return [table]

    def _row(self, cells: tuple[str, ...], *, head: bool) -> nodes.row:
        row = nodes.row()
        for i, text in enumerate(cells):
            entry = nodes.entry()
            para = nodes.paragraph()
            if head:
                para += nodes.Text(text)
            elif i < 3 and text != "required":  # noqa: PLR2004 - code
                para += nodes.literal(text, text)
            else:
                parsed, messages = self.parse_inline(text, lineno=self.lineno)
                para.extend(parsed)
                para.extend(messages)
            entry += para
            row += entry
        return row


class ConfigKeys(SphinxDirective):
    """The directive: a sorted list of key names, as literals."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        """Import the collection and list it."""
        try:
            keys = sorted(_import(self.arguments[0]))
        except (ImportError, AttributeError) as exc:
            msg = f"config-keys: cannot import {self.arguments[0]}: {exc}"
            raise self.error(msg) from exc
        para = nodes.paragraph(classes=["config-keys"])
        for i, key in enumerate(keys):
            if i:
                para += nodes.Text(", ")
            para += nodes.literal(key, key)
        return [para]


def setup(app: Sphinx) -> dict[str, Any]:
    """Register ``config-fields`` and ``config-keys``."""
    app.add_directive("config-fields", ConfigFields)
    app.add_directive("config-keys", ConfigKeys)
    return {"version": "1", "parallel_read_safe": True}


if __name__ == "__main__":
    print(readme_table(), end="")  # noqa: T201
