"""Tensor parallelism: bytes put for replicated KV, sharing across TP sizes.

``python -m benchmarks.tp --json`` starts an embedded master and runs
vLLM 0.33's real scheduler (`harness.Harness`) with tensor-parallel ranks,
each with its own WORKER-role connector and head-major KV:

* ``bytes_put_per_block``: TP=2 over a model with one KV head (both ranks
  hold identical KV) saving ``--prompts`` prompts; ``one_writer`` is the
  connector (the first rank of each replica set puts), ``every_rank``
  the same run with every rank putting (the behaviour before).  Bytes
  offered to the store's puts, over every rank, per block saved.
* ``hit_tokens``: TP=2 saves ``--prompts`` prompts of a two-KV-head
  model, TP=1 then asks for them; ``per_rank`` keys (the default) versus
  ``head_shards`` (``store_tp_size: 2``).

The harness checks every head slice of every block after every step, so
a hit that loaded wrong bytes fails the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import attrs

from benchmarks.counting import CountingStore

CONNECTOR = "connector.MooncakeLifecycleConnector"
LENGTH = 128


def _harness(extra: dict[str, Any], tp: int, heads: int) -> Any:
    from harness import Harness  # noqa: PLC0415

    return Harness(
        CONNECTOR,
        extra_config=extra,
        num_blocks=96,
        tp_size=tp,
        kv_heads=heads,
        max_num_batched_tokens=256,
    )


def _run(h: Any, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if h.is_idle():
            break
        if not h.step().scheduled:
            time.sleep(0.002)
    h.check()


def _prompt(seed: int) -> list[int]:
    from harness.prompts import arithmetic_prompt  # noqa: PLC0415

    return arithmetic_prompt(seed, LENGTH)


def bytes_per_block(master: Any, prompts: int, *, every_rank: bool) -> float:
    """TP=2, one KV head: bytes put over every rank per block saved."""
    from harness.extra_config import store_extra  # noqa: PLC0415

    h = _harness(store_extra(master, uuid.uuid4().hex[:12]), 2, 1)
    try:
        counters = []
        for connector, _ in h.ranks:
            worker = connector.worker_side
            lane = worker.lanes[0]
            if every_rank:
                worker.lanes = (attrs.evolve(lane, writes=True),)
            counter = CountingStore(worker._store, lane.block_bytes)  # noqa: SLF001
            worker._store = counter  # noqa: SLF001
            counters.append(counter)
        for i in range(prompts):
            h.add_request(f"r{i}", _prompt(i), max_tokens=2)
        _run(h)
        blocks = prompts * (LENGTH // h.block_size)
        return sum(c.bytes_put for c in counters) / blocks
    finally:
        h.close()


def hit_tokens(master: Any, prompts: int, *, shared: bool) -> int:
    """TP=2 saves, TP=1 asks: tokens the TP=1 instance loaded."""
    from harness.extra_config import store_extra  # noqa: PLC0415

    more = {"store_tp_size": 2} if shared else {}
    extra = store_extra(master, uuid.uuid4().hex[:12], **more)
    saver = _harness(extra, 2, 2)
    try:
        for i in range(prompts):
            saver.add_request(f"a{i}", _prompt(i), max_tokens=2)
        _run(saver)
    finally:
        saver.close()
    loader = _harness(extra, 1, 2)
    try:
        for i in range(prompts):
            loader.add_request(f"b{i}", [*_prompt(i), 5], max_tokens=2)
        _run(loader)
        return sum(loader.external_hits.values())
    finally:
        loader.close()


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and print them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args(argv)
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    with EmbeddedMaster() as master:
        doc = {
            "benchmark": "tp",
            "prompts": args.prompts,
            "prompt_tokens": LENGTH,
            "bytes_put_per_block": {
                "one_writer": bytes_per_block(
                    master, args.prompts, every_rank=False
                ),
                "every_rank": bytes_per_block(
                    master, args.prompts, every_rank=True
                ),
            },
            "hit_tokens": {
                "asked": args.prompts * LENGTH,
                "per_rank": hit_tokens(master, args.prompts, shared=False),
                "head_shards": hit_tokens(master, args.prompts, shared=True),
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
