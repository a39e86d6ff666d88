"""The operators' path: ``kv-lifecycle master`` + vLLM's OpenAI server.

One scenario, as an operator would run it (vllm-cpu 0.32, tiny random
model, token-id prompts):

1. ``kv-lifecycle master`` starts a loopback master and prints the
   ``--kv-transfer-config`` JSON, which names the connector only through
   the plugin (no ``kv_connector_module_path``; the server's working
   directory is outside the repository);
2. servers A and B (``python -m vllm.entrypoints.openai.api_server``)
   start on that master; A takes ``N_LOAD`` concurrent streaming
   ``/v1/completions`` sharing prefixes, about 15 % of clients
   disconnecting mid-stream, on a KV pool small enough to preempt; the
   master is SIGKILLed once a third of them ended, stays down
   ``MASTER_DOWN_S`` and is restarted on the same ports;
3. sharing comes back: a fresh prompt computed by A is loaded by B (B's
   ``vllm:external_prefix_cache_hits_total`` rises; the seconds it took
   are reported); then A computes fresh probe prompts (saved to the
   restarted master) and B, which was up before the restart, must return
   A's greedy tokens with external prefix-cache hits for every probe.

Checks: every store client of both servers has its transfer metadata
back in the restarted master's metadata server, and each server counted
restoring it (``vllm:kv_lifecycle_store_faults_total``); every request
ends (completed or disconnected by its client),
``/health`` is 200 on every poll, no ERROR or traceback in either log,
``vllm:kv_lifecycle_*`` metrics are exported, and at shutdown each
connector half of both servers holds no tracker and no job.
"""

import asyncio
import json
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from harness.prompts import random_tokens
from tests.connector_helpers import vllm_cpu_missing

if reason := vllm_cpu_missing():
    pytest.skip(reason, allow_module_level=True)

aiohttp = pytest.importorskip("aiohttp")

from connector.ops.master import process_alive  # noqa: E402
from connector.store.metadata import metadata_keys  # noqa: E402
from e2e.make_model import ensure_model  # noqa: E402
from e2e.serving import (  # noqa: E402
    ApiServer,
    MasterCommand,
    ServerSpec,
    free_port,
    labelled_sum,
    log_problems,
    plugin_missing,
    shutdown_reports,
    teardown_noise,
)

pytestmark = [pytest.mark.e2e, pytest.mark.mooncake, pytest.mark.slow]

N_LOAD = 300
DISCONNECT_RATE = 0.15
N_PREFIXES = 8
PREFIX_TOKENS = 64  # two blocks of 32, shared by every eighth request
MAX_TOKENS = 48
N_PROBES = 16
PROBE_TOKENS = 16
REQUEST_TIMEOUT_S = 180
KILL_AFTER = N_LOAD // 3  # requests ended before the master is killed
MASTER_DOWN_S = 8.0  # as an operator's restart (issue 31)
SHARING_TIMEOUT_S = 60.0  # sharing is back within 10 s on an idle machine
# How long a new request is held back for its store lookup (default
# 50 ms).  On a starved 2-core machine (two servers, their engine cores
# and workers, the test) the lookup thread can wait past 50 ms for the
# CPU: every probe was then admitted as a miss without its lookup ever
# reaching the store (a CI run at 537e06d: 0 hits on 16 probes, 2
# exists calls in all).  The test is about sharing after a restart, so
# it gives lookups a bound that CPU starvation does not reach.
LOOKUP_TIMEOUT_MS = 2000


def load_prompts(seed=0):
    """(prompt, disconnect after n chunks or None) per request."""
    rng = random.Random(seed)  # noqa: S311 - test data
    prefixes = [
        random_tokens(rng, PREFIX_TOKENS, low=3, vocab=512)
        for _ in range(N_PREFIXES)
    ]
    plan = []
    for i in range(N_LOAD):
        tail = random_tokens(rng, rng.randrange(8, 60), low=3, vocab=512)
        cut = rng.randrange(0, 8) if rng.random() < DISCONNECT_RATE else None
        plan.append((prefixes[i % N_PREFIXES] + tail, cut))
    return plan


def probe_prompts():
    """Fresh prompts (3-5 blocks) that the load never sent."""
    rng = random.Random(4242)  # noqa: S311
    return [
        random_tokens(rng, 96 + 9 * i, low=3, vocab=512)
        for i in range(N_PROBES)
    ]


