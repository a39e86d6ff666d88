"""Store transfer throughput: our backend against raw Mooncake calls.

``python -m benchmarks.transfer --json`` starts an embedded master, opens one
``StoreClient`` (TCP loopback, segment in the same process, so transfers are
memcpy plus master RPCs) and measures, on the same registered torch blocks:

- ``save``: ``StoreClient.put`` (dedupe lookup, then put of missing keys);
- ``raw_save``: the same work done directly on ``MooncakeDistributedStore``
  (``batch_is_exist`` then ``batch_put_from``), as vLLM's connector does;
- ``load`` / ``raw_load``: ``StoreClient.get`` / ``batch_get_into``;
- ``save_nodedupe`` / ``raw_put_only``: puts without the lookup;
- ``memcpy``: one torch copy of the same bytes, the physical limit.

Backend and raw runs alternate within every repetition (the order flips each
time) so machine noise hits both; keys are force-removed after every run so
each put really writes. Reported numbers are medians (GB/s = 1e9 B/s).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch

from connector.config import KiB, MiB
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.store import Regions, StoreClient

if TYPE_CHECKING:
    from collections.abc import Callable

ROWS = [(256 * KiB, 16), (256 * KiB, 128), (2 * MiB, 16), (2 * MiB, 128)]
GOAL = 0.9


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


class Row:
    """One (block size, batch) measurement on shared buffers.

    Each path is a zero-argument callable that does the whole operation,
    including building its pointer lists, exactly as a caller would.
    """

    OPS = ("save", "load", "save_nodedupe")

    def __init__(
        self,
        client: StoreClient,
        src: torch.Tensor,
        dst: torch.Tensor,
        block: int,
        batch: int,
    ) -> None:
        self.block = block
        self.batch = batch
        self.nbytes = block * batch
        self.client = client
        self.raw = client.raw
        self.keys = [f"bench/{block}/{batch}/{i}" for i in range(batch)]
        self.ids = list(range(batch))
        self.src_ptr = src.data_ptr()
        self.dst_ptr = dst.data_ptr()
        self.src_view = src[: self.nbytes]
        self.dst_view = dst[: self.nbytes]
        self.samples: dict[str, list[float]] = {}
        self.paths: dict[str, tuple[Callable[[], Any], ...]] = {
            "backend": (self.save, self.load, self.save_nodedupe),
            "raw": (self.raw_save, self.raw_load, self.raw_put_only),
        }

    # -- our backend ----------------------------------------------------------

    def save(self) -> bool:
        regions = Regions.blocks(self.src_ptr, self.block, self.ids)
        return self.client.put(self.keys, regions).ok

    def save_nodedupe(self) -> bool:
        regions = Regions.blocks(self.src_ptr, self.block, self.ids)
        return self.client.put(self.keys, regions, dedupe=False).ok

    def load(self) -> bool:
        regions = Regions.blocks(self.dst_ptr, self.block, self.ids)
        return self.client.get(self.keys, regions).ok

    # -- raw Mooncake, same work ---------------------------------------------

    def raw_save(self) -> bool:
        block, keys = self.block, self.keys
        ptrs = [self.src_ptr + i * block for i in self.ids]
        exist = self.raw.batch_is_exist(keys)
        todo = [i for i, e in enumerate(exist) if e == 0]
        codes = self.raw.batch_put_from(
            [keys[i] for i in todo],
            [ptrs[i] for i in todo],
            [block] * len(todo),
            self.client.replicate_config,
        )
        return len(todo) == len(keys) and not any(codes)

    def raw_put_only(self) -> bool:
        block = self.block
        ptrs = [self.src_ptr + i * block for i in self.ids]
        codes = self.raw.batch_put_from(
            self.keys, ptrs, [block] * self.batch, self.client.replicate_config
        )
        return not any(codes)

    def raw_load(self) -> bool:
        block = self.block
        ptrs = [self.dst_ptr + i * block for i in self.ids]
        codes = self.raw.batch_get_into(self.keys, ptrs, [block] * self.batch)
        return codes.count(block) == len(codes)

    # -- harness --------------------------------------------------------------

    def remove(self) -> None:
        codes = self.raw.batch_remove(self.keys, True)  # noqa: FBT003
        if any(c not in {0, -704} for c in codes):
            msg = f"batch_remove failed: {sorted(set(codes))}"
            raise RuntimeError(msg)

    def step(self, who: str, index: int, *, record: bool) -> None:
        """Time one operation of one path; fail loudly if it failed."""
        name = self.OPS[index] if who == "backend" else RAW_NAMES[index]
        seconds, ok = _timed(self.paths[who][index])
        if not ok:
            msg = f"{name} failed at block={self.block} batch={self.batch}"
            raise RuntimeError(msg)
        if record:
            self.samples.setdefault(name, []).append(seconds)

    def verify(self, who: str) -> None:
        if not torch.equal(self.src_view, self.dst_view):
            msg = f"{who}: loaded bytes differ from the saved bytes"
            raise RuntimeError(msg)
        self.dst_view.zero_()

    def repetition(self, order: tuple[str, str], *, record: bool) -> None:
        """Adjacent pairs: both saves, both loads, both plain puts."""
        first, second = order
        # The first path's keys are removed before the second saves; the
        # second's stay for the loads.
        self.step(first, 0, record=record)
        self.remove()
        self.step(second, 0, record=record)
        for who in order:
            self.step(who, 1, record=record)
            if not record:
                self.verify(who)
        self.remove()
        for who in order:
            self.step(who, 2, record=record)
            self.remove()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one stream, like the store's memcpy
        seconds, _ = _timed(lambda: self.dst_view.copy_(self.src_view))
        torch.set_num_threads(threads)
        if record:
            self.samples.setdefault("memcpy", []).append(seconds)

    def measure(self, reps: int) -> dict[str, Any]:
        """Warm up (verifying data), then ``reps`` interleaved repetitions."""
        self.repetition(("backend", "raw"), record=False)
        self.repetition(("raw", "backend"), record=False)
        gc.collect()
        gc.disable()
        try:
            for rep in range(reps):
                order = ("backend", "raw") if rep % 2 else ("raw", "backend")
                self.repetition(order, record=True)
        finally:
            gc.enable()
        return self.summary(reps)

    def paired(self, raw_name: str, ours: str) -> float:
        """Median over repetitions of raw time / backend time."""
        pairs = zip(self.samples[raw_name], self.samples[ours], strict=True)
        return round(statistics.median(r / o for r, o in pairs), 3)

    def summary(self, reps: int) -> dict[str, Any]:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        row: dict[str, Any] = {
            "block_bytes": self.block,
            "batch": self.batch,
            "bytes": self.nbytes,
            "reps": reps,
        }
        for name, seconds in med.items():
            row[f"{name}_gbps"] = _gbps(self.nbytes, seconds)
        # backend/raw throughput = raw time / backend time. The headline is
        # the paired ratio (median over repetitions of adjacent runs); the
        # ratio of the medians is reported too.
        row["save_ratio"] = self.paired("raw_save", "save")
        row["load_ratio"] = self.paired("raw_load", "load")
        row["save_nodedupe_ratio"] = self.paired(
            "raw_put_only", "save_nodedupe"
        )
        row["save_ratio_of_medians"] = round(med["raw_save"] / med["save"], 3)
        row["load_ratio_of_medians"] = round(med["raw_load"] / med["load"], 3)
        row["median_ms"] = {k: round(v * 1e3, 3) for k, v in med.items()}
        return row


RAW_NAMES = ("raw_save", "raw_load", "raw_put_only")


def registered_buffers(
    client: StoreClient, nbytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random source and a zeroed destination, both registered."""
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    client.register_tensor(src)
    client.register_tensor(dst)
    return src, dst


