"""Sphinx configuration of the kv-lifecycle documentation (``make docs``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from sphinx.application import Sphinx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

project = "kv-lifecycle"
author = "kv-lifecycle contributors"
copyright = "kv-lifecycle contributors"  # noqa: A001 - Sphinx's name

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "lifecycle.sphinxext",
    "configref",
    "myst_parser",
]
# reStructuredText pages, plus Markdown pages through MyST.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# Markdown pages link to their own sections by heading (``#the-title``).
myst_heading_anchors = 3

root_doc = "index"
exclude_patterns = ["_build"]
default_role = "py:obj"
nitpicky = False
# Keys, JSON and shell flags appear in prose: keep quotes and dots as typed.
smartquotes = False

# The API reference: signatures from annotations, Google-style docstrings.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# vLLM (and torch) are the serving environment's, not the docs': their
# classes are stand-ins here, so the docs build in seconds without them.
autodoc_mock_imports = ["vllm", "torch", "mooncake"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True


def _plural_code_refs(  # noqa: PLR0917 - autodoc's signature
    app: object,
    what: str,
    name: str,
    obj: object,
    options: object,
    lines: list[str],
) -> None:
    """Docstrings write plurals of references as `Name`s; make that rst."""
    del app, what, name, obj, options
    lines[:] = [
        re.sub(r"(?<!`)`([\w.]+)`s\b", r"`\1`\\ s", ln) for ln in lines
    ]


def setup(app: Sphinx) -> None:
    """Hook the docstring fix into autodoc."""
    app.connect("autodoc-process-docstring", _plural_code_refs)


html_theme = "alabaster"
html_title = "kv-lifecycle"
html_theme_options = {
    "description": "KV-cache connectors that cannot crash",
    "page_width": "1100px",
    "sidebar_width": "220px",
}
