"""GPU KV transfers against the PCIe copy floor.

``python -m benchmarks.gpu_transfer --json`` builds a realistic KV cache on
the first CUDA device (32 layers, 8 KV heads, head dim 128, block 16 tokens,
bf16, FlashAttention's K/V-first ``[2, num_blocks, 16, 8, 128]`` per layer:
2 MiB per block over every layer), starts an embedded master, and moves
`--blocks` blocks per job through the connector's CUDA path
(`connector.worker.transfer.Staged` over `CudaOps`: pinned staging,
registered once):

- ``save``: gather on the device, copy into pinned staging, put;
- ``load``: get into pinned staging, copy into the KV cache;
- ``floor_d2h`` / ``floor_h2d``: one plain copy of the same bytes between
  a contiguous device tensor and pinned host memory (the PCIe floor).

Medians over `--reps` (GB/s = 1e9 B/s), and each path's ratio to its
floor.  ``phases`` breaks both paths down, each phase timed alone with
the transfer's own pieces and sizes (one job of `--blocks` blocks, one
staging buffer of them, registered): ``save`` = ``device_gather`` (every
layer's K/V piece of the blocks packed on the device), ``d2h`` (the packed
blocks into pinned staging, one copy), ``put`` (the store's put from
staging); ``load`` = ``get`` (into pinned staging), ``h2d`` (one copy to
the device), ``device_scatter`` (every piece into its blocks); each in ms
and GB/s, and its share of the phases' sum.  Without a CUDA device it
prints ``{"device": null, ...}`` and exits 0, so the GPU check can be
validated anywhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK = 16
BLOCKS = 64


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _sync(device: str) -> None:
    import torch  # noqa: PLC0415

    if device == "cuda":
        torch.cuda.synchronize()


def _kv_caches(num_blocks: int, device: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            shape, dtype=torch.bfloat16, device=device
        )
        for i in range(LAYERS)
    }


def _floor(nbytes: int, reps: int, where: str) -> tuple[float, float]:
    """(device -> host, host -> device) GB/s of one plain pinned copy."""
    import torch  # noqa: PLC0415

    device = torch.empty(nbytes, dtype=torch.uint8, device=where)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=where == "cuda")
    d2h, h2d = [], []
    for _ in range(reps):
        _sync(where)
        started = time.perf_counter()
        host.copy_(device, non_blocking=True)
        _sync(where)
        d2h.append(time.perf_counter() - started)
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        _sync(where)
        h2d.append(time.perf_counter() - started)
    return _median_gbps(nbytes, d2h), _median_gbps(nbytes, h2d)


def _timed(device: str, work: Any) -> float:
    """Seconds of `work()`, device work included."""
    _sync(device)
    started = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - started


def _store_call(
    op: Any, out: list[bool], *, regions: Any, keys: list[str]
) -> None:
    out.extend(op(keys, regions).succeeded)


def _phases(
    transfer: Any,
    client: Any,
    sources: list[int],
    targets: list[int],
    *,
    reps: int,
    device: str,
) -> dict[str, Any]:
    """Each phase of a staged save and load, timed alone (see above)."""
    import torch  # noqa: PLC0415

    from connector.store import Regions  # noqa: PLC0415

    pieces = transfer.pieces
    k, block_bytes = len(sources), transfer.block_bytes
    offsets = [0]
    for p in pieces[:-1]:
        offsets.append(offsets[-1] + p.nbytes)
    staging = torch.empty(
        (k, block_bytes), dtype=torch.uint8, pin_memory=device == "cuda"
    )
    client.register_tensor(staging)
    packed = torch.empty((k, block_bytes), dtype=torch.uint8, device=device)
    regions = Regions.blocks(staging.data_ptr(), block_bytes, range(k))
    times: dict[str, list[float]] = {
        n: []
        for n in (
            "device_gather",
            "d2h",
            "put",
            "get",
            "h2d",
            "device_scatter",
        )
    }

    first, target = sources[0], targets[0]
    # One run each way, as a prefill's: `Staged` and `LoadStaging` copy a
    # run of consecutive blocks as one slice per piece.
    assert sources == list(range(first, first + k))
    assert targets == list(range(target, target + k))

    def gather() -> None:
        for piece, off in zip(pieces, offsets, strict=True):
            part = piece.view[first : first + k].reshape(k, -1)
            packed[:, off : off + piece.nbytes].copy_(part.view(torch.uint8))

    def scatter() -> None:
        for piece, off in zip(pieces, offsets, strict=True):
            view = piece.view
            part = (
                packed[:, off : off + piece.nbytes]
                .view(view.dtype)
                .reshape(k, *view.shape[1:])
            )
            view[target : target + k].copy_(part)

    try:
        for rep in range(reps):
            keys = [f"phase-{uuid.uuid4().hex[:8]}-{rep}-{b}" for b in sources]
            times["device_gather"].append(_timed(device, gather))
            times["d2h"].append(
                _timed(
                    device, lambda: staging.copy_(packed, non_blocking=True)
                )
            )
            put: list[bool] = []
            got: list[bool] = []
            call = functools.partial(_store_call, regions=regions, keys=keys)
            times["put"].append(
                _timed(device, functools.partial(call, client.put, put))
            )
            times["get"].append(
                _timed(device, functools.partial(call, client.get, got))
            )
            times["h2d"].append(
                _timed(
                    device, lambda: packed.copy_(staging, non_blocking=True)
                )
            )
            times["device_scatter"].append(_timed(device, scatter))
            client.remove(keys, force=True)
            if not (all(put) and all(got)):
                msg = f"phases rep {rep}: a put or get failed"
                raise RuntimeError(msg)
    finally:
        client.unregister(staging.data_ptr())
    nbytes = k * block_bytes
    med = {n: statistics.median(v) for n, v in times.items()}
    out: dict[str, Any] = {}
    for path, names in (
        ("save", ("device_gather", "d2h", "put")),
        ("load", ("get", "h2d", "device_scatter")),
    ):
        total = sum(med[n] for n in names)
        out[path] = {
            n: {
                "ms": round(med[n] * 1e3, 3),
                "gbps": round(nbytes / med[n] / 1e9, 3),
                "share": round(med[n] / total, 3),
            }
            for n in names
        }
    return out


def measure(blocks: int, reps: int, device: str = "cuda") -> dict[str, Any]:
    """Save and load `blocks` blocks `reps` times each; the JSON row.

    `device` ``"cpu"`` runs the same code over host tensors (the staging
    path with host copies): a check of the benchmark itself, not a figure.
    """
    import torch  # noqa: PLC0415

    from connector.config import MiB  # noqa: PLC0415
    from connector.ops.master import (  # noqa: PLC0415
        EmbeddedMaster,
        store_config_for,
    )
    from connector.store import Regions, StoreClient  # noqa: PLC0415
    from connector.worker.transfer import open_transfer  # noqa: PLC0415

    num_blocks = 2 * blocks + 1
    kv = _kv_caches(num_blocks, device)
    block_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    nbytes = blocks * block_bytes
    floor_d2h, floor_h2d = _floor(nbytes, reps, device)
    segment = max(256 * MiB, 2 * nbytes + 64 * MiB)
    with EmbeddedMaster() as master:
        config = store_config_for(
            master, global_segment_size=segment, local_buffer_size=16 * MiB
        )
        with StoreClient.open(config) as client:
            transfer = open_transfer(
                kv,
                num_blocks,
                Regions,
                register=client.register,
                staging_blocks=min(blocks, 32),
            )
            sources = list(range(blocks))
            targets = list(range(blocks, 2 * blocks))
            saves, loads = [], []
            for rep in range(reps):
                keys = [
                    f"gpu-{uuid.uuid4().hex[:8]}-{rep}-{b}" for b in sources
                ]
                fence = transfer.fence()
                started = time.perf_counter()
                ok = transfer.save(client, keys, sources, fence)
                saves.append(time.perf_counter() - started)
                started = time.perf_counter()
                got = transfer.load(client, keys, targets)
                _sync(device)
                loads.append(time.perf_counter() - started)
                if not (all(ok) and all(got)):
                    msg = f"rep {rep}: {ok.count(False)} saves, {got.count(False)} loads failed"  # noqa: E501
                    raise RuntimeError(msg)
                client.remove(keys, force=True)
            same = all(
                torch.equal(t[:, sources], t[:, targets]) for t in kv.values()
            )
            phases = _phases(
                transfer, client, sources, targets, reps=reps, device=device
            )
    save, load = _median_gbps(nbytes, saves), _median_gbps(nbytes, loads)
    return {
        "device": torch.cuda.get_device_name(0)
        if device == "cuda"
        else "cpu (a check of the benchmark, not a figure)",
        "layout": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_tokens": BLOCK,
            "dtype": "bfloat16",
            "block_bytes": block_bytes,
        },
        "blocks_per_job": blocks,
        "reps": reps,
        "floor_d2h_gbps": floor_d2h,
        "floor_h2d_gbps": floor_h2d,
        "save_gbps": save,
        "load_gbps": load,
        "save_vs_floor": round(save / floor_d2h, 3),
        "load_vs_floor": round(load / floor_h2d, 3),
        "loaded_bytes_equal_saved": same,
        "phases": phases,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the row (JSON with `--json`); no CUDA: a skip row, exit 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run the same code on host tensors (checks the benchmark)",
    )
    args = parser.parse_args(argv)
    if args.blocks <= 0 or args.reps <= 0:
        parser.error("--blocks and --reps must be positive")
    import torch  # noqa: PLC0415

    row: dict[str, Any]
    if args.cpu:
        row = measure(args.blocks, args.reps, "cpu")
    elif not torch.cuda.is_available():
        row = {
            "device": None,
            "skipped": "no CUDA device (torch.cuda.is_available() is False)",
        }
    else:
        row = measure(args.blocks, args.reps)
    print(json.dumps(row) if args.json else row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