def run(reps_small: int, reps_large: int, segment: int) -> dict[str, Any]:
    """Start a master, measure every row, return the JSON document."""
    started = time.monotonic()
    capacity = max(block * batch for block, batch in ROWS)
    with EmbeddedMaster(log_level=logging.DEBUG) as master:
        config = store_config_for(
            master,
            global_segment_size=segment,
            local_buffer_size=16 * MiB,
            rpc_timeout_ms=5000,
        )
        with StoreClient.open(config) as client:
            src, dst = registered_buffers(client, capacity)
            rows = []
            for block, batch in ROWS:
                reps = reps_large if block * batch >= 64 * MiB else reps_small
                row = Row(client, src, dst, block, batch)
                rows.append(row.measure(reps))
    ratios = [min(r["save_ratio"], r["load_ratio"]) for r in rows]
    of_medians = [
        min(r["save_ratio_of_medians"], r["load_ratio_of_medians"])
        for r in rows
    ]
    return {
        "benchmark": "connector store transfer (same-process TCP loopback)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "segment_bytes": segment,
        "raw_save": "batch_is_exist + batch_put_from (same dedupe work)",
        "goal_ratio": GOAL,
        "rows": rows,
        "min_ratio": min(ratios),
        "min_ratio_of_medians": min(of_medians),
        "meets_goal": min(ratios) >= GOAL,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.transfer``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--reps", type=int, default=101, help="small rows")
    parser.add_argument(
        "--reps-large", type=int, default=31, help="rows of >= 64 MiB"
    )
    parser.add_argument(
        "--segment-mib", type=int, default=640, help="store segment (MiB)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = run(args.reps, args.reps_large, args.segment_mib * MiB)
    if args.json:
        print(json.dumps(doc))
        return 0
    header = (
        "block    batch  save  raw_save ratio  load  raw_load ratio  memcpy"
    )
    print(header)
    for r in doc["rows"]:
        print(
            f"{r['block_bytes'] // KiB:>5}K {r['batch']:>6} "
            f"{r['save_gbps']:>6.2f} {r['raw_save_gbps']:>8.2f} "
            f"{r['save_ratio']:>5.2f} {r['load_gbps']:>6.2f} "
            f"{r['raw_load_gbps']:>8.2f} {r['load_ratio']:>5.2f} "
            f"{r['memcpy_gbps']:>7.2f}"
        )
    print(f"min ratio {doc['min_ratio']:.3f} (goal {GOAL}); GB/s = 1e9 B/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
