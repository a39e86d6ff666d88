"""Hit tokens and loaded bytes: ours vs vLLM's MooncakeStoreConnector rules.

``python -m benchmarks.hybrid_side_by_side --json`` (in ``.venv``) runs
one harness scenario per hybrid layout with a recurrent group (full
attention + Mamba, and full attention + sliding window + Mamba): engine A
(`harness.hybrid.HybridHarness`, vLLM 0.33's real scheduler) saves four
128-token prompts through our connector, then each consumer prompt runs
alone on a fresh engine B, which reports its hit tokens and the blocks
and bytes its worker loaded, per group.

vLLM 0.33's own ``MooncakeStoreConnector`` cannot be driven in the
harness: its worker records a ``torch.cuda.Event`` on every save and
needs vLLM's tensor/context-parallel process groups, and this machine has
neither CUDA nor those groups.  Its decisions are taken instead from its
own code on the same store contents: the presence of every (group, block)
key after A's saves feeds vLLM's ``MooncakeStoreCoordinator`` exactly as
its worker's ``lookup`` does (hit length, recomputed below the prompt
end on a full hit), and its ``load_mask`` at that hit gives the blocks it
would load per group.  Its save rules for these groups match ours (every
full-attention block, the window at a boundary, recurrent states only
from vLLM's boundary-state hand-offs), so the same stored contents are
what it would have stored.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import uuid
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from connector.ops.master import EmbeddedMaster
from harness.extra_config import store_extra
from harness.hybrid import HybridHarness
from harness.prompts import arithmetic_prompt as prompt

CONNECTOR = "connector.MooncakeLifecycleConnector"
BS = 16
LAYOUTS = {
    "full+mamba": ("full", "mamba"),
    "full+swa+mamba": ("full", "sliding", "mamba"),
}


def _consumer_prompts() -> dict[str, list[int]]:
    diverging = prompt(3, 128)
    diverging[5 * BS + 3] = 499
    return {
        "same+new": [*prompt(1, 128), 7, 8],
        "full": prompt(2, 128),
        "diverging in block 5": diverging,
        "120 of 128 + new": [*prompt(4, 128)[:120], 5, 6, 7, 8],
    }


def _run(h: HybridHarness, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if h.is_idle():
            break
        if not h.step().scheduled:
            import time  # noqa: PLC0415

            time.sleep(0.005)
    h.check()


def _tally(worker: Any) -> collections.Counter[tuple[str, int, str]]:
    """Every count the worker's stats hand out, kept (vLLM takes them)."""
    totals: collections.Counter[tuple[str, int, str]] = collections.Counter()
    take = worker.take_moved

    def take_and_tally() -> dict[tuple[str, int, str], int]:
        moved = take()
        totals.update(moved)
        return moved  # type: ignore[no-any-return]

    worker.take_moved = take_and_tally
    return totals


def _present(h: HybridHarness, hashes: list[bytes]) -> list[list[bool]]:
    """Per group, per block hash: whether the store holds its key."""
    lookup = h.scheduler_connector.scheduler_side._lookup  # noqa: SLF001
    return [
        list(lookup.client.exists(scheme.keys(hashes)).succeeded)
        for scheme in lookup.schemes
    ]


def _theirs(
    h: HybridHarness, hashes: list[bytes], num_tokens: int
) -> dict[str, Any]:
    """vLLM's MooncakeStoreConnector lookup and load mask, same contents."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (  # noqa: E501, PLC0415
        ExternalCachedBlockPool,
        MooncakeStoreCoordinator,
    )

    coord = MooncakeStoreCoordinator(
        list(h.kv_cache_config.kv_cache_groups), BS, BS
    )
    present = _present(h, hashes)
    exists = {
        (g, bytes(hashes[i]))
        for g, flags in enumerate(present)
        for i, ok in enumerate(flags)
        if ok
    }
    pool = ExternalCachedBlockPool(BS, exists)
    token_len = coord.align_lookup_length(num_tokens)
    _, hit = coord.find_longest_cache_hit(hashes, token_len, pool)
    if hit >= num_tokens:
        usable = coord.align_lookup_length(num_tokens - 1)
        _, hit = coord.find_longest_cache_hit(hashes, usable, pool)
    masks = coord.load_mask(hashes, hit) if hit else [[] for _ in present]
    return {"hit": hit, "blocks": [sum(m) for m in masks]}


def _scenario(master: EmbeddedMaster, kinds: tuple[str, ...]) -> list[Any]:
    extra = store_extra(master, f"sbs-{uuid.uuid4().hex[:8]}")
    made = []
    a = HybridHarness(
        CONNECTOR, extra_config=extra, kinds=kinds, kv_role="kv_producer"
    )
    made.append(a)
    for seed in (1, 2, 3, 4):
        a.add_request(f"a{seed}", prompt(seed, 128), max_tokens=3)
    _run(a)
    rows = []
    try:
        for name, tokens in _consumer_prompts().items():
            b = HybridHarness(
                CONNECTOR,
                extra_config=extra,
                kinds=kinds,
                kv_role="kv_consumer",
            )
            made.append(b)
            worker = b.worker_connector.worker_side
            totals = _tally(worker)
            request = b.add_request("b", tokens, max_tokens=2)
            hashes = list(request.block_hashes)
            theirs = _theirs(b, hashes, len(tokens))
            _run(b)
            worker.take_moved()
            lanes = worker.lanes
            ours_blocks = [
                totals[("load", g, "blocks")] for g in range(len(kinds))
            ]
            rows.append(
                {
                    "prompt": name,
                    "tokens": len(tokens),
                    "ours_hit_tokens": b.external_hit_tokens,
                    "theirs_hit_tokens": theirs["hit"],
                    "ours_loaded_blocks": ours_blocks,
                    "theirs_loaded_blocks": theirs["blocks"],
                    "ours_loaded_bytes": sum(
                        n * lane.block_bytes
                        for n, lane in zip(ours_blocks, lanes, strict=True)
                    ),
                    "theirs_loaded_bytes": sum(
                        n * lane.block_bytes
                        for n, lane in zip(
                            theirs["blocks"], lanes, strict=True
                        )
                    ),
                }
            )
    finally:
        for h in reversed(made):
            h.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.hybrid_side_by_side``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with EmbeddedMaster() as master:
        doc = {
            "benchmark": "hybrid hits: ours vs MooncakeStoreConnector rules",
            "block_size": BS,
            "layouts": {
                name: _scenario(master, kinds)
                for name, kinds in LAYOUTS.items()
            },
        }
    same = all(
        r["ours_hit_tokens"] == r["theirs_hit_tokens"]
        and r["ours_loaded_bytes"] == r["theirs_loaded_bytes"]
        for rows in doc["layouts"].values()
        for r in rows
    )
    doc["same_hits_and_bytes"] = same
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        for name, rows in doc["layouts"].items():
            for r in rows:
                sys.stdout.write(
                    f"{name:15} {r['prompt']:22} hit {r['ours_hit_tokens']:4}"
                    f" vs {r['theirs_hit_tokens']:4}, bytes"
                    f" {r['ours_loaded_bytes']:7} vs"
                    f" {r['theirs_loaded_bytes']:7} (blocks"
                    f" {r['ours_loaded_blocks']} vs"
                    f" {r['theirs_loaded_blocks']})\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
