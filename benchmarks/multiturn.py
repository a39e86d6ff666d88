"""Multi-turn chat over two instances: what ``save_decode_cache`` buys.

``python -m benchmarks.multiturn --json`` starts an embedded master and
runs one seeded chat workload twice, each time on two fresh instances of
vLLM 0.33's real scheduler (`harness.Harness`, the connector loaded by
module path, vLLM's own prefix cache on):

* ``decode_cache``: ``save_decode_cache`` on, generated tokens' blocks are
  saved as they fill;
* ``prompt_only``: only prompt blocks are saved.

Every conversation has ``--turns`` turns; turn ``k``'s prompt is the whole
history (every earlier message and answer) plus a new user message, and
each turn lands on either instance (seeded).  Per mode it prints:

* ``hit_rate``: prompt tokens not computed (vLLM's local hit plus the
  store's) over all prompt tokens of turns after the first;
* ``tokens_recomputed``: prompt tokens computed in those turns;
* ``bytes_put``: bytes offered to the store's puts over the run (whole
  blocks, duplicates included).

The harness checks every computed block's KV byte for byte after every
step, so a wrong hit fails the run rather than improving it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import uuid
from typing import Any

from benchmarks.counting import CountingStore

CONNECTOR = "connector.MooncakeLifecycleConnector"
BLOCK = 16


class _CountingStore(CountingStore):
    """`CountingStore` that also carries the instance's local hits."""

    local_hits: dict[str, int]


def _instance(
    extra: dict[str, Any], num_blocks: int
) -> tuple[Any, _CountingStore]:
    """A harness whose store puts are counted and local hits recorded."""
    from harness import Harness  # noqa: PLC0415
    from harness.spy import shadow_method  # noqa: PLC0415

    h = Harness(
        CONNECTOR,
        extra_config=extra,
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=2048,
        max_num_batched_tokens=256,
        check_every_step=True,
    )
    worker = h.worker_connector.worker_side
    spec = h.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    counter = _CountingStore(
        worker._store,  # noqa: SLF001
        spec.page_size_bytes * len(h.layer_names),
    )
    worker._store = counter  # noqa: SLF001
    local: dict[str, int] = {}

    def spy(original: Any) -> Any:
        def matched(request: Any, num_computed_tokens: int) -> Any:
            local[request.request_id] = num_computed_tokens  # local hit
            return original(request, num_computed_tokens)

        return matched

    shadow_method(h.scheduler_connector, "get_num_new_matched_tokens", spy)
    counter.local_hits = local
    return h, counter


def _run(h: Any, max_steps: int = 20_000) -> None:
    import time  # noqa: PLC0415

    for _ in range(max_steps):
        if h.is_idle():
            break
        if not h.step().scheduled:
            time.sleep(0.002)
    h.check()


def run_mode(
    master: Any,
    *,
    decode_cache: bool,
    conversations: int,
    turns: int,
    seed: int,
) -> dict[str, Any]:
    """One mode on two fresh instances; the figures of turns after the
    first."""
    from harness.extra_config import store_extra  # noqa: PLC0415

    rng = random.Random(seed)
    extra = store_extra(
        master,
        uuid.uuid4().hex[:12],
        save_decode_cache=decode_cache,
    )
    instances = [_instance(extra, 512) for _ in range(2)]
    history = [
        [rng.randrange(3, 500) for _ in range(40)]
        for _ in range(conversations)
    ]
    prompt_tokens = cached = 0
    external = 0
    try:
        for turn in range(turns):
            placed: list[tuple[Any, Any, str, int]] = []
            for c in range(conversations):
                message = [
                    rng.randrange(3, 500) for _ in range(rng.randrange(8, 24))
                ]
                prompt = [*history[c], *message] if turn else history[c]
                history[c] = prompt
                h, counter = instances[rng.randrange(2)]
                req_id = f"c{c}t{turn}"
                h.add_request(req_id, prompt, max_tokens=rng.randrange(24, 48))
                placed.append((h, counter, req_id, c))
            for h, _ in instances:
                _run(h)
            for h, counter, req_id, c in placed:
                if turn:
                    prompt_tokens += h.requests[req_id].num_prompt_tokens
                    hit = h.external_hits[req_id]
                    cached += counter.local_hits.get(req_id, 0) + hit
                    external += hit
                history[c] = [*history[c], *h.output_token_ids(req_id)]
        bytes_put = sum(counter.bytes_put for _, counter in instances)
    finally:
        for h, _ in instances:
            h.close()
    return {
        "hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "tokens_recomputed": prompt_tokens - cached,
        "prompt_tokens": prompt_tokens,
        "store_hit_tokens": external,
        "bytes_put": bytes_put,
    }


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print their figures side by side."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=25)
    args = parser.parse_args(argv)
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    modes = {"decode_cache": True, "prompt_only": False}
    results = {}
    with EmbeddedMaster() as master:
        for name, on in modes.items():
            results[name] = run_mode(
                master,
                decode_cache=on,
                conversations=args.conversations,
                turns=args.turns,
                seed=args.seed,
            )
    doc = {
        "benchmark": "multiturn",
        "conversations": args.conversations,
        "turns": args.turns,
        "seed": args.seed,
        "block_size": BLOCK,
        **{
            figure: {name: results[name][figure] for name in modes}
            for figure in (
                "hit_rate",
                "tokens_recomputed",
                "bytes_put",
                "store_hit_tokens",
                "prompt_tokens",
            )
        },
    }
    if args.json:
        print(json.dumps(doc))
    else:
        for key, value in doc.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
