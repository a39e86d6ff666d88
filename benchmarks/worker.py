"""Worker job latency: the worker half against the bare store call.

``python -m benchmarks.worker --json`` starts an embedded master and one
``StoreClient`` and, on the same CPU KV tensors (2 layers, K/V-first),
times one save job and one load job of ``batch`` whole blocks through:

- ``store``: ``StoreClient.put`` / ``get`` on the blocks' pieces, called
  directly (the floor: no lifecycle, no thread);
- ``worker``: ``WorkerSide`` with the zero-copy transfer (metadata in,
  lifecycle events, transfer thread, completion polled by
  ``get_finished`` as a model runner would);
- ``staged``: the same worker through the staging code (``HostOps``), the
  path CUDA caches take minus the device copies.

Variants alternate within every repetition (order rotated each time) so
machine noise hits all three; saves use fresh keys each time so every put
writes.  Reported numbers are medians in milliseconds and their ratios.
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

import torch

from connector.config import KiB, MiB
from connector.metadata import ConnectorMeta, JobKind, TransferJob
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.store import Regions, StoreClient
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.side import WorkerSide

NUM_BLOCKS = 256
LAYERS = 2
ROWS = [(64 * KiB, 16), (256 * KiB, 32)]
VARIANTS = ("store", "worker", "staged")
POLL_S = 0.0002


class Bench:
    """One (block size, batch) row over three workers' worth of tensors."""

    def __init__(self, client: StoreClient, block: int, batch: int) -> None:
        self.client = client
        self.block = block
        self.batch = batch
        half = block // (2 * LAYERS)
        self.kv = {
            f"l{i}": torch.randint(
                0, 256, (2, NUM_BLOCKS, half), dtype=torch.uint8
            )
            for i in range(LAYERS)
        }
        self.scheme = KeyScheme(
            namespace=f"bench-worker-{block}-{batch}",
            model="m",
            tp_rank=0,
            tp_size=1,
            layout=KeyLayout("uint8", block_tokens=16, block_bytes=block),
        )
        self.workers = {
            "worker": self._worker(None),
            "staged": self._worker(batch),
        }
        self.layout = self.workers["worker"].layout
        self.registered = [
            p for w in self.workers.values() for p in w.registered
        ]
        self.ids = list(range(batch))
        self.loaded = [f"load-{i}".encode() for i in range(batch)]
        self.client.put(self.scheme.keys(self.loaded), self._regions())
        self.job_id = 0
        self.step = 0
        self.fresh = 0

    def _worker(self, staging: int | None) -> WorkerSide:
        return WorkerSide.for_kv_caches(
            self.client,
            self.scheme,
            self.kv,
            NUM_BLOCKS,
            Regions,
            register=self.client.register,
            staging_blocks=staging,
        )

    def _regions(self) -> Regions:
        return Regions.pieces(*self.layout.pieces(self.ids))

    def _job(self, kind: JobKind, hashes: list[bytes]) -> TransferJob:
        self.job_id += 1
        return TransferJob(
            self.job_id,
            kind,
            f"r{self.job_id}",
            0,
            tuple(self.ids),
            tuple(hashes),
            pinned=True,
        )

    def run(self, variant: str, kind: JobKind) -> float:
        """Seconds for one job of `kind` through `variant`."""
        if kind is JobKind.SAVE:
            self.fresh += 1
            hashes = [f"s{self.fresh}-{i}".encode() for i in self.ids]
        else:
            hashes = self.loaded
        if variant == "store":
            keys = self.scheme.keys(hashes)
            started = time.perf_counter()
            regions = self._regions()
            call = self.client.put if kind is JobKind.SAVE else self.client.get
            ok = call(keys, regions).ok
            elapsed = time.perf_counter() - started
        else:
            w = self.workers[variant]
            job = self._job(kind, hashes)
            self.step += 1
            meta = ConnectorMeta(step=self.step, jobs=(job,))
            started = time.perf_counter()
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
            w.wait_for_save(meta)
            report = None
            while report is None:
                # A runner polls once per step; a busy loop here would
                # starve the transfer thread of the GIL (5 ms switches).
                time.sleep(POLL_S)
                w.get_finished()
                report = w.build_report()
            elapsed = time.perf_counter() - started
            ok = all(r.ok for r in report.results)
            w.start_load_kv(  # the finish notice ends the request
                ConnectorMeta(
                    step=self.step + 1, finished=frozenset({job.req_id})
                )
            )
            self.step += 1
        if not ok:
            msg = f"{variant} {kind.value} failed"
            raise RuntimeError(msg)
        if kind is JobKind.SAVE:  # free the segment, untimed
            self.client.remove(self.scheme.keys(hashes), force=True)
        return elapsed

    def measure(self, reps: int) -> dict[str, Any]:
        times: dict[tuple[str, JobKind], list[float]] = {
            (v, k): [] for v in VARIANTS for k in JobKind
        }
        for rep in range(reps):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            for kind in JobKind:
                for variant in order:
                    times[(variant, kind)].append(self.run(variant, kind))
        med = {key: statistics.median(v) for key, v in times.items()}
        row: dict[str, Any] = {
            "block_bytes": self.block,
            "batch": self.batch,
            "reps": reps,
            "median_ms": {
                f"{v}_{k.value}": round(med[(v, k)] * 1e3, 3)
                for v in VARIANTS
                for k in JobKind
            },
        }
        for v in ("worker", "staged"):
            for k in JobKind:
                row[f"{v}_{k.value}_ratio"] = round(
                    med[(v, k)] / med[("store", k)], 3
                )
        return row

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()
        for ptr in self.registered:
            self.client.unregister(ptr)


def run(reps: int, segment: int) -> dict[str, Any]:
    """Start a master, measure every row, return the JSON document."""
    started = time.monotonic()
    rows = []
    with EmbeddedMaster() as master:
        config = store_config_for(
            master, global_segment_size=segment, local_buffer_size=16 * MiB
        )
        with StoreClient.open(config) as client:
            for block, batch in ROWS:
                bench = Bench(client, block, batch)
                try:
                    rows.append(bench.measure(reps))
                finally:
                    bench.close()
    return {
        "benchmark": "worker job latency vs bare store call (same process)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "rows": rows,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.worker``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--segment-mib", type=int, default=512)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = run(args.reps, args.segment_mib * MiB)
    if args.json:
        print(json.dumps(doc))
        return 0
    for r in doc["rows"]:
        print(f"{r['block_bytes'] // KiB}K x {r['batch']}: {r['median_ms']}")
        print(
            "  ratios vs store: "
            + ", ".join(
                f"{k}={v}" for k, v in r.items() if k.endswith("_ratio")
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
