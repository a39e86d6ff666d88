"""The cluster tier: real instance processes share, die, restart, fill up.

``python -m benchmarks.cluster --json`` (in ``.venv``: vLLM 0.33's real
scheduler, no engines) starts three embedded ``mooncake_master``s (HTTP
metadata server on, loopback only) and instance processes
(`benchmarks.cluster_node`), each with its own worker segment, and runs:

- ``peer_death``: instance A alone stores the hot prefixes (so they all
  live in A's segment); B and C load them (the baseline run), then A is
  SIGKILLed while B and C run requests on other hot prefixes of A.
  Reported: requests and how many finished, mismatches (checks the
  harness failed plus outputs that differ from recomputation), failed
  loads, the dead prefixes, the most failed loads any survivor paid for
  one dead prefix, and p99 TTFT of the affected requests over the
  baseline's (TTFT in ms from arrival to first token; ``--detail`` adds
  p50 and p99 in ms and in engine steps).
- ``replica2``: with ``replica_num = 2``, an instance stores prefixes
  while only it and B have segments (so every object has a replica in
  each), C joins, the storing instance is SIGKILLed, and B and C load
  the prefixes: loads that hit and loads that failed after the death
  (goal 0: a get that picks the dead replica is read again from the
  live one).
- ``hung_peer``: an instance alone stores hot prefixes (the only copy
  lives in its segment); another loads some of them (the baseline), then
  the owner is SIGSTOPped while the other runs requests on its other
  prefixes, then SIGCONTed and the same prefixes are asked again.
  Reported: requests and how many finished, mismatches (before and after
  SIGCONT, and the baseline's), the hung run's seconds, its TTFT p99 (a
  request without a first token counts the whole run) against the
  baseline's, and failed loads.
- ``restart``: A comes back (a new process, so a new segment; same model
  and namespace) once the master dropped the dead segment; B's prefixes
  hit in the new A and the new A's in B.  The new A also asks for the
  prefixes the old A alone stored: nothing stale may be served.
- ``store_full``: three instances with 16 MiB segments and 128 KiB blocks
  save several times the pool's capacity while sharing a few
  prefixes; the master's eviction is on; then each asks its oldest
  prompts again (evicted: the lookup misses and vLLM recomputes).
  Reported: requests, finished, mismatches, puts refused (``-200``),
  the hit rate (tokens loaded from the store / tokens of the shared
  prefixes asked, in the first pass) and the replay's hit rate (blocks of
  the oldest prompts loaded again / their blocks).
- ``store_full_ssd`` (``--ssd``): ``store_full`` again on a master with
  Mooncake's SSD tier (``--enable_offload=true --root_fs_dir=<tmp>``):
  evicted blocks keep a disk copy, so the replay hits.

Survivors run with vLLM's local prefix cache off, so every request asks
the store and the connector's failed-load memory
(`connector.scheduler.failed_keys`) is what stands between a dead prefix
and one failed load per request.  ``--detail`` adds the per-node figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from benchmarks import percentile
from benchmarks.cluster_node import Node
from connector.ops.master import EmbeddedMaster
from harness.extra_config import LOOPBACK, store_extra

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

BLOCK = 16
PREFIX_TOKENS = 64  # 4 blocks
FINISHED = "FINISHED_LENGTH_CAPPED"
SEGMENT_MIB = 16  # store_full's segments
OWN_BLOCKS = 14  # store_full: blocks each request saves
REPLAYED = 8  # store_full: oldest requests of each instance asked again


def prefix(seed: int, length: int = PREFIX_TOKENS) -> list[int]:
    """A deterministic prefix; different seeds share no first token."""
    return [(seed * 37 + i * 11) % 500 for i in range(length)]


def suffix(req: int, length: int) -> list[int]:
    """A request's own tail (differs from every other request's)."""
    return [(req * 13 + j * 17 + 3) % 500 for j in range(length)]


def expected_output(prompt: Sequence[int], n: int) -> list[int]:
    """The tokens recomputation samples after `prompt` (the harness's)."""
    from harness.scheduler import (  # noqa: PLC0415
        extend_hash,
        prefix_hashes,
        sample_token,
    )

    h = prefix_hashes(prompt)[-1]
    out = []
    for _ in range(n):
        token = sample_token(h)
        out.append(token)
        h = extend_hash(h, token)
    return out


class Cluster:
    """Masters and instance processes, all stopped by `close`."""

    def __init__(self, *, client_ttl_s: int) -> None:
        self.client_ttl_s = client_ttl_s
        self.log_dir = Path(tempfile.mkdtemp(prefix="kv-cluster-"))
        self.masters: list[EmbeddedMaster] = []
        self.nodes: list[Node] = []

    def master(self, **flags: Any) -> EmbeddedMaster:
        """Start a master (HTTP metadata server on, loopback only)."""
        master = EmbeddedMaster(client_ttl_s=self.client_ttl_s, **flags)
        self.masters.append(master)
        return master.start()

    def spawn(self, *names: str) -> list[Node]:
        """Start instance processes and wait (bounded) until they answer."""
        nodes = [Node.spawn(name, self.log_dir) for name in names]
        self.nodes.extend(nodes)
        for node in nodes:
            node.call("ping", timeout_s=180)
        return nodes

    def close(self, *, keep_logs: bool = False) -> None:
        """Stop every node (all at once), then every master (bounded)."""
        for node in self.nodes:
            with contextlib.suppress(OSError):
                if node.alive:
                    node.resume()  # a stopped node cannot quit
                    node.send("quit")
        for node in self.nodes:
            node.close()
        for master in self.masters:
            master.stop()
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


@contextlib.contextmanager
def cluster(client_ttl_s: int) -> Iterator[Cluster]:
    """A `Cluster` that is always closed."""
    made = Cluster(client_ttl_s=client_ttl_s)
    try:
        yield made
    finally:
        made.close(keep_logs=bool(os.environ.get("KV_CLUSTER_KEEP_LOGS")))


def extra(
    master: EmbeddedMaster, namespace: str, **more: Any
) -> dict[str, Any]:
    """The connector's extra config for an instance of `master`."""
    return store_extra(master, namespace, **{**LOOPBACK, **more})


def workload(
    tag: str, seeds: Sequence[int], per_prefix: int, tail: int = 8
) -> list[tuple[str, list[int], int]]:
    """Requests round-robin over prefixes, each with its own tail."""
    requests = []
    for n in range(per_prefix):
        for seed in seeds:
            req = len(requests)
            prompt = [*prefix(seed), *suffix(req + 1000 * seed, tail)]
            requests.append((f"{tag}-{seed}-{n}", prompt, 2))
    return requests


def run_all(
    nodes: Sequence[Node],
    key: str,
    loads: Sequence[list[tuple[str, list[int], int]]],
    *,
    interval_s: float,
    timeout_s: float = 120.0,
) -> list[dict[str, Any]]:
    """Run one workload per node concurrently; every answer, in order."""
    for node, requests in zip(nodes, loads, strict=True):
        node.send("run", key=key, requests=requests, interval_s=interval_s)
    return [node.receive(timeout_s) for node in nodes]


def mismatches(
    results: Sequence[dict[str, Any]],
    loads: Sequence[list[tuple[str, list[int], int]]],
) -> int:
    """Checks failed plus outputs that differ from recomputation."""
    bad = sum(len(r["failures"]) for r in results)
    for result, requests in zip(results, loads, strict=True):
        for req_id, prompt, max_tokens in requests:
            record = result["records"].get(req_id)
            if record is None or record["status"] != FINISHED:
                continue
            bad += record["output"] != expected_output(prompt, max_tokens)
    return bad


def finished(results: Sequence[dict[str, Any]]) -> int:
    """Requests that finished normally."""
    return sum(
        r["status"] == FINISHED for x in results for r in x["records"].values()
    )


def requests_in(results: Sequence[dict[str, Any]]) -> int:
    """Requests sent (recorded or never sent)."""
    return sum(len(x["records"]) + x["unsent"] for x in results)


# ------------------------------------------------------------------ scenarios


def peer_death_and_restart(
    c: Cluster,
    *,
    prefixes: int,
    per_prefix: int,
    interval_s: float,
    **load_keys: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Peer death, then the rolling restart, on one master.

    `load_keys` go into the survivors' extra config (e.g.
    ``layerwise_load_max_blocks``).  Returns (peer_death, restart, detail).
    """
    master = c.master()
    ns = "cluster"
    a, b, cc = c.spawn("A", "B", "C")
    base_seeds = list(range(1, prefixes + 1))
    dead_seeds = list(range(101, 101 + prefixes))
    # A alone has a segment: every hot prefix lands in it.
    a.call("open", key="m1", extra=extra(master, ns), num_blocks=64)
    seeding = workload("seed", base_seeds + dead_seeds, 1)
    stored = a.call("run", key="m1", requests=seeding)
    survivor = {"num_blocks": 64, "enable_prefix_caching": False}
    for node in (b, cc):
        node.call(
            "open",
            key="m1",
            extra=extra(
                master,
                ns,
                failed_load_ttl_s=c.client_ttl_s + 5.0,
                **load_keys,
            ),
            **survivor,
        )
    survivors = (b, cc)
    base_loads = [
        workload(f"base{n.name}", base_seeds, per_prefix) for n in survivors
    ]
    baseline = run_all(survivors, "m1", base_loads, interval_s=interval_s)

    # Mid-run: A is busy with requests of its own; B and C have started.
    a.send("run", key="m1", requests=workload("busy", [900], 4, tail=200))
    dead_loads = [
        workload(f"dead{n.name}", dead_seeds, per_prefix) for n in survivors
    ]
    for node, requests in zip(survivors, dead_loads, strict=True):
        node.send("run", key="m1", requests=requests, interval_s=interval_s)
    time.sleep(interval_s)  # the first requests of each survivor are in
    a.kill()
    killed_at = time.monotonic()
    death = [node.receive(120) for node in survivors]

    per: dict[tuple[str, int], int] = {}
    for node, result, requests in zip(
        survivors, death, dead_loads, strict=True
    ):
        for req_id, prompt, _ in requests:
            seed = dead_seeds[
                [prefix(s)[0] for s in dead_seeds].index(prompt[0])
            ]
            key = (node.name, seed)
            per[key] = (
                per.get(key, 0) + (result["records"][req_id]["loads_failed"])
            )
    base_ttft = [
        r["ttft_steps"] for x in baseline for r in x["records"].values()
    ]
    death_ttft = [
        r["ttft_steps"] for x in death for r in x["records"].values()
    ]
    peer_death = {
        "requests": requests_in(death),
        "requests_finished": finished(death),
        "mismatches": mismatches(death, dead_loads)
        + mismatches(baseline, base_loads),
        "failed_loads": sum(per.values()),
        "dead_prefixes": len(dead_seeds),
        "failed_loads_per_dead_prefix_max": max(per.values()),
        "ttft_p99_ratio_vs_no_death": round(
            percentile(_ms(death), 99) / percentile(_ms(baseline), 99), 1
        ),
    }
    detail: dict[str, Any] = {
        "peer_death": {
            "seeded_requests_finished": finished([stored]),
            "baseline_requests": requests_in(baseline),
            "baseline_finished": finished(baseline),
            "baseline_loads_ok": _sum(baseline, "loads_ok"),
            "baseline_loads_failed": _sum(baseline, "loads_failed"),
            "death_loads_ok": _sum(death, "loads_ok"),
            "ttft_steps_p50": [
                percentile(base_ttft, 50),
                percentile(death_ttft, 50),
            ],
            "ttft_steps_p99": [
                percentile(base_ttft, 99),
                percentile(death_ttft, 99),
            ],
            "ttft_ms_p50": [
                round(percentile(_ms(baseline), 50), 2),
                round(percentile(_ms(death), 50), 2),
            ],
            "ttft_ms_p99": [
                round(percentile(_ms(baseline), 99), 2),
                round(percentile(_ms(death), 99), 2),
            ],
            "failed_loads_by_node_prefix": {
                f"{n}/{s}": v for (n, s), v in sorted(per.items())
            },
            "survivor_stats": [n.call("stats", key="m1") for n in survivors],
        }
    }

    # Rolling restart: a new process, a new segment, same namespace.
    (a2,) = c.spawn("A2")
    time.sleep(max(0.0, killed_at + c.client_ttl_s + 2.0 - time.monotonic()))
    a2.call("open", key="m1", extra=extra(master, ns), num_blocks=64)
    z_seeds, w_seeds = [201, 202], [301, 302]
    b.call("run", key="m1", requests=workload("zB", z_seeds, 1))
    got_b = a2.call("run", key="m1", requests=workload("zA2", z_seeds, 1))
    a2.call("run", key="m1", requests=workload("wA2", w_seeds, 1))
    got_a = b.call("run", key="m1", requests=workload("wB", w_seeds, 1))
    stale_loads = workload("stale", base_seeds + dead_seeds, 1)
    stale = a2.call("run", key="m1", requests=stale_loads)
    checks = [got_b, got_a, stale]
    restart = {
        "hits_both_directions": _hits(got_b) > 0
        and _hits(got_a) > 0
        and mismatches(
            checks,
            [
                workload("zA2", z_seeds, 1),
                workload("wB", w_seeds, 1),
                stale_loads,
            ],
        )
        == 0,
    }
    detail["restart"] = {
        "hit_tokens_b_to_new_a": _hits(got_b),
        "hit_tokens_new_a_to_b": _hits(got_a),
        "stale_hit_tokens": _hits(stale),
        "stale_failed_loads": _sum([stale], "loads_failed"),
        "finished": finished(checks),
        "requests": requests_in(checks),
    }
    return peer_death, restart, detail


def replica2(
    c: Cluster, b: Node, cc: Node, *, prefixes: int, per_prefix: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`replica_num = 2`: is the surviving replica served?"""
    master = c.master()
    ns = "replica"
    (r,) = c.spawn("R")
    conf = extra(master, ns, replica_num=2, failed_load_ttl_s=0.001)
    r.call("open", key="m2", extra=conf, num_blocks=64)
    survivor = {"num_blocks": 64, "enable_prefix_caching": False}
    b.call("open", key="m2", extra=conf, **survivor)
    seeds = list(range(401, 401 + prefixes))
    r.call("run", key="m2", requests=workload("seed", seeds, 1))
    cc.call("open", key="m2", extra=conf, **survivor)
    r.kill()
    killed_at = time.monotonic()
    loads = [workload(f"rep{n.name}", seeds, per_prefix) for n in (b, cc)]
    after = run_all((b, cc), "m2", loads, interval_s=0.005)
    time.sleep(max(0.0, killed_at + c.client_ttl_s + 2.0 - time.monotonic()))
    later_loads = [workload(f"late{n.name}", seeds, 1) for n in (b, cc)]
    later = run_all((b, cc), "m2", later_loads, interval_s=0.005)
    result = {
        "hits_after_death": _sum(after, "loads_ok"),
        "loads_failed_after_death": _sum(after, "loads_failed"),
    }
    detail = {
        "requests": requests_in(after) + requests_in(later),
        "finished": finished(after) + finished(later),
        "mismatches": mismatches(after, loads)
        + mismatches(later, later_loads),
        "hits_after_client_ttl": _sum(later, "loads_ok"),
        "loads_failed_after_client_ttl": _sum(later, "loads_failed"),
    }
    return result, detail


def hung_peer(
    c: Cluster,
    owner: Node,
    reader: Node,
    *,
    prefixes: int,
    per_prefix: int,
    interval_s: float,
    **load_keys: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The only copy lives in a peer that hangs (SIGSTOP), then resumes.

    `owner` alone has a segment and stores the hot prefixes; `reader`
    loads some of them (the baseline), then `owner` is SIGSTOPped and
    `reader` runs requests on its other prefixes; then SIGCONT, and the
    same prefixes are asked again.  `load_keys` go into both extra
    configs (e.g. ``transfer_timeout=0`` for the unbounded before).
    """
    master = c.master()
    ns = "hung"
    conf = extra(master, ns, **load_keys)
    owner.call("open", key="m4", extra=conf, num_blocks=64)
    base_seeds = list(range(601, 601 + prefixes))
    hung_seeds = list(range(701, 701 + prefixes))
    owner.call(
        "run", key="m4", requests=workload("seed", base_seeds + hung_seeds, 1)
    )
    reader.call(
        "open",
        key="m4",
        extra=conf,
        num_blocks=64,
        enable_prefix_caching=False,
    )
    base_loads = [workload("hbase", base_seeds, per_prefix)]
    baseline = run_all((reader,), "m4", base_loads, interval_s=interval_s)
    owner.stop()
    try:
        hung_loads = [workload("hung", hung_seeds, per_prefix)]
        hung = run_all(
            (reader,), "m4", hung_loads, interval_s=interval_s, timeout_s=150
        )
    finally:
        owner.resume()
    again_loads = [workload("again", hung_seeds, 1)]
    again = run_all((reader,), "m4", again_loads, interval_s=interval_s)
    result = {
        "requests": requests_in(hung) + requests_in(again),
        "requests_finished": finished(hung) + finished(again),
        "mismatches": mismatches(hung, hung_loads)
        + mismatches(again, again_loads)
        + mismatches(baseline, base_loads),
        "stalled_run_s": round(hung[0]["seconds"], 2),
        # A request with no first token by the end counts the whole run.
        "ttft_ms_p99": round(
            percentile(_ms(hung, hung[0]["seconds"] * 1e3), 99), 1
        ),
        "ttft_ms_p99_baseline": round(percentile(_ms(baseline), 99), 1),
        "loads_failed": _sum(hung, "loads_failed"),
    }
    stats = reader.call("stats", key="m4")
    detail = {
        "baseline_loads_ok": _sum(baseline, "loads_ok"),
        "hung_loads_ok": _sum(hung, "loads_ok"),
        "hung_hit_tokens": _hits(hung[0]),
        "again_hit_tokens": _hits(again[0]),
        "again_loads_failed": _sum(again, "loads_failed"),
        "again_finished": finished(again),
        "peers": stats["peers"],
        "loads_expired": stats["loads_expired"],
        "failed_keys": stats["failed_keys"],
        "illegal": stats["illegal"],
        "open_jobs": stats["open_jobs"],
        "trackers": stats["trackers"],
    }
    return result, detail


def store_full(
    c: Cluster,
    nodes: Sequence[Node],
    *,
    per_node: int,
    shared: int,
    ssd_root: Path | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sustained saves far beyond the pool's capacity, eviction on.

    16 MiB segments (Mooncake's smallest) of 128 KiB blocks: 128 blocks
    per instance.  Each request brings 2 blocks of a shared prefix and
    `OWN_BLOCKS` of its own, which it saves.  With `ssd_root` the master
    runs Mooncake's SSD tier there (a fresh master per call).
    """
    flags = (
        ("--enable_offload=true", f"--root_fs_dir={ssd_root}")
        if ssd_root is not None
        else ()
    )
    master = c.master(extra_flags=flags)
    ns = "full" if ssd_root is None else "full-ssd"
    block_tokens = 64
    width = 256  # 64 tokens x 256 floats x 4 B x 2 layers = 128 KiB
    conf = extra(master, ns, global_segment_size=SEGMENT_MIB << 20)
    for node in nodes:
        node.call(
            "open",
            key="m3",
            extra=conf,
            num_blocks=96,
            block_size=block_tokens,
            kv_width=width,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            enable_prefix_caching=False,
        )
    loads = []
    for i, node in enumerate(nodes):
        requests = []
        for n in range(per_node):
            seed = 501 + (n + i) % shared
            req = 10_000 * (i + 1) + n
            prompt = [
                *prefix(seed, 2 * block_tokens),
                *suffix(req, OWN_BLOCKS * block_tokens + 8),
            ]
            requests.append((f"full{node.name}-{n}", prompt, 2))
        loads.append(requests)
    results = run_all(nodes, "m3", loads, interval_s=0.0, timeout_s=300)
    # The oldest saves were evicted: asking again misses and recomputes.
    replay = [
        [(f"again-{r}", prompt, n) for r, prompt, n in requests[:REPLAYED]]
        for requests in loads
    ]
    again = run_all(nodes, "m3", replay, interval_s=0.0, timeout_s=300)
    stats = [n.call("stats", key="m3") for n in nodes]
    puts = [s["store"].get("put", {}) for s in stats]
    refused = sum(p.get("STORE_FULL", 0) for p in puts)
    put_keys = sum(p.get("keys", 0) for p in puts)
    asked = sum(len(x) for x in loads) * 2 * block_tokens
    hits = sum(_hits(r) for r in results)
    replayed = len(nodes) * REPLAYED * (2 + OWN_BLOCKS)
    replayed_hit = sum(_hits(r) for r in again) // block_tokens
    result = {
        "requests": requests_in(results) + requests_in(again),
        "requests_finished": finished(results) + finished(again),
        "mismatches": mismatches(results, loads) + mismatches(again, replay),
        "puts_refused": refused,
        "hit_rate": round(hits / asked, 3),
        "replay_hit_rate": round(replayed_hit / replayed, 3),
    }
    capacity = len(nodes) * (SEGMENT_MIB << 20) // (128 << 10)
    detail = {
        "capacity_blocks": capacity,
        "put_keys": put_keys,
        "put_keys_over_capacity": round(put_keys / capacity, 2),
        "lookups_missed_shared_prefix_blocks": (asked - hits) // block_tokens,
        "replayed_oldest_blocks": replayed,
        "replayed_oldest_blocks_hit": replayed_hit,
        "loads_failed": _sum(results, "loads_failed"),
        "loads_ok": _sum(results, "loads_ok"),
        "save_failures": [
            {k: v for k, v in p.items() if k not in {"keys", "ops"}}
            for p in puts
        ],
        "log_records": [s["log_records"] for s in stats],
        "seconds": [round(r["seconds"], 2) for r in results],
    }
    return result, detail


def _sum(results: Sequence[dict[str, Any]], field: str) -> int:
    return sum(int(r[field]) for x in results for r in x["records"].values())


def _hits(result: dict[str, Any]) -> int:
    return sum(
        int(r["external_hit_tokens"]) for r in result["records"].values()
    )


def _ms(
    results: Sequence[dict[str, Any]], unfinished_ms: float | None = None
) -> list[float]:
    """TTFTs in ms; a request without a first token reads `unfinished_ms`
    (None: its -1 placeholder)."""
    out = []
    for x in results:
        for r in x["records"].values():
            ms = float(r["ttft_ms"])
            out.append(unfinished_ms if ms < 0 and unfinished_ms else ms)
    return out


def _load_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The --only scenario's extra load keys (``--layerwise``)."""
    if args.layerwise:
        return {"layerwise_load_max_blocks": args.layerwise}
    return {}


def run_hung_peer(args: argparse.Namespace) -> dict[str, Any]:
    """Only ``hung_peer`` (``--only hung_peer``); the report."""
    load_keys = _load_keys(args)
    with cluster(args.client_ttl) as c:
        owner, reader = c.spawn("H", "R")
        hung, hung_detail = hung_peer(
            c,
            owner,
            reader,
            prefixes=args.prefixes,
            per_prefix=args.per_prefix,
            interval_s=args.interval,
            **load_keys,
        )
    report: dict[str, Any] = {"hung_peer": hung, "load_keys": load_keys}
    if args.detail:
        report["detail"] = {"hung_peer": hung_detail}
    return report


def run_peer_death(args: argparse.Namespace) -> dict[str, Any]:
    """Only ``peer_death`` and the restart after it (``--only
    peer_death``); the report."""
    load_keys = _load_keys(args)
    with cluster(args.client_ttl) as c:
        peer_death, restart, detail = peer_death_and_restart(
            c,
            prefixes=args.prefixes,
            per_prefix=args.per_prefix,
            interval_s=args.interval,
            **load_keys,
        )
    report: dict[str, Any] = {
        "peer_death": peer_death,
        "restart": restart,
        "load_keys": load_keys,
    }
    if args.detail:
        report["detail"] = detail
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario in one cluster run; the report (and detail)."""
    if args.only == "hung_peer":
        return run_hung_peer(args)
    if args.only == "peer_death":
        return run_peer_death(args)
    started = time.monotonic()
    with cluster(args.client_ttl) as c:
        peer_death, restart, detail = peer_death_and_restart(
            c,
            prefixes=args.prefixes,
            per_prefix=args.per_prefix,
            interval_s=args.interval,
        )
        b, cc = c.nodes[1], c.nodes[2]
        replica, replica_detail = replica2(
            c, b, cc, prefixes=args.prefixes, per_prefix=2
        )
        a2 = c.nodes[3]
        full, full_detail = store_full(
            c, (b, cc, a2), per_node=args.full_requests, shared=4
        )
        hung, hung_detail = hung_peer(
            c,
            a2,
            b,
            prefixes=args.prefixes,
            per_prefix=args.per_prefix,
            interval_s=args.interval,
        )
        if args.ssd:
            with tempfile.TemporaryDirectory(prefix="kv-ssd-") as root:
                ssd_nodes = c.spawn("S1", "S2", "S3")
                ssd, ssd_detail = store_full(
                    c,
                    ssd_nodes,
                    per_node=args.full_requests,
                    shared=4,
                    ssd_root=Path(root),
                )
    report: dict[str, Any] = {
        "peer_death": peer_death,
        "hung_peer": hung,
        "replica2": replica,
        "restart": restart,
        "store_full": full,
    }
    if args.ssd:
        report["store_full_ssd"] = ssd
    if args.detail:
        detail["replica2"] = replica_detail
        detail["store_full"] = full_detail
        detail["hung_peer"] = hung_detail
        if args.ssd:
            detail["store_full_ssd"] = ssd_detail
        detail["seconds"] = round(time.monotonic() - started, 1)
        report["detail"] = detail
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description=__doc__.split("\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--client-ttl",
        type=int,
        default=5,
        help="the masters' --client_ttl (s)",
    )
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument(
        "--interval",
        type=float,
        default=0.02,
        help="seconds between request arrivals",
    )
    parser.add_argument(
        "--full-requests",
        type=int,
        default=40,
        help="requests per instance in store_full",
    )
    parser.add_argument(
        "--ssd",
        action="store_true",
        help="also run store_full with Mooncake's SSD tier",
    )
    parser.add_argument(
        "--only",
        choices=["hung_peer", "peer_death"],
        help="run one scenario (its goals only)",
    )
    parser.add_argument(
        "--layerwise",
        type=int,
        default=0,
        help="layerwise_load_max_blocks of the --only scenario's instances",
    )
    parser.add_argument("--detail", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run and print; 1 if a goal is missed."""
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    if args.only == "hung_peer":
        hung = report["hung_peer"]
        good = hung["requests_finished"] == hung["requests"]
        return 0 if good and hung["mismatches"] == 0 else 1
    pd = report["peer_death"]
    if args.only == "peer_death":
        good = (
            pd["requests_finished"] == pd["requests"]
            and pd["mismatches"] == 0
            and pd["failed_loads_per_dead_prefix_max"] <= 1
        )
        return 0 if good else 1
    hung, full = report["hung_peer"], report["store_full"]
    ok = (
        pd["requests_finished"] == pd["requests"]
        and hung["requests_finished"] == hung["requests"]
        and hung["mismatches"] == 0
        and pd["mismatches"] == 0
        and pd["failed_loads_per_dead_prefix_max"] <= 1
        and full["requests_finished"] == full["requests"]
        and full["mismatches"] == 0
        and report["restart"]["hits_both_directions"]
        and report["replica2"]["loads_failed_after_death"] == 0
    )
    ssd = report.get("store_full_ssd")
    if ssd is not None:
        ok = ok and ssd["requests_finished"] == ssd["requests"]
        ok = ok and ssd["mismatches"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
