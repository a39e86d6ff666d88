"""Save tail: from the end of a prefill's forward pass to its save done.

``python -m benchmarks.layerwise_save --json`` starts an embedded master
and one ``StoreClient`` and plays a 2048-token prefill (128 blocks of 16
tokens) through a `WorkerSide` over CPU KV tensors of a realistic shape
(32 layers, K/V-first, 8 KV heads of 128, bf16 stored as 2-byte words:
2 MiB per block over every layer).  The forward pass is played as the
model runner plays it: per layer, ``wait_for_layer_load``, a pause of
``--layer-ms`` standing in for the layer's compute (the forward thread
releases the GIL then, as it does while a GPU computes), the layer's KV
written for the prompt's blocks, ``save_kv_layer``; then
``wait_for_save``.  Three set-ups, alternating within each repetition:

- ``zero_copy``: today's host path (the put reads the KV tensors; it
  starts in ``wait_for_save``);
- ``staged``: today's CUDA path minus the device copies (gather into
  staging, then put, all after the forward pass);
- ``layerwise``: ``layerwise_save_blocks`` = the prompt's blocks: each
  layer is gathered into staging as its ``save_kv_layer`` runs; the put
  starts once the last layer is in.

With ``--shards N`` the KV is head-major and stored head-sharded (the
``store_tp_size`` layout: N objects per block, one per slice of the KV
heads; this worker holds all N, as a rank of a smaller TP size does):
each set-up's lane is `connector.worker.shards.group_lane`'s, and a
layer-wise save gathers the shards side by side.  With ``--groups G``
the layers are dealt round-robin to G KV cache groups (a hybrid model:
one lane and one store object per group and block, each save job listing
(group, block) pairs); a layer-wise save gathers the groups side by side.

Per set-up, medians over ``--reps``: ``forward_ms`` (first layer to the
end of ``wait_for_save``) and ``save_tail_ms`` (end of ``wait_for_save``
to the save job's completion, polled every 0.2 ms as a runner would),
and the tail's ratio to ``staged``'s.  Every save is checked: the store
holds each block's final bytes.  Absolute figures depend on the machine
(the store's put is a memcpy into this process's own segment here).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import attrs
import torch

from connector.config import MiB
from connector.metadata import ConnectorMeta, JobKind, TransferJob
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.parallel import ShardKeys, TPPlan
from connector.store import Regions, StoreClient
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.shards import group_lane
from connector.worker.side import WorkerSide
from connector.worker.transfer import KVLayout

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16
TOKENS = 2048
VARIANTS = ("zero_copy", "staged", "layerwise")
POLL_S = 0.0002


class Bench:
    """One prefill's KV and a worker per set-up over it."""

    def __init__(
        self,
        client: StoreClient,
        *,
        layers: int,
        heads: int,
        tokens: int,
        shards: int = 1,
        groups: int = 1,
    ) -> None:
        self.client = client
        self.blocks = tokens // BLOCK
        self.layers = layers
        self.heads = heads
        self.shards = shards
        self.groups = groups
        shape = (
            (2, self.blocks, BLOCK, heads, HEAD_DIM)
            if shards == 1
            else (2, self.blocks, heads, BLOCK, HEAD_DIM)  # head-major
        )
        # int16: bf16's width, cheap to fill with exact values.
        self.kv = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(
                shape, dtype=torch.int16
            )
            for i in range(layers)
        }
        block_bytes = sum(
            t.numel() // self.blocks * 2 for t in self.kv.values()
        )
        self.block_bytes = block_bytes
        self.scheme = KeyScheme(
            namespace="bench-layerwise-save",
            model="m",
            tp_rank=0,
            tp_size=1,
            layout=KeyLayout(
                "int16", block_tokens=BLOCK, block_bytes=block_bytes
            ),
        )
        self.workers = {
            "zero_copy": self._worker(None, 0),
            "staged": self._worker(self.blocks, 0),
            "layerwise": self._worker(self.blocks, self.blocks),
        }
        self.registered = [
            p for w in self.workers.values() for p in w.registered
        ]
        self.job_id = 0
        self.step = 0

    def _group_layers(self, group: int) -> dict[str, torch.Tensor]:
        """The layers of KV cache group `group` (dealt round-robin)."""
        names = list(self.kv)[group :: self.groups]
        return {name: self.kv[name] for name in names}

    def _worker(self, staging: int | None, layerwise: int) -> WorkerSide:
        if self.shards == 1 and self.groups == 1:
            return WorkerSide.for_kv_caches(
                self.client,
                self.scheme,
                self.kv,
                self.blocks,
                Regions,
                register=self.client.register,
                staging_blocks=staging,
                layerwise_save_blocks=layerwise,
            )
        plan = TPPlan(
            0,
            1,
            num_kv_heads=self.heads,
            store_tp=self.shards if self.shards > 1 else None,
        )
        lanes = []
        for g in range(self.groups):
            kv = self._group_layers(g)
            block_bytes = sum(
                t.numel() // self.blocks * 2 for t in kv.values()
            )
            scheme = attrs.evolve(
                self.scheme,
                layout=KeyLayout(
                    "int16",
                    block_tokens=BLOCK,
                    block_bytes=block_bytes,
                    detail=f"g{g}",
                ),
            )
            lanes.append(
                group_lane(
                    kv,
                    self.blocks,
                    Regions,
                    register=self.client.register,
                    plan=plan,
                    keys=(
                        ShardKeys(plan.schemes(scheme))
                        if plan.shared
                        else scheme
                    ),
                    block_bytes=block_bytes,
                    staging_blocks=staging,
                )
            )
        return WorkerSide(
            self.client,
            lanes[0].keys,
            KVLayout.from_tensors(self._group_layers(0), self.blocks),
            Regions,
            transfer=lanes[0].transfer,
            lanes=lanes,
            layerwise_saves=layerwise > 0,
        )

    def run(self, variant: str, layer_s: float) -> tuple[float, float]:
        """(forward s, save tail s) of one prefill through `variant`."""
        w = self.workers[variant]
        self.job_id += 1
        self.step += 1
        ids = tuple(range(self.blocks))
        hashes = tuple(f"{variant}-{self.job_id}-{b}".encode() for b in ids)
        job = TransferJob(
            self.job_id, JobKind.SAVE, f"r{self.job_id}", 0,
            ids * self.groups, hashes * self.groups, pinned=True,
            group_ids=(
                tuple(g for g in range(self.groups) for _ in ids)
                if self.groups > 1 else ()
            ),
        )  # fmt: skip
        meta = ConnectorMeta(step=self.step, jobs=(job,))
        started = time.perf_counter()
        w.handle_preemptions(meta)
        w.start_load_kv(meta)
        for layer, (name, tensor) in enumerate(self.kv.items()):
            w.wait_for_layer_load(name)
            time.sleep(layer_s)  # the layer's compute (GIL released)
            tensor.fill_(self.job_id * 64 + layer)  # its KV, written
            w.save_kv_layer(name, meta)
        w.wait_for_save(meta)
        ended = time.perf_counter()
        report = None
        while report is None:
            time.sleep(POLL_S)
            w.get_finished()
            report = w.build_report()
        done = time.perf_counter()
        if not all(r.ok for r in report.results):
            msg = f"{variant} save failed"
            raise RuntimeError(msg)
        self._check(w, hashes)
        w.start_load_kv(
            ConnectorMeta(step=self.step + 1, finished=frozenset({job.req_id}))
        )
        self.step += 1
        for lane in w.lanes:
            self.client.remove(lane.keys.keys(list(hashes)), force=True)
        return ended - started, done - ended

    def _check(self, w: WorkerSide, hashes: tuple[bytes, ...]) -> None:
        """The first and last blocks hold the KV as the forward left it.

        Every store object of each: per KV cache group, one, or one per
        head shard (its slice of the heads, every layer of the group).
        """
        ends = (0, self.blocks - 1)
        per = self.heads // self.shards
        for g, lane in enumerate(w.lanes):
            keys = lane.keys.keys([hashes[0], hashes[-1]])  # shard-major
            size = lane.block_bytes // self.shards
            rows = torch.zeros((len(keys), size), dtype=torch.uint8)
            self.client.register_tensor(rows)
            try:
                regions = Regions.blocks(
                    rows.data_ptr(), size, list(range(len(keys)))
                )
                got = self.client.get(keys, regions).succeeded
            finally:
                self.client.unregister(rows.data_ptr())
            parts = []
            for shard in range(self.shards):
                for b in ends:
                    of_block = []
                    for t in self._group_layers(g).values():
                        kv = t[:, b]
                        if self.shards > 1:
                            kv = kv[:, shard * per : (shard + 1) * per]
                        of_block.append(
                            kv.contiguous().view(torch.uint8).reshape(-1)
                        )
                    parts.append(torch.cat(of_block))
            if got != [True] * len(keys) or not torch.equal(
                rows, torch.stack(parts)
            ):
                msg = "stored bytes differ from the KV the forward wrote"
                raise RuntimeError(msg)

    def measure(self, reps: int, layer_s: float) -> dict[str, Any]:
        fwd: dict[str, list[float]] = {v: [] for v in VARIANTS}
        tail: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rep in range(reps):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            for variant in order:
                f, t = self.run(variant, layer_s)
                fwd[variant].append(f)
                tail[variant].append(t)
        med_tail = {v: statistics.median(tail[v]) for v in VARIANTS}
        return {
            "forward_ms": {
                v: round(statistics.median(fwd[v]) * 1e3, 2) for v in VARIANTS
            },
            "save_tail_ms": {v: round(med_tail[v] * 1e3, 2) for v in VARIANTS},
            "save_tail_ms_p90": {
                v: round(sorted(tail[v])[int(0.9 * (reps - 1))] * 1e3, 2)
                for v in VARIANTS
            },
            "tail_vs_staged": {
                v: round(med_tail[v] / med_tail["staged"], 3) for v in VARIANTS
            },
        }

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()
        for ptr in self.registered:
            self.client.unregister(ptr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a master, measure, return the JSON document."""
    started = time.monotonic()
    with EmbeddedMaster() as master:
        config = store_config_for(
            master,
            global_segment_size=args.segment_mib * MiB,
            local_buffer_size=16 * MiB,
        )
        with StoreClient.open(config) as client:
            bench = Bench(
                client,
                layers=args.layers,
                heads=args.kv_heads,
                tokens=args.tokens,
                shards=args.shards,
                groups=args.groups,
            )
            try:
                row = bench.measure(args.reps, args.layer_ms / 1e3)
            finally:
                bench.close()
            block_bytes = bench.block_bytes
    return {
        "benchmark": "save tail after a prefill's forward pass (CPU)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "tokens": args.tokens,
        "blocks": args.tokens // BLOCK,
        "layers": args.layers,
        "shards": args.shards,
        "groups": args.groups,
        "block_bytes": block_bytes,
        "layer_ms": args.layer_ms,
        "reps": args.reps,
        **row,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.layerwise_save``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--layer-ms", type=float, default=4.0)
    parser.add_argument("--segment-mib", type=int, default=1024)
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="head shards per block (store_tp_size), all held here",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="KV cache groups the layers are dealt to (a hybrid model)",
    )
    args = parser.parse_args(argv)
    if args.groups <= 0 or args.layers % args.groups:
        parser.error("--groups must divide --layers")
    if args.shards <= 0 or args.kv_heads % args.shards:
        parser.error("--shards must divide --kv-heads")
    if args.tokens % BLOCK or args.tokens <= 0:
        parser.error(f"--tokens must be a positive multiple of {BLOCK}")
    logging.basicConfig(level=logging.WARNING)
    doc = run(args)
    if args.json:
        print(json.dumps(doc))
        return 0
    for key in ("forward_ms", "save_tail_ms", "tail_vs_staged"):
        print(f"{key}: {doc[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
