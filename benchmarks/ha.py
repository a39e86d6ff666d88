"""No single point of failure in the store: HA masters and a node pool.

``python -m benchmarks.ha --json`` (in ``.venv``: the cluster tier's
instance processes, `benchmarks.cluster_node`, vLLM 0.33's real
scheduler, no engines) runs:

- ``master_failover``: an HA set (a real etcd and two
  ``mooncake_master --enable_ha --enable_oplog``); instance A stores hot
  prefixes, B loads them (the baseline), then B runs requests on them
  while the leader master is SIGKILLed. Reported: requests and how many
  finished, mismatches (outputs that differ from recomputation, plus
  the harness's checks), ``failover_s`` (the leader's death to a new
  leader serving; the set revokes the dead leader's etcd lease, see
  `connector.ops.ha`), ``engine_resume_s`` (the leader's death to B's
  first store hit: B's Mooncake client reconnects from its heartbeat
  thread, after several failed pings of about 4.5 s each while it is
  busy), loads that failed during it, and, once a leader serves again,
  the prompt tokens B loads from the store for the prefixes stored
  before the failover (``hits_after_failover``) and their share of the
  prefix tokens asked (``hit_fraction_after``). With
  ``--compare-lease-expiry`` the same scenario runs again without the
  revoke (``master_failover_lease_expiry``), in the same run.
- ``engine_restart``: one master and a node-level pool (the wheel's
  ``mooncake_client``: engines contribute no segment, vLLM's
  ``standalone-store``); A stores its prefixes and asks them again
  (``hit_rate_before``); A is SIGKILLed while B keeps asking A's
  prefixes (``other_hit_rate_during``), then a new A asks them
  (``hit_rate_after_restart``). ``embedded_hit_rate_after_restart``
  is the same restart with A's own segment as the pool (today's
  default): its prefixes die with it.

Hit rates are prompt tokens loaded from the store over the tokens of the
stored prefixes asked (vLLM's local prefix cache off). Exit status 1 if
a goal is missed: every request finished, 0 mismatches, failover_s <=
10, hits after the failover > 0, hit_rate_after_restart >= 0.9 x
hit_rate_before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks.cluster import (
    PREFIX_TOKENS,
    Cluster,
    _hits,
    _sum,
    cluster,
    extra,
    finished,
    mismatches,
    requests_in,
    run_all,
    workload,
)
from connector.ops.ha import HAMasters
from connector.ops.procs import NodePool

if TYPE_CHECKING:
    from collections.abc import Sequence

    from benchmarks.cluster_node import Node

POOL_BYTES = 256 * 1024 * 1024


def _rate(result: dict[str, Any], requests: int) -> float:
    """Tokens loaded over the prefix tokens of `requests`."""
    return round(_hits(result) / (requests * PREFIX_TOKENS), 3)


def _kill_all(nodes: Sequence[Node]) -> None:
    """SIGKILL every node: the benchmark needs no orderly shutdown."""
    for node in nodes:
        node.kill()


def master_failover(
    c: Cluster,
    *,
    prefixes: int,
    per_prefix: int,
    interval_s: float,
    fast_failover: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Leader SIGKILLed under load; returns (report, detail)."""
    tag = "fast" if fast_failover else "expiry"
    with HAMasters(
        masters=2, cluster_id=f"bench-ha-{tag}", fast_failover=fast_failover
    ) as ha:
        ns = f"ha-{tag}"
        more = {"cluster_id": ha.cluster_id, "breaker_probe_ms": 200}
        a, b = c.spawn(f"HA-A-{tag}", f"HA-B-{tag}")
        try:
            seeds = list(range(1, prefixes + 1))
            a.call(
                "open", key="m1", extra=extra(ha, ns, **more), num_blocks=64
            )
            a.call("run", key="m1", requests=workload("seed", seeds, 1))
            b.call(
                "open",
                key="m1",
                extra=extra(ha, ns, **more),
                num_blocks=64,
                enable_prefix_caching=False,
            )
            base_load = [workload("base", seeds, 1)]
            baseline = run_all([b], "m1", base_load, interval_s=interval_s)
            time.sleep(2.0)  # the oplog commits in batches (about 1 s)
            load = [workload("fo", seeds, per_prefix)]
            b.send("run", key="m1", requests=load[0], interval_s=interval_s)
            time.sleep(interval_s * 2)
            leader = ha.leader()
            assert leader is not None
            leader.kill()
            killed = time.monotonic()
            served = threading.Event()
            failover: list[float] = []

            def watch() -> None:
                ha.wait_serving(timeout_s=60)
                failover.append(time.monotonic() - killed)
                served.set()

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            during = [b.receive(180)]
            during_done_s = time.monotonic() - killed
            served.wait(70)
            # B's client follows the new leader through its etcd watch:
            # probe with one request until a stored prefix hits again.
            probes = 0
            first_hit_s = None
            while time.monotonic() - killed < 60:
                probes += 1
                probe = b.call(
                    "run",
                    key="m1",
                    requests=workload(f"probe{probes}", seeds[:1], 1),
                )
                if _hits(probe) > 0:
                    first_hit_s = time.monotonic() - killed
                    break
                time.sleep(0.2)
            after_load = [workload("after", seeds, 1)]
            after = run_all([b], "m1", after_load, interval_s=interval_s)
            report = {
                "requests": requests_in(during),
                "requests_finished": finished(during),
                "mismatches": mismatches(during, load)
                + mismatches(after, after_load)
                + mismatches(baseline, base_load),
                "failover_s": round(failover[0], 2) if failover else None,
                "loads_failed": _sum(during, "loads_failed"),
                "engine_resume_s": (
                    round(first_hit_s, 2) if first_hit_s else None
                ),
                "hits_after_failover": _hits(after[0]),
                "hit_fraction_after": _rate(after[0], len(seeds)),
            }
            detail = {
                "baseline_hit_rate": _rate(baseline[0], len(seeds)),
                "during_loads_ok": _sum(during, "loads_ok"),
                "during_hit_tokens": _hits(during[0]),
                "after_requests_finished": finished(after),
                "probes": probes,
                "during_done_s": round(during_done_s, 2),
            }
            return report, detail
        finally:
            _kill_all([a, b])


