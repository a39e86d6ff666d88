"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

from lifecycle.render import to_markdown

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_lifecycle_example_runs() -> None:
    (block,) = [b for b in _blocks() if "registry = Registry" in b]
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["tracker"].state.name == "FINISHED"


def test_readme_table_matches_the_generated_one() -> None:
    assert to_markdown() in README.read_text()