class HealthWatch:
    """Polls every server's /health until stopped; keeps every answer."""

    def __init__(self, period_s=0.25):
        self.period_s = period_s
        self.servers = []
        self.polls = 0
        self.failures = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, server):
        self.servers = [*self.servers, server]

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self):
        while not self._stop.wait(self.period_s):
            for server in self.servers:
                status = server.health()
                self.polls += 1
                if status != 200:
                    self.failures.append(
                        (time.monotonic(), server.url, status)
                    )


async def stream_one(session, url, model, prompt, cut):
    """One streaming completion; returns ("completed", tokens) or
    ("disconnected", chunks seen) or raises."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens = []
    finish = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if cut == 0:
            resp.close()  # gone before the first token
            return "disconnected", 0
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if line == b"data: [DONE]":
                assert finish == "length", finish
                return "completed", tokens
            choice = json.loads(line[5:])["choices"][0]
            tokens.extend(choice.get("token_ids") or [None])
            finish = choice.get("finish_reason") or finish
            if cut is not None and len(tokens) >= cut:
                resp.close()  # the client goes away mid-stream
                return "disconnected", len(tokens)
    return "no [DONE]", tokens


async def drive_load(url, model, plan, on_ended):
    """All of ``plan`` at once; ``on_ended(n)`` after each request ends."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    ended = 0

    async def run(prompt, cut):
        nonlocal ended
        try:
            return await stream_one(session, url, model, prompt, cut)
        finally:
            ended += 1
            await on_ended(ended)

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        return await asyncio.gather(
            *(run(prompt, cut) for prompt, cut in plan),
            return_exceptions=True,
        )


async def complete_all(url, model, prompts):
    """Greedy non-streaming completions; token ids per prompt."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": PROBE_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            async with session.post(
                f"{url}/v1/completions", json=body
            ) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def wait_drained(server, timeout_s=30.0):
    """Until no request runs or waits (aborts settle asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m.get("vllm:num_requests_running", 1) == 0
            and m.get("vllm:num_requests_waiting", 1) == 0
        ):
            return m
        time.sleep(0.25)
    pytest.fail(f"{server.url} still has requests after {timeout_s} s")


def put_bytes(server):
    """Bytes ``server``'s connector has stored so far."""
    return labelled_sum(
        server.metrics_text(),
        "vllm:kv_lifecycle_store_bytes_total",
        operation="put",
    )


def external_hits(server):
    """Prompt tokens ``server`` has loaded from the store so far."""
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0)


def wait_sharing_again(a, b, model, timeout_s=SHARING_TIMEOUT_S):
    """Fresh prompts, computed by ``a`` then sent to ``b``, until ``b``
    loads one from the store; seconds it took.

    After a master restart each Mooncake client re-mounts its segment on
    its own heartbeat (about 1-2 s), and a breaker opened by the outage
    closes only on its next probe: saves and loads made before that miss
    (best effort).  Sharing through the new master starts after this.
    """
    begin = time.monotonic()
    rng = random.Random(77)  # noqa: S311 - test data
    errors: list[str] = []  # a probe that failed is tried again, and told
    while time.monotonic() - begin < timeout_s and len(errors) < 5:
        prompt = [rng.randrange(3, 512) for _ in range(96)]
        try:
            asyncio.run(complete_all(a.url, model, [prompt]))
            wait_drained(a)
            before = external_hits(b)
            asyncio.run(complete_all(b.url, model, [prompt]))
            hits = wait_drained(b)["vllm:external_prefix_cache_hits_total"]
        except (
            TimeoutError,
            AssertionError,
            OSError,
            aiohttp.ClientError,
        ) as exc:
            errors.append(f"{time.monotonic() - begin:.1f} s: {exc!r}"[:500])
            print("sharing probe failed, trying again:", errors[-1])
            time.sleep(0.5)
            continue
        if hits > before:
            return time.monotonic() - begin
        time.sleep(0.25)
    pytest.fail(
        f"{b.url} loaded nothing {a.url} computed {timeout_s} s after "
        f"the master restart (failed probes: {errors})"
    )


def client_names(server):
    """The store clients ``server``'s connector halves opened."""
    return re.findall(
        r"Mooncake store client (\S+) connected", server.log_text()
    )


