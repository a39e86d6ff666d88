"""Reading what ``e2e.lifecycle_connectors`` records; no vLLM import.

The observed connector writes one JSON snapshot per role and process
(``<dir>/<role>-<pid>.json``, replaced atomically); the driver process
reads them here, and ``settle`` steps an engine until its transfers are
over, so a snapshot can be checked for leaks.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from e2e.engine import EngineProcess

FLUSH_PROMPT = (7,) * 8  # under one block: no save, no load


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Replace ``path`` with ``payload`` atomically."""
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True))
    tmp.replace(path)


def read_snapshots(directory: Path, role: str) -> list[dict[str, Any]]:
    """Every ``role`` snapshot in ``directory`` (one per process)."""
    return [
        json.loads(p.read_text())
        for p in sorted(directory.glob(f"{role}-*.json"))
    ]


def only_snapshot(directory: Path, role: str) -> dict[str, Any]:
    """The single ``role`` snapshot in ``directory``.

    Raises:
        ValueError: there is none, or more than one.
    """
    snaps = read_snapshots(directory, role)
    if len(snaps) != 1:
        msg = f"expected one {role} snapshot in {directory}, got {len(snaps)}"
        raise ValueError(msg)
    return snaps[0]


def settle(
    engine: EngineProcess, directory: Path, tries: int = 20
) -> dict[str, Any]:
    """Serve tiny requests until no transfer job is open; the last snapshot.

    A generate call returns when its requests finish, possibly before their
    saves report; each flush request steps the engine, and its
    ``request_finished`` records what anything else still holds.
    """
    snap: dict[str, Any] = {}
    for _ in range(tries):
        engine.generate([list(FLUSH_PROMPT)], 2)
        snap = only_snapshot(directory, "scheduler")
        if snap["open_jobs"] == snap["at_last_finish"]["open_jobs"] == 0:
            break
        time.sleep(0.05)
    return snap
