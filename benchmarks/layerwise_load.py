"""Layer-wise load of a peer's blocks: read whole, or in spans of layers.

``python -m benchmarks.layerwise_load --json`` starts an embedded master,
an owner client that stores a prefix (``--blocks`` blocks of a realistic
layout: 32 layers, K/V-first, 8 KV heads of 128, 16 tokens, bf16 as
2-byte words: 2 MiB per block) and a reader client with no segment that
loads it, as a layer-wise load of server B loads server A's blocks: the
transfer crosses the store's transport (TCP loopback here) into staging,
then the KV cache.  The forward pass is played as the model runner plays
it: per layer, the wait for that layer's KV (``Deadline.wait_for_layer``,
what ``wait_for_layer_load`` calls), then ``--layer-ms`` of compute (a
sleep: the forward thread releases the GIL, as while a GPU computes).

Modes, alternating within each repetition:

- ``no_load``: the forward alone (the floor);
- ``whole``: one get of every block's object (the first layer waits for
  all of it);
- ``spans``: one block per segment read whole (the probe that keeps a
  dead peer cheap), then one get session, spans of 1, 1, 2, 4, 8, 16
  layers, each written as it lands (`connector.worker.deadline.layer_spans`).

With ``--shards N`` the blocks are stored head-sharded (the
``store_tp_size`` layout: N objects per block, one per slice of the KV
heads, on a head-major layout) and the reader holds all N, as a rank of a
smaller TP size does: ``whole`` reads the shards one after another,
``spans`` side by side, each in spans, a layer in once every shard wrote
it (`connector.worker.shards.Sharded`).

Per mode, medians over ``--reps``: ``forward_ms`` (first layer's wait to
the last layer's end), ``stall_ms`` (``forward_ms`` minus ``no_load``'s),
``first_wait_ms`` and ``load_ms`` (the load's own end); ``stall_ratio``
is ``spans`` over ``whole``.  Every load is checked byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch

from connector.config import MiB
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.store import Regions, StoreClient
from connector.worker.deadline import Deadline
from connector.worker.pieces import HeadSlice
from connector.worker.shards import Sharded
from connector.worker.transfer import Transfer, open_transfer

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16
MODES = ("no_load", "whole", "spans")


def _kv(
    blocks: int, layers: int, *, fill: bool, head_major: bool = False
) -> dict[str, torch.Tensor]:
    shape = (
        (2, blocks, KV_HEADS, BLOCK, HEAD_DIM)
        if head_major
        else (2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
    )
    gen = torch.Generator().manual_seed(5)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randint(
                -30000, 30000, shape, dtype=torch.int16, generator=gen
            )
            if fill
            else torch.zeros(shape, dtype=torch.int16)
        )
        for i in range(layers)
    }


class Bench:
    """A stored prefix in the owner's segment; the reader's KV to fill."""

    def __init__(
        self,
        owner: StoreClient,
        reader: StoreClient,
        blocks: int,
        layers: int,
        shards: int = 1,
    ) -> None:
        self.owner, self.reader = owner, reader
        self.blocks = blocks
        self.ids = list(range(blocks))
        sharded = shards > 1
        self.src = _kv(blocks, layers, fill=True, head_major=sharded)
        self.dst = _kv(blocks, layers, fill=False, head_major=sharded)
        self.layers = list(self.src)
        self.keys = [
            f"layerwise-load-s{s}-{i}" for s in range(shards) for i in self.ids
        ]
        self.saving = self._open(self.src, owner, shards)
        saved = self.saving.save(
            owner, self.keys, self.ids, self.saving.fence()
        )
        if not all(saved):
            msg = f"the prefix was not stored: {saved.count(False)} failed"
            raise RuntimeError(msg)
        self.loading = self._open(self.dst, reader, shards)

    def _open(
        self, kv: dict[str, torch.Tensor], client: StoreClient, shards: int
    ) -> Transfer | Sharded:
        """One transfer, or one per head shard (`Sharded`)."""
        if shards == 1:
            return open_transfer(
                kv,
                self.blocks,
                Regions,
                register=client.register,
                deadlines=True,
            )
        per = KV_HEADS // shards
        return Sharded(
            [
                open_transfer(
                    kv,
                    self.blocks,
                    Regions,
                    register=client.register,
                    deadlines=True,
                    heads=HeadSlice(i * per, per, KV_HEADS),
                )
                for i in range(shards)
            ]
        )

    def once(self, mode: str, layer_s: float) -> dict[str, float]:
        """One forward pass with (or without) its load."""
        for t in self.dst.values():
            t.zero_()
        deadline = Deadline.after(30, by_layer=mode == "spans")
        ended: dict[str, float] = {}
        loader = None
        started = time.perf_counter()
        if mode != "no_load":

            def load() -> None:
                flags = self.loading.load(
                    self.reader, self.keys, self.ids, deadline
                )
                ended["at"] = time.perf_counter()
                ended["ok"] = float(all(flags))
                deadline.finish()

            loader = threading.Thread(target=load)
            loader.start()
        first_wait = 0.0
        for i, layer in enumerate(self.layers):
            if loader is not None:
                waited = time.perf_counter()
                if not deadline.wait_for_layer(layer, deadline.left()):
                    msg = f"layer {layer} not in by the deadline"
                    raise RuntimeError(msg)
                if i == 0:
                    first_wait = time.perf_counter() - waited
            time.sleep(layer_s)
        forward = time.perf_counter() - started
        row = {"forward_ms": forward * 1e3, "first_wait_ms": first_wait * 1e3}
        if loader is not None:
            loader.join()
            self._check(mode, ended)
            row["load_ms"] = (ended["at"] - started) * 1e3
        return row

    def _check(self, mode: str, ended: dict[str, float]) -> None:
        """The load succeeded and every layer is the stored KV."""
        if not ended.get("ok"):
            msg = f"{mode}: the load failed"
            raise RuntimeError(msg)
        for name in self.layers:
            if not torch.equal(self.dst[name], self.src[name]):
                msg = f"{mode}: layer {name} differs from the stored KV"
                raise RuntimeError(msg)

    def measure(self, reps: int, layer_s: float) -> dict[str, Any]:
        """Medians per mode over `reps` alternating repetitions."""
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for rep in range(reps + 1):
            order = MODES if rep % 2 else tuple(reversed(MODES))
            for mode in order:
                row = self.once(mode, layer_s)
                if rep:  # the first repetition warms up
                    runs[mode].append(row)
        out: dict[str, Any] = {}
        for mode, rows in runs.items():
            out[mode] = {
                key: round(statistics.median(r[key] for r in rows), 2)
                for key in rows[0]
            }
        floor = out["no_load"]["forward_ms"]
        for mode in ("whole", "spans"):
            out[mode]["stall_ms"] = round(out[mode]["forward_ms"] - floor, 2)
        whole = out["whole"]["stall_ms"]
        out["stall_ratio"] = (
            round(out["spans"]["stall_ms"] / whole, 3) if whole > 0 else None
        )
        return out

    def close(self) -> None:
        """Unregister what the transfers registered."""
        for transfer, client in (
            (self.loading, self.reader),
            (self.saving, self.owner),
        ):
            parts = (
                transfer.parts
                if isinstance(transfer, Sharded)
                else (transfer,)
            )
            for part in parts:
                loads = getattr(part, "loads", None)
                if loads is not None:
                    loads.close()
                for ptr in part.registered:
                    client.unregister(ptr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a master and two clients, measure, return the JSON document."""
    started = time.monotonic()
    with EmbeddedMaster() as master:
        owner_config = store_config_for(
            master, global_segment_size=args.segment_mib * MiB
        )
        reader_config = store_config_for(master, global_segment_size=0)
        with (
            StoreClient.open(owner_config) as owner,
            StoreClient.open(reader_config) as reader,
        ):
            bench = Bench(owner, reader, args.blocks, args.layers, args.shards)
            try:
                rows = {
                    str(ms): bench.measure(args.reps, ms / 1e3)
                    for ms in args.layer_ms
                }
            finally:
                bench.close()
    return {
        "benchmark": "layer-wise load of a peer's blocks: whole or in spans",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "blocks": args.blocks,
        "layers": args.layers,
        "shards": args.shards,
        "block_bytes": 2 * BLOCK * KV_HEADS * HEAD_DIM * 2 * args.layers,
        "reps": args.reps,
        "by_layer_ms": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print JSON (or a summary)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument(
        "--layer-ms",
        type=float,
        nargs="+",
        default=[1.0, 4.0],
        help="compute per layer (ms); one row each",
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--segment-mib", type=int, default=512)
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="head shards per block, all read by the reader (divides 8)",
    )
    args = parser.parse_args(argv)
    if args.blocks <= 0 or args.layers <= 0 or args.reps <= 0:
        parser.error("--blocks, --layers and --reps must be positive")
    if args.shards <= 0 or KV_HEADS % args.shards:
        parser.error(f"--shards must divide the {KV_HEADS} KV heads")
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for ms, row in doc["by_layer_ms"].items():
            print(
                f"{ms} ms/layer: stall whole {row['whole']['stall_ms']} ms, "
                f"spans {row['spans']['stall_ms']} ms "
                f"(ratio {row['stall_ratio']})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
