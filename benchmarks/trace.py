"""What tracing and stats cost per event, and how fast replay is.

``python -m benchmarks.trace --json`` prints one JSON object, measured in
one run: the same legal event sequence as `benchmarks.dispatch` on an
untraced machine, a traced one (JSONL to a temporary file) and one whose
trace is full (events dropped), interleaved, median of repeats; the cost
of one `StatsSource.take` after a step's events; and replay throughput.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.dispatch import CYCLE, _lifecycle, _timed
from lifecycle import LifecycleMachine
from lifecycle.kv import TABLE, KVTracker
from lifecycle.trace import TraceWriter, replay_file


def _traced(path: Path, max_events: int, n: int) -> Callable[[], int]:
    machine = LifecycleMachine(TABLE)
    TraceWriter.open(path, max_events=max_events).attach(machine)
    return _lifecycle(machine, n)


def _stats_take(steps: int) -> float:
    """Microseconds per `StatsSource.take` after one step of 10 events."""
    from connector.integration.stats import StatsSource  # noqa: PLC0415 - imports vLLM
    from connector.store import StoreCounters  # noqa: PLC0415

    machine = LifecycleMachine(TABLE)
    source = StatsSource(machine=machine, store=StoreCounters())
    trackers = [KVTracker(f"r{i}") for i in range(steps)]
    total = 0.0
    for t in trackers:
        for e in CYCLE:
            machine.fire(t, e)
        start = time.perf_counter()
        source.take()
        total += time.perf_counter() - start
    return total / steps * 1e6


def main() -> None:
    """Run the benchmark and print the results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    logging.getLogger("lifecycle").setLevel(logging.CRITICAL)
    n = args.requests
    with tempfile.TemporaryDirectory() as tmp:
        traced = Path(tmp) / "traced.jsonl"
        variants = {
            "untraced_us": _lifecycle(LifecycleMachine(TABLE), n),
            "traced_us": _traced(traced, 10**9, n),
            "trace_full_us": _traced(Path(tmp) / "full.jsonl", 1, n),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, run in variants.items():
                samples[name].append(_timed(run))
        start = time.perf_counter()
        replayed = replay_file(traced)
        replay_s = time.perf_counter() - start
        trace_bytes = traced.stat().st_size
    medians = {k: statistics.median(v) for k, v in samples.items()}
    base = medians["untraced_us"]
    result: dict[str, object] = {k: round(v, 3) for k, v in medians.items()}
    result |= {
        "traced_over_untraced": round(medians["traced_us"] / base, 2),
        "full_over_untraced": round(medians["trace_full_us"] / base, 2),
        "bytes_per_event": round(trace_bytes / max(replayed.events, 1), 1),
        "replay_events_per_s": round(replayed.events / replay_s),
        "stats_take_us": round(_stats_take(n), 3),
        "events_per_cycle": len(CYCLE),
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