def metadata_status(url, key):
    """The metadata server's HTTP status for ``key``."""
    address = f"{url}?key={urllib.parse.quote(key, safe='')}"
    try:
        with urllib.request.urlopen(address, timeout=2) as resp:  # noqa: S310
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_metadata_back(servers, url, timeout_s=10.0):
    """Until every store client of ``servers`` has its transfer metadata
    in the restarted master's metadata server; the keys still missing."""
    keys = [
        key
        for server in servers
        for name in client_names(server)
        for key in metadata_keys(name)
    ]
    assert len(keys) == 2 * 2 * len(servers), keys  # two clients each
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [k for k in keys if metadata_status(url, k) != 200]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.25)


def check_metadata_back(servers, config):
    """Every client's transfer metadata, which the restarted master's
    metadata server had forgotten, is back (issue 31: the lookup
    clients' never came back), and each server counted the restore."""
    url = config["kv_connector_extra_config"]["metadata_server"]
    assert wait_metadata_back(servers, url) == []
    for server in servers:
        restored = labelled_sum(
            server.metrics_text(),
            "vllm:kv_lifecycle_store_faults_total",
            kind="metadata_restored",
        )
        assert restored > 0, server.url


def restart_master(ports, namespace, log_path, attempts=5):
    """A new ``kv-lifecycle master`` on the crashed one's ports."""
    rpc, http, metrics = ports
    args = [
        f"--rpc-port={rpc}",
        f"--http-port={http}",
        f"--metrics-port={metrics}",
        f"--namespace={namespace}",
        "--global-segment-size=64MiB",
        "--local-buffer-size=16MiB",
    ]
    for attempt in range(attempts):
        try:
            return MasterCommand(args, log_path).start()
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)  # the old sockets may linger a moment
    raise AssertionError  # pragma: no cover


def start_master(namespace, log_path):
    master = MasterCommand(
        [
            f"--namespace={namespace}",
            "--global-segment-size=64MiB",
            "--local-buffer-size=16MiB",
        ],
        log_path,
    ).start()
    config = master.config
    assert config["kv_connector"] == "MooncakeLifecycleConnector"
    assert "kv_connector_module_path" not in config
    assert config["kv_load_failure_policy"] == "recompute"
    print("kv-lifecycle master printed:", json.dumps(config))
    return master


def load_with_master_crash(server, model, master, namespace, tmp_path):
    """The load on ``server``; the master dies a third of the way in."""
    crash = {}

    async def on_ended(n):
        if n != KILL_AFTER:
            return
        crash["kill_rc"] = await asyncio.to_thread(master.kill_master)
        await asyncio.sleep(MASTER_DOWN_S)
        crash["restarted"] = await asyncio.to_thread(
            restart_master,
            master.ports,
            namespace,
            tmp_path / "master-restarted.log",
        )
        crash["answering_at"] = time.monotonic()

    plan = load_prompts()
    t_load = time.monotonic()
    results = asyncio.run(drive_load(server.url, model, plan, on_ended))
    load_s = time.monotonic() - t_load
    assert "restarted" in crash, "the master was never killed and restarted"
    return plan, results, load_s, crash


def check_every_request_ended(plan, results):
    """Completed with all its tokens, or cut off by its own client."""
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], errors[:3]
    for (prompt, cut), (outcome, got) in zip(plan, results, strict=True):
        if cut is None:
            assert outcome == "completed", (outcome, len(prompt))
            assert len(got) == MAX_TOKENS
        else:
            assert outcome == "disconnected", (outcome, cut)
    disconnected = [r[0] for r in results].count("disconnected")
    assert 0.08 * N_LOAD < disconnected < 0.25 * N_LOAD
    return disconnected


def check_clean_shutdown(servers):
    """SIGTERM: exit 0, clean logs, each half held nothing at shutdown."""
    rcs = [server.stop() for server in reversed(servers)]
    assert rcs == [0] * len(servers), [s.tail() for s in servers]
    noise = 0
    for server in servers:
        log = server.log_text()
        assert log_problems(log) == [], server.log_path
        noise += len(teardown_noise(log))
        reports = shutdown_reports(log)
        halves = sorted(half for half, *_ in reports)
        assert halves == ["scheduler", "worker"], reports
        for half, pid, trackers, jobs in reports:
            assert (trackers, jobs) == (0, 0), (server.url, half, pid)
    return noise


def with_lookup_bound(config):
    """``config`` with ``LOOKUP_TIMEOUT_MS`` as the lookup hold-back."""
    extra = dict(config["kv_connector_extra_config"])
    extra["lookup_timeout_ms"] = LOOKUP_TIMEOUT_MS
    return {**config, "kv_connector_extra_config": extra}


