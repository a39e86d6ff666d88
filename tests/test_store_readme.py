"""The README's store example runs as written against a real master."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.mooncake

README = Path(__file__).resolve().parent.parent / "README.md"


def test_store_example_runs(master_binary):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "StoreClient.open" in b]
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["master"].pids
    assert not namespace["master"].running
