"""The store example (docs/connector.md) runs against a real master."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.mooncake

PAGE = Path(__file__).resolve().parent.parent / "docs" / "connector.md"


def test_store_example_runs(master_binary):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "StoreClient.open" in b]
    namespace: dict[str, object] = {}
    exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102
    assert namespace["master"].pids
    assert not namespace["master"].running