def lookup_outcomes(server):
    """The server's admission lookups by event (a failure's context)."""
    text = server.metrics_text()
    return {
        event: labelled_sum(
            text,
            "vllm:kv_lifecycle_transitions_total",
            table="admission-lookup",
            event=event,
        )
        for event in ("ask", "know", "answer", "time_out", "drop")
    }


def serve(model, config, log_path):
    # The installed package provides the connector (by plugin name);
    # PYTHONPATH is kept so that a checkout run with PYTHONPATH=$PWD
    # serves its own code rather than the editable install's.
    return ApiServer(
        ServerSpec(
            model=model,
            kv_transfer_config=config,
            port=free_port(),
            keep_pythonpath=True,
        ),
        log_path,
        cwd=log_path.parent,  # outside the repository
    ).start()


def test_openai_server_by_plugin_name_survives_load_and_master_crash(
    tmp_path, master_binary
):
    if reason := plugin_missing():
        pytest.fail(reason)
    begin = time.monotonic()
    model = str(ensure_model("tiny", seed=0))
    namespace = f"serving-{tmp_path.name}"
    master = start_master(namespace, tmp_path / "master.log")
    config = with_lookup_bound(master.config)
    servers = []
    restarted = None
    health = HealthWatch().start()
    try:
        a = serve(model, config, tmp_path / "server-a.log")
        servers.append(a)
        health.watch(a)
        b = serve(model, config, tmp_path / "server-b.log")
        servers.append(b)
        health.watch(b)
        plan, results, load_s, crash = load_with_master_crash(
            a, model, master, namespace, tmp_path
        )
        restarted = crash["restarted"]
        disconnected = check_every_request_ended(plan, results)
        assert with_lookup_bound(restarted.config) == config  # same ports
        assert restarted.master_pid != master.master_pid
        after_load = wait_drained(a)
        assert after_load["vllm:num_preemptions_total"] > 0

        # Once both servers' clients are back on the restarted master,
        # a prompt A computes is loaded by B (issue 31: it never was) ...
        sharing_s = wait_sharing_again(a, b, model)
        # An upper bound: the first try waits for the rest of the load.
        since_restart_s = time.monotonic() - crash["answering_at"]
        check_metadata_back(servers, config)
        # ... and so is every fresh probe A computes: same greedy tokens.
        probes = probe_prompts()
        tokens_a = asyncio.run(complete_all(a.url, model, probes))
        wait_drained(a)
        hits_before = external_hits(b)
        tokens_b = asyncio.run(complete_all(b.url, model, probes))
        assert tokens_b == tokens_a
        hits_b = (
            wait_drained(b)["vllm:external_prefix_cache_hits_total"]
            - hits_before
        )
        # Each probe has two to seven full blocks of 32 tokens that B
        # can load; saves are best effort, so ask for one on average.
        assert hits_b >= N_PROBES * 32, (hits_b, lookup_outcomes(b))
        for server in servers:
            text = server.metrics_text()
            for family in (
                "vllm:kv_lifecycle_transitions_total",
                "vllm:kv_lifecycle_store_operations_total",
            ):
                assert family in text, (server.url, family)
        health.stop()
        assert health.failures == []
        assert health.polls > 20
        noise = check_clean_shutdown(servers)
        print(
            json.dumps(
                {
                    "requests": N_LOAD,
                    "completed": N_LOAD - disconnected,
                    "disconnected": disconnected,
                    "load_s": round(load_s, 1),
                    "preemptions": after_load["vllm:num_preemptions_total"],
                    "identical_probe_prompts": len(probes),
                    "b_sharing_again_after_load_s": round(sharing_s, 1),
                    "b_sharing_again_after_restart_s_at_most": round(
                        since_restart_s, 1
                    ),
                    "b_external_prefix_cache_hits_after_restart": hits_b,
                    "health_polls": health.polls,
                    "server_startup_s": [
                        round(s.startup_s, 1) for s in servers
                    ],
                    "vllm_teardown_noise_lines": noise,
                    "total_s": round(time.monotonic() - begin, 1),
                }
            )
        )
    finally:
        health.stop()
        for server in servers:
            server.stop(timeout_s=30)
        for command in (restarted, master):
            if command is not None:
                command.stop()
    assert restarted.stop() == 0  # SIGTERM: a clean exit ...
    for pid in (master.master_pid, restarted.master_pid):
        assert not process_alive(pid)  # ... and no master left behind
