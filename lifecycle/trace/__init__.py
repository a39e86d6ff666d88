"""Lifecycle traces: a bounded JSONL record of every event, and its replay.

- `lifecycle.trace.writer`: `TraceWriter`, which a machine's observers
  feed and a background thread writes; the line format; `summarize`,
  `pair_key` and `hash_req_id`.
- `lifecycle.trace.replayer`: `replay` / `replay_file`, which read a trace
  back through a fresh machine of the same table.

Everything public is importable from `lifecycle.trace` itself.
"""

from lifecycle.trace.replayer import (
    Divergence,
    Record,
    Replay,
    RequestReplay,
    parse,
    replay,
    replay_file,
)
from lifecycle.trace.writer import (
    DEFAULT_MAX_EVENTS,
    ILLEGAL,
    STALE,
    UNKNOWN,
    TableMismatchError,
    TraceError,
    TraceWriter,
    hash_req_id,
    pair_key,
    summarize,
)

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "ILLEGAL",
    "STALE",
    "UNKNOWN",
    "Divergence",
    "Record",
    "Replay",
    "RequestReplay",
    "TableMismatchError",
    "TraceError",
    "TraceWriter",
    "hash_req_id",
    "pair_key",
    "parse",
    "replay",
    "replay_file",
    "summarize",
]