def engine_restart(
    c: Cluster,
    *,
    prefixes: int,
    interval_s: float,
    node_pool: bool,
    mirror: bool = False,
) -> dict[str, Any]:
    """A SIGKILLed and restarted; its prefixes asked again by the new A.

    ``node_pool``: a node-level pool; the engines contribute no segment,
    or with ``mirror`` keep one and mirror into the pool
    (``placement: mirror``).
    """
    master = c.master()
    pool = None
    segment: int | str = "64MiB"
    more: dict[str, Any] = {}
    if node_pool:
        pool = NodePool.for_master(master, POOL_BYTES).start()
        if mirror:
            more = {"placement": "mirror", "pool_segment": pool.segment}
        else:
            segment = 0
    tag = ("mirror" if mirror else "pool") if node_pool else "emb"
    ns = f"restart-{tag}"
    try:
        a, b = c.spawn(f"{tag}-A", f"{tag}-B")
        opts = {"num_blocks": 64, "enable_prefix_caching": False}
        cfg = {**extra(master, ns, global_segment_size=segment), **more}
        a.call("open", key="m1", extra=cfg, **opts)
        b.call("open", key="m1", extra=cfg, **opts)
        seeds = list(range(1, prefixes + 1))
        a.call("run", key="m1", requests=workload("seed", seeds, 1))
        again = [workload("again", seeds, 1)]
        before = run_all([a], "m1", again, interval_s=interval_s)
        a.kill()
        during_load = [workload("during", seeds, 2)]
        during = run_all([b], "m1", during_load, interval_s=interval_s)
        (a2,) = c.spawn(f"{tag}-A2")
        a2.call("open", key="m1", extra=cfg, **opts)
        after_load = [workload("after", seeds, 1)]
        after = run_all([a2], "m1", after_load, interval_s=interval_s)
        checks = before + during + after
        return {
            "hit_rate_before": _rate(before[0], len(seeds)),
            "hit_rate_after_restart": _rate(after[0], len(seeds)),
            "other_hit_rate_during": _rate(during[0], 2 * len(seeds)),
            "requests": requests_in(checks),
            "requests_finished": finished(checks),
            "mismatches": mismatches(checks, again + during_load + after_load),
        }
    finally:
        if pool is not None:
            pool.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both scenarios; the report."""
    started = time.monotonic()
    report: dict[str, Any] = {}
    with cluster(args.client_ttl) as c:
        if "failover" in args.only:
            fo, fo_detail = master_failover(
                c,
                prefixes=args.prefixes,
                per_prefix=args.per_prefix,
                interval_s=args.interval,
            )
            report["master_failover"] = fo
            if args.compare_lease_expiry:
                slow, _ = master_failover(
                    c,
                    prefixes=args.prefixes,
                    per_prefix=args.per_prefix,
                    interval_s=args.interval,
                    fast_failover=False,
                )
                report["master_failover_lease_expiry"] = slow
        if "restart" in args.only:
            pooled = engine_restart(
                c,
                prefixes=args.prefixes,
                interval_s=args.interval,
                node_pool=True,
            )
            mirrored = engine_restart(
                c,
                prefixes=args.prefixes,
                interval_s=args.interval,
                node_pool=True,
                mirror=True,
            )
            embedded = engine_restart(
                c,
                prefixes=args.prefixes,
                interval_s=args.interval,
                node_pool=False,
            )
            for name, other in (("mirror", mirrored), ("embedded", embedded)):
                for key in ("hit_rate_after_restart", "mismatches"):
                    pooled[f"{name}_{key}"] = other[key]
            report["engine_restart"] = pooled
    if args.detail:
        report["detail"] = {"seconds": round(time.monotonic() - started, 1)}
        if "master_failover" in report:
            report["detail"]["master_failover"] = fo_detail
    return report


def goals_met(report: dict[str, Any]) -> bool:
    """The issue's goals, for the exit status."""
    ok = True
    fo = report.get("master_failover")
    if fo is not None:
        ok = ok and fo["requests_finished"] == fo["requests"]
        ok = ok and fo["mismatches"] == 0
        ok = ok and fo["failover_s"] is not None and fo["failover_s"] <= 10
        ok = ok and fo["hits_after_failover"] > 0
    er = report.get("engine_restart")
    if er is not None:
        ok = ok and er["mismatches"] == 0
        ok = ok and er["requests_finished"] == er["requests"]
        ok = ok and (
            er["hit_rate_after_restart"] >= 0.9 * er["hit_rate_before"]
        )
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ha",
        description=__doc__.split("\n")[0] if __doc__ else None,
    )
    parser.add_argument("--client-ttl", type=int, default=5)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("failover", "restart"),
        default=["failover", "restart"],
    )
    parser.add_argument(
        "--compare-lease-expiry",
        action="store_true",
        help="also fail over without revoking the dead leader's lease",
    )
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run and print; 1 if a goal is missed."""
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if goals_met(report) else 1


if __name__ == "__main__":
    sys.exit(main())
