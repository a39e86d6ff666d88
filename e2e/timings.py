"""SCAFFOLDING: measure engine start, generation and prefill times.

Groundwork for a TTFT benchmark, not the benchmark itself::

    python -m e2e.timings tiny     # start and generate, both topologies
    python -m e2e.timings large    # 2048-token prefill: cold vs cache hit

``large`` times one-token generations (about the TTFT) of a fresh prompt:
from scratch, again with vLLM's own prefix cache hit, and, on a second
engine with the file-backed scaffolding connector, from its store after
``reset_prefix_cache`` (a first, slow stand-in for a full external hit).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from e2e.engine import ConnectorSpec, EngineProcess, EngineSpec
from e2e.make_model import ensure_model

LOG_LEVEL = "ERROR"  # vLLM logs to stdout, where the JSON goes


def _prompt(length: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)  # noqa: S311 (test data, not secrets)
    return [rng.randrange(3, vocab) for _ in range(length)]


def tiny(*, multiprocessing: bool, repeats: int = 3) -> dict[str, Any]:
    """Start an engine on the tiny model; time a few 4 x 16-token calls."""
    spec = EngineSpec(
        model=str(ensure_model("tiny")),
        multiprocessing=multiprocessing,
        log_level=LOG_LEVEL,
    )
    prompts = [_prompt(n, n) for n in (41, 71, 96, 20)]
    with EngineProcess(spec) as engine:
        calls = [engine.generate(prompts, 16).seconds for _ in range(repeats)]
        info = dict(engine.info)
    return {**info, "generate_4x16_s": calls}


def _large_spec(dtype: str, connector: ConnectorSpec | None) -> EngineSpec:
    return EngineSpec(
        model=str(ensure_model("large")),
        connector=connector,
        dtype=dtype,
        max_model_len=4096,
        enable_prefix_caching=True,
        max_num_seqs=4,
        max_num_batched_tokens=4096,  # one prefill step, no chunking
        num_gpu_blocks_override=320,
        log_level=LOG_LEVEL,
    )


def large(dtype: str, prompt_len: int, repeats: int) -> dict[str, Any]:
    """TTFT of a ``prompt_len`` prompt: cold, local hit, external hit."""
    runs: list[dict[str, Any]] = [{} for _ in range(repeats)]
    prompts = [_prompt(prompt_len, 100 + r) for r in range(repeats)]
    warmup = _prompt(prompt_len, 99)  # first-call kernel set-up is not TTFT
    with EngineProcess(_large_spec(dtype, None)) as engine:
        engine.generate([warmup], 1)
        for run, prompt in zip(runs, prompts, strict=True):
            cold = engine.generate([prompt], 1)
            hit = engine.generate([prompt], 1)
            run["cold_s"] = cold.seconds
            run["prefix_hit_s"] = hit.seconds
            run["prefix_hit_tokens"] = hit.num_cached_tokens[0]
        info = dict(engine.info)
    with tempfile.TemporaryDirectory() as tmp:
        conn = ConnectorSpec(
            "FileStoreConnector", extra_config={"store_dir": tmp}
        )
        with EngineProcess(_large_spec(dtype, conn)) as engine:
            engine.generate([warmup], 1)
            for run, prompt in zip(runs, prompts, strict=True):
                run["cold_with_save_s"] = engine.generate([prompt], 1).seconds
                engine.reset_prefix_cache()
                ext = engine.generate([prompt], 1)
                run["file_load_hit_s"] = ext.seconds
                run["file_load_hit_tokens"] = ext.num_cached_tokens[0]
            store_bytes = sum(p.stat().st_size for p in Path(tmp).iterdir())
    return {
        "dtype": dtype,
        "prompt_len": prompt_len,
        "engine": info,
        "runs": runs,
        "store_mib": store_bytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints JSON."""
    parser = argparse.ArgumentParser(prog="python -m e2e.timings")
    parser.add_argument("what", choices=("tiny", "large"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.what == "tiny":
        result: dict[str, Any] = {
            "in_process": tiny(multiprocessing=False),
            "multiprocess": tiny(multiprocessing=True),
        }
    else:
        result = large(args.dtype, args.prompt_len, args.repeats)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
