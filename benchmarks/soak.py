"""Soak: the demo's workload at scale, with one master restart.

`python -m benchmarks.soak --requests N --json` runs `demo.session`
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

The same run first replays the same requests (same seed, concurrency and
aborts) through two instances with a no-op connector in a child process
(``--connector noop``; ``--no-baseline`` skips it) and reports its RSS
growth over the same interval next to ours: growth that both show is
vLLM's, the harness's or the allocator's, not the connector's.  Ours
also reports its growth net of the KV the store holds (the master's
allocated bytes: in this in-process topology the store segment is in
this process, and its pages become resident as the cache fills, up to
`global_segment_size`).  The goal adds: ours, net of stored KV, grows at
most `BASELINE_SLACK_PTS` points more than the no-op baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from demo.session import Session

RSS_GOAL_PCT = 5.0
BASELINE_SLACK_PTS = 0.5
NOOP: Final = "harness.noop.NoopConnector"
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
    parser.add_argument(
        "--connector",
        choices=("ours", "noop"),
        default="ours",
        help="noop: only the no-op baseline (what the child process runs)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the no-op connector baseline",
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


def store_mb(session: Session) -> float | None:
    """MiB the master has allocated for stored objects (its metrics)."""
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(  # noqa: S310 - loopback master
            session.master.metrics_url, timeout=2
        ) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("master_allocated_bytes "):
            return _mb(int(float(line.split()[1])))
    return None


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
        self.store_checkpoint: float | None = None

    def __call__(self, session: Session) -> None:
        trackers = session.live_trackers
        self.peak_trackers = max(self.peak_trackers, trackers)
        if self.rss_checkpoint is None and session.finished >= self.checkpoint:
            self.rss_checkpoint = rss_bytes()
            self.trackers_checkpoint = trackers
            self.store_checkpoint = store_mb(session)
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
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415
    from connector.store import clients  # noqa: PLC0415 - imports vLLM
    from demo.session import (  # noqa: PLC0415
        Session,
        single_threaded_torch,
    )
    from demo.spec import WorkloadConfig  # noqa: PLC0415

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
            store_end = store_mb(session)
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
    # The stored KV lives in this process's store segment (in-process
    # topology), whose pages become resident as the store fills: that is
    # the cache holding data (bounded by `global_segment_size`), not
    # memory the connector leaks.  Net growth leaves it out.
    net = None
    stored = None
    if probe.store_checkpoint is not None and store_end is not None:
        stored = (store_end - probe.store_checkpoint) * 2**20
    if growth is not None and stored is not None and probe.rss_checkpoint:
        kept = rss_end - probe.rss_checkpoint - stored
        net = 100.0 * kept / probe.rss_checkpoint
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
        "store_allocated_mb": {
            "checkpoint": probe.store_checkpoint,
            "end": store_end,
        },
        "checkpoint_requests": args.checkpoint,
        "rss_growth_checkpoint_to_end_pct": None
        if growth is None
        else round(growth, 2),
        "rss_growth_net_of_stored_kv_pct": None
        if net is None
        else round(net, 2),
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


def _growth(checkpoint: int | None, end: int) -> float | None:
    if not checkpoint:
        return None
    return round(100.0 * (end - checkpoint) / checkpoint, 2)


class NoopSession:
    """The workload's requests through a no-op connector, two instances.

    Same specs, concurrency, B's warm-up and abort schedule as
    `demo.session.Session` (no store, so no load faults or restart).
    """

    def __init__(self, requests: int, seed: int) -> None:
        from demo.spec import (  # noqa: PLC0415
            WorkloadConfig,
            request_specs,
        )
        from harness import Harness  # noqa: PLC0415

        config = WorkloadConfig(requests=requests, seed=seed)
        self.config = config
        total_b = round(config.requests * config.share_b)
        self.counts = {"A": config.requests - total_b, "B": total_b}
        roles = {"A": "kv_producer", "B": "kv_consumer"}
        self.harnesses = {
            name: Harness(
                NOOP,
                kv_role=roles[name],  # type: ignore[arg-type]
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                kv_width=config.kv_width,
                max_num_seqs=config.max_num_seqs,
            )
            for name in ("A", "B")
        }
        self.specs = {
            n: request_specs(config, n, self.counts[n]) for n in self.harnesses
        }
        self.live: dict[str, set[str]] = {n: set() for n in self.harnesses}
        self.submitted = dict.fromkeys(self.harnesses, 0)
        self.done = dict.fromkeys(self.harnesses, 0)
        self.aborts: list[tuple[int, str, str, bool]] = []
        self.tick = 0

    @property
    def finished(self) -> int:
        """Requests finished, both instances."""
        return sum(self.done.values())

    def _admit(self, name: str) -> None:
        import heapq  # noqa: PLC0415

        config, h = self.config, self.harnesses[name]
        if name == "B" and self.done["A"] < config.warmup:
            return
        while (
            self.submitted[name] < self.counts[name]
            and len(self.live[name]) < config.concurrency
        ):
            spec = next(self.specs[name])
            h.add_request(spec.req_id, spec.prompt, spec.max_tokens)
            self.live[name].add(spec.req_id)
            self.submitted[name] += 1
            if spec.abort_after:
                due = self.tick + spec.abort_after
                item = (due, spec.req_id, name, spec.abort_in_flight)
                heapq.heappush(self.aborts, item)

    def step(self) -> None:
        """One tick: admit, abort what is due, step each busy instance."""
        import heapq  # noqa: PLC0415

        self.tick += 1
        for name in self.harnesses:
            self._admit(name)
        while self.aborts and self.aborts[0][0] <= self.tick:
            _, req_id, name, in_flight = heapq.heappop(self.aborts)
            request = self.harnesses[name].requests.get(req_id)
            if request is not None and not request.is_finished():
                self.harnesses[name].abort(req_id, in_flight=in_flight)
        for name, h in self.harnesses.items():
            if not h.is_idle():
                h.step()
            for gone in h.forget_finished():
                self.live[name].discard(gone.req_id)
                self.done[name] += 1

    def close(self) -> None:
        """Shut both instances down."""
        for h in self.harnesses.values():
            h.close()


def run_noop(args: argparse.Namespace) -> dict[str, Any]:
    """`NoopSession` to the end; RSS at its start, checkpoint and end."""
    from demo.session import single_threaded_torch  # noqa: PLC0415

    rss_checkpoint = None
    with single_threaded_torch():
        session = NoopSession(args.requests, args.seed)
        try:
            rss_start = rss_bytes()
            while session.finished < args.requests:
                session.step()
                if rss_checkpoint is None and (
                    session.finished >= args.checkpoint
                ):
                    rss_checkpoint = rss_bytes()
            rss_end = rss_bytes()
        finally:
            session.close()
    return {
        "connector": "noop",
        "requests": args.requests,
        "completed": session.finished,
        "rss_mb": {
            "start": _mb(rss_start),
            "checkpoint": _mb(rss_checkpoint),
            "end": _mb(rss_end),
        },
        "rss_growth_checkpoint_to_end_pct": _growth(rss_checkpoint, rss_end),
    }


def _baseline(args: argparse.Namespace) -> dict[str, Any]:
    """`run_noop` in a child process (its own heap), parsed."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.soak",
        "--connector",
        "noop",
        "--json",
        "--requests",
        str(args.requests),
        "--seed",
        str(args.seed),
        "--checkpoint",
        str(args.checkpoint),
    ]
    out = subprocess.run(  # noqa: S603 - our own module
        cmd, capture_output=True, text=True, check=False, timeout=7200
    )
    try:
        result: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        tail = out.stderr.strip().splitlines()[-5:]
        return {"connector": "noop", "error": "\n".join(tail)}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.connector == "noop":
        noop = run_noop(args)
        print(json.dumps(noop, indent=2))
        return 0
    baseline = None if args.no_baseline else _baseline(args)
    result = run(args)
    if baseline is not None:
        result["noop_baseline"] = baseline
        theirs = baseline.get("rss_growth_checkpoint_to_end_pct")
        ours = result["rss_growth_checkpoint_to_end_pct"]
        net = result["rss_growth_net_of_stored_kv_pct"]
        if theirs is not None and ours is not None:
            result["growth_over_noop_pts"] = round(ours - theirs, 2)
        if theirs is not None and net is not None:
            result["net_growth_over_noop_pts"] = round(net - theirs, 2)
            result["goal_met"] = bool(
                result["goal_met"] and net - theirs <= BASELINE_SLACK_PTS
            )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
