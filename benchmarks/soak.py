"""Soak: the demo's workload at scale, with one master restart.

`python -m benchmarks.soak --requests N --json` runs `demo.workload`
(two vLLM 0.33 schedulers with the connector over one embedded Mooncake
master; shared prefixes, KV pressure, aborts, one load failure per 1000
requests, duplicate `request_finished` calls) and restarts the master
once mid-run, which loses every stored key.  The harness checks every
computed block's KV and the block pool every step.

It prints requests completed, crashes, illegal events by kind, live
trackers and RSS at the start, at a checkpoint and at the end of the run
(both instances still up; also after they closed), and data mismatches.
The goal: no crash, no leaked tracker or block, no mismatch, and RSS
growth under 5 % from the checkpoint (10k requests by default) to the
end.  Needs vLLM 0.33 and the `mooncake_master` binary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from demo.workload import Session

RSS_GOAL_PCT = 5.0
_STATUS = Path("/proc/self/status")


def rss_bytes() -> int:
    """Resident set size now (peak RSS where /proc is missing)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint",
        type=int,
        default=None,
        help="finished requests at which RSS is sampled for the growth "
        "figure (default: 10000, or half the requests if fewer)",
    )
    parser.add_argument(
        "--restart-after",
        type=int,
        default=None,
        help="finished requests before the master restart "
        "(default: a third of the requests)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.requests < 4:
        parser.error("--requests must be at least 4")
    if args.checkpoint is None:
        args.checkpoint = min(10_000, args.requests // 2)
    if args.restart_after is None:
        args.restart_after = args.requests // 3
    return args


class Probe:
    """Samples RSS and trackers as the session runs (its progress hook).

    Every `every` finished requests it writes one line to stderr.
    """

    def __init__(self, checkpoint: int, every: int = 1000) -> None:
        self.checkpoint = checkpoint
        self.every = every
        self._next_line = every
        self.rss_checkpoint: int | None = None
        self.trackers_checkpoint: int | None = None
        self.peak_trackers = 0
        self.hits_at_restart: int | None = None

    def __call__(self, session: Session) -> None:
        trackers = session.live_trackers
        self.peak_trackers = max(self.peak_trackers, trackers)
        if self.rss_checkpoint is None and session.finished >= self.checkpoint:
            self.rss_checkpoint = rss_bytes()
            self.trackers_checkpoint = trackers
        if self.hits_at_restart is None and session.master_restarts:
            self.hits_at_restart = _store_hits(session)
        if session.finished >= self._next_line:
            self._next_line += self.every
            print(
                f"soak: {session.finished} finished, {trackers} trackers, "
                f"RSS {_mb(rss_bytes())} MiB, "
                f"{session.master_restarts} master restart(s)",
                file=sys.stderr,
                flush=True,
            )


def _store_hits(session: Session) -> int:
    return sum(i.stats.external_admissions for i in session.instances)


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; return the JSON report."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from connector import clients  # noqa: PLC0415 - imports vLLM
    from connector.master import EmbeddedMaster  # noqa: PLC0415
    from demo.workload import (  # noqa: PLC0415
        Session,
        WorkloadConfig,
        single_threaded_torch,
    )

    config = WorkloadConfig(
        requests=args.requests,
        seed=args.seed,
        restart_master_after=args.restart_after,
        load_failures=max(1, args.requests // 1000),
        stall_s=120.0,
    )
    probe = Probe(args.checkpoint)
    with EmbeddedMaster() as master, single_threaded_torch():
        session = Session(config, master, namespace="soak")
        try:
            trackers_start = session.live_trackers
            rss_start = rss_bytes()
            report = session.run(probe)
            rss_end = rss_bytes()
            hits_end = _store_hits(session)
        finally:
            session.close()
            clients.close_all()  # before the master stops
    rss_closed = rss_bytes()
    growth = (
        100.0 * (rss_end - probe.rss_checkpoint) / probe.rss_checkpoint
        if probe.rss_checkpoint
        else None
    )
    j = report.to_json()
    out: dict[str, Any] = {
        "requests": args.requests,
        "seed": args.seed,
        "completed": report.finished,
        "outcomes": j["outcomes"],
        "wall_s": j["wall_s"],
        "requests_per_s": j["requests_per_s"],
        "crashes": len(report.crashes),
        "crash_messages": list(report.crashes),
        "illegal": j["illegal"],
        "stale": j["stale"],
        "worker_illegal": j["worker_illegal"],
        "worker_stale": j["worker_stale"],
        "trackers": {
            "start": trackers_start,
            "checkpoint": probe.trackers_checkpoint,
            "end": report.live_trackers,
            "peak": probe.peak_trackers,
        },
        "open_jobs_end": report.open_jobs,
        "leaked_blocks": report.leaked_blocks,
        "rss_mb": {
            "start": _mb(rss_start),
            "checkpoint": _mb(probe.rss_checkpoint),
            "end": _mb(rss_end),
            "after_close": _mb(rss_closed),
        },
        "checkpoint_requests": args.checkpoint,
        "rss_growth_checkpoint_to_end_pct": None
        if growth is None
        else round(growth, 2),
        "mismatches": report.mismatches,
        "failed_checks": len(report.failures),
        "failed_check_messages": list(report.failures[:20]),
        "preemptions": report.preemptions,
        "aborts_sent": j["aborts_sent"],
        "load_failures": j["load_failures"],
        "replayed_finishes": j["replayed_finishes"],
        "master_restarts": report.master_restarts,
        "restart_after_requests": args.restart_after,
        "store_hit_admissions": {
            "before_restart": probe.hits_at_restart,
            "after_restart": None
            if probe.hits_at_restart is None
            else hits_end - probe.hits_at_restart,
        },
        "prefix_hit_rate": j["prefix_hit_rate"],
    }
    out["goal_met"] = bool(
        report.ok
        and report.master_restarts == 1
        and growth is not None
        and growth < RSS_GOAL_PCT
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
