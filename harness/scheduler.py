"""Drive a KV connector through vLLM 0.33's real scheduler on a CPU.

`Harness` builds vLLM's real `Scheduler` (or `AsyncScheduler`), which
creates the SCHEDULER-role connector through vLLM's `KVConnectorFactory`
from `kv_connector_module_path`, and a WORKER-role instance of the same
class.
It then plays the model runner: each step it calls the worker hooks in
vLLM 0.33's order, writes KV for the scheduled tokens into per-layer CPU
tensors, samples tokens, and feeds a `ModelRunnerOutput` back to
`update_from_output`.
No weights, tokenizer, GPU or network are involved.

KV content and sampled tokens are pure functions of the token prefix:
position `p` of a request holds, in layer `l`, a vector derived from
`hash(all_token_ids[:p + 1])` and `l`, and the token sampled after a
prefix is derived from the prefix's hash.
So identical prompts give identical KV and outputs in any instance, and
after every step the harness checks that each block covering a request's
computed tokens holds exactly what recomputation would write, whether it
was computed here, hit in vLLM's prefix cache, or loaded by the connector.
It also checks block-pool reference counts every step, and at the end
that every request finished and every block is back in the free pool.

Checked failures are collected in `Harness.failures`; `Harness.check()`
(called by `run_until_idle`) raises `HarnessError` listing them.
An exception from vLLM itself is wrapped in `HarnessError` and re-raised.

This module imports vLLM lazily, so it imports (and the rest of the suite
runs) where vLLM is absent; tests that use it call
`pytest.importorskip("vllm")`.

Facts about vLLM 0.33.0 that the harness relies on, read in the installed
0.33.0 source:

- `vllm_config.use_v2_model_runner` reads `VLLM_USE_V2_MODEL_RUNNER` on
  every access (only the engine core turns on vLLM's env cache).
  Unset, it is True with the official wheel on this CPU, because the
  platform is "unspecified" and the Triton check is skipped for it.
  Under v2 a resumed request arrives in `scheduled_new_reqs` with its whole
  block table; under v1 it arrives in `scheduled_cached_reqs`, with its id
  in `resumed_req_ids` and `new_block_ids` replacing the table.
- Both runners call `handle_preemptions(meta)` and then
  `bind_connector_metadata(meta)` first (v1 in `execute_model`, v2 in
  `pre_forward`), call `start_load_kv` before the forward only when
  `scheduler_output.has_sync_kv_loads` and after it otherwise, and collect
  completions with `get_transfer_results` (whose default wraps
  `get_finished`).
  Only v2 calls `finish_forward()` after the forward, passes keyword
  arguments to `start_load_kv`, and turns empty completion sets into None.
- The scheduler binds its block pool to its connector once, in
  `Scheduler.__init__`, through `bind_kv_cache_manager`, whose default calls
  `bind_gpu_block_pool(kv_cache_manager.block_pool)`.
  The worker's `build_connector_worker_meta()` result travels in
  `KVConnectorOutput.kv_connector_worker_meta` to the scheduler side's
  `update_connector_output`.
- With async scheduling the engine core keeps a batch queue of
  `vllm_config.max_concurrent_batches` (2 here) steps: step N+1 is
  scheduled (and executed) before `update_from_output` of step N.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Self, cast

from harness.spy import shadow_method

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

#: Persistent vLLM cache (model inspection costs ~14 s once per cache root).
CACHE_ROOT = Path(__file__).resolve().parent.parent / ".cache" / "vllm"

ModelRunner = Literal["v1", "v2"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
LoadOrder = Literal["vllm", "before_forward"]

_VOCAB_SIZE = 512
_HASH_MOD = (1 << 61) - 1
_VALUE_MOD = 65521  # values stay exact in float32
_MAX_FAILURES_PER_CHECK = 5
_TINY_KV_HEADS = 2


HISTORY: Final = 1000  # preemptions and resumes kept for inspection


def vllm_available() -> bool:
    """Return whether vLLM 0.33 can be imported here."""
    try:
        import vllm  # noqa: PLC0415
    except ImportError:
        return False
    return str(vllm.__version__).startswith("0.33")


def _prepare_environment() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(CACHE_ROOT))


# ------------------------------------------------------------ pure functions


def extend_hash(prefix_hash: int, token: int) -> int:
    """Return the hash of a prefix extended by one token (0: empty prefix)."""
    return (prefix_hash * 1_000_003 + token + 1) % _HASH_MOD


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """Return `h[p]`, a rolling hash of `token_ids[:p + 1]`, for every p."""
    hashes = []
    h = 0
    for token in token_ids:
        h = extend_hash(h, token)
        hashes.append(h)
    return hashes


def kv_values(hashes: Sequence[int], layer: int, width: int) -> torch.Tensor:
    """Return the KV each position holds in `layer`, shape `[len, width]`.

    Every value is a nonzero integer below 2**16, so it is exact in float32
    and differs from the zeros of a never-written slot.
    """
    import torch  # noqa: PLC0415

    h = torch.tensor([x % (1 << 31) for x in hashes], dtype=torch.int64)
    j = torch.arange(width, dtype=torch.int64)
    mix = h[:, None] * (j[None, :] * 2_654_435 + 40_503) + layer * 7_919 + j
    return (mix % _VALUE_MOD + 1).to(torch.float32)


def sample_token(prefix_hash: int) -> int:
    """Return the token "sampled" after the prefix with this hash."""
    return (prefix_hash * 31 + 7) % _VOCAB_SIZE


def first_token(prompt_token_ids: Sequence[int]) -> int:
    """Return the first token "sampled" after this prompt."""
    return sample_token(prefix_hashes(prompt_token_ids)[-1])


# ------------------------------------------------------------------- records


class HarnessError(AssertionError):
    """The connector or vLLM broke an invariant the harness checks."""


@dataclasses.dataclass
class StepReport:
    """What one `Harness.step()` did.

    `scheduled`, `preempted` and the KV connector fields describe the step
    scheduled (and executed) in this call, if any; `finished` and `updated`
    describe the `update_from_output` run in this call, which under async
    scheduling belongs to the previous scheduled step.
    """

    index: int
    scheduled: dict[str, int]
    preempted: frozenset[str]
    finished: dict[str, str]
    finished_sending: frozenset[str]
    finished_recving: frozenset[str]
    invalid_block_ids: frozenset[int]
    updated: bool
    num_free_blocks: int
    failures: list[str]


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """A finished request whose state `Harness.forget_finished` dropped."""

    req_id: str
    status: str
    request: Request
    external_hit_tokens: int


@dataclasses.dataclass
class _LayerStub:
    """Stands in for an attention layer in `ForwardContext`."""

    layer_name: str
    kv_cache: list[torch.Tensor]


@dataclasses.dataclass
class _AttnMetadata:
    """The part of vLLM's attention metadata a connector may read."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int


@dataclasses.dataclass
class _HeadSlots:
    """One head of a head-major KV tensor, indexed by slot.

    ``[blocks, heads, block_size, width]``, read and written by slot
    (``block * block_size + offset``) like the flat ``[slots, width]``
    view of a one-head tensor.
    """

    kv: torch.Tensor
    head: int

    def _where(self, slots: torch.Tensor) -> tuple[Any, ...]:
        bs = self.kv.shape[2]
        return (slots // bs, self.head, slots % bs)

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return self.kv[self._where(slots)]

    def __setitem__(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.kv[self._where(slots)] = values


@dataclasses.dataclass
class _WorkerRequest:
    """The model runner's cached state of one request."""

    block_ids: list[int]


# ------------------------------------------------------------------- harness


class Harness:
    """vLLM 0.33's real scheduler plus a stand-in model runner.

    Args:
        connector: dotted path of the connector class, such as
            `"tests.reference_connectors.ReferenceConnector"`; its module
            becomes `kv_connector_module_path`.
        kv_role: `"kv_both"`, `"kv_producer"` or `"kv_consumer"`.
        extra_config: `kv_connector_extra_config`.
        num_blocks: KV blocks in the pool, including vLLM's null block.
        block_size: tokens per block.
        num_layers: attention layers (one KV tensor each).
        kv_width: floats per token per layer (even: K and V halves).
        max_num_seqs: `SchedulerConfig.max_num_seqs`.
        max_num_batched_tokens: `SchedulerConfig.max_num_batched_tokens`.
        max_model_len: model context length.
        enable_prefix_caching: vLLM's local prefix cache.
        async_scheduling: use `AsyncScheduler` and the engine core's batch
            queue (schedule step N+1 before `update_from_output` of N).
        model_runner: the model runner whose scheduler behaviour to get
            (sets `VLLM_USE_V2_MODEL_RUNNER` around every vLLM call).
        load_order: `"vllm"` calls `start_load_kv` after the forward unless
            the step has a sync load (vLLM 0.33, both runners, GPU and CPU);
            `"before_forward"` always calls it before the forward.
        check_every_step: run the content and block checks after each step.
        log_stats: let the scheduler build `SchedulerStats` (with the
            connector's `kv_connector_stats`) in its outputs.
        kv_events_config: vLLM's ``--kv-events-config`` (`KVEventsConfig`
            fields): the scheduler publishes its KV-cache events, and the
            connector's, through vLLM's publisher.
        settle_lookups_s: after each `schedule()`, wait at most this long
            for the connector's admission lookups (a connector with a
            `wait_for_lookups(timeout_s)` method), as the forward pass of
            a real engine would; None never waits (benchmarks).
        tp_size: tensor-parallel ranks, each with its own WORKER-role
            connector (built while vLLM's `get_tensor_model_parallel_rank`
            answers its rank, as in a worker process) and KV tensors;
            their outputs are folded by vLLM's own `KVOutputAggregator`.
        kv_heads: the model's KV heads; each rank's KV tensors are then
            head-major ``[num_blocks, local heads, block_size, kv_width]``
            (``kv_heads / tp_size`` heads, or one head replicated on
            ``tp_size / kv_heads`` ranks) and every head holds its own
            values.  None: one head per block, ``[num_blocks, block_size,
            kv_width]`` (``tp_size`` must be 1).
        model: the model folder vLLM is configured with (it must hold a
            `config.json` of `num_layers` layers, see `tiny_model_dir`);
            None: one temporary folder shared by this process's harnesses.
        revision: `ModelConfig.revision`.

    """

    #: Requests whose token sampled this step vLLM drops (a failed
    #: layer-wise load: the step is recomputed).
    _discard: frozenset[str] = frozenset()

    def __init__(
        self,
        connector: str,
        *,
        kv_role: KVRole = "kv_both",
        extra_config: dict[str, Any] | None = None,
        num_blocks: int = 64,
        block_size: int = 16,
        num_layers: int = 2,
        kv_width: int = 8,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = False,
        model_runner: ModelRunner = "v2",
        load_order: LoadOrder = "vllm",
        check_every_step: bool = True,
        log_stats: bool = False,
        settle_lookups_s: float | None = 1.0,
        tp_size: int = 1,
        kv_heads: int | None = None,
        model: str | os.PathLike[str] | None = None,
        revision: str | None = None,
        kv_events_config: dict[str, Any] | None = None,
    ) -> None:
        _check_tp(tp_size, kv_heads)
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        self._rank = 0
        if model_runner not in ("v1", "v2"):
            msg = f"model_runner must be 'v1' or 'v2', not {model_runner!r}"
            raise ValueError(msg)
        if kv_width % 2:
            msg = f"kv_width must be even, not {kv_width}"
            raise ValueError(msg)
        _prepare_environment()
        self.model_runner: ModelRunner = model_runner
        self.async_scheduling = async_scheduling
        self.load_order: LoadOrder = load_order
        self.check_every_step = check_every_step
        self.log_stats = log_stats
        self.settle_lookups_s = settle_lookups_s
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_width = kv_width
        self.layer_names = [
            f"model.layers.{i}.self_attn.attn" for i in range(num_layers)
        ]

        self.failures: list[str] = []
        self.requests: dict[str, Request] = {}
        self.finished_status: dict[str, str] = {}
        # The latest preemptions and resumes (step, id[, how]); bounded, so
        # a long run (the soak) does not grow with every one.
        self.preempted: collections.deque[tuple[int, str]] = collections.deque(
            maxlen=HISTORY
        )
        self.resumed: collections.deque[tuple[int, str, str]] = (
            collections.deque(maxlen=HISTORY)
        )
        self.num_resumed = 0
        self._num_preemptions = 0
        self.external_hits: collections.Counter[str] = collections.Counter()
        self.num_steps = 0
        self.num_updates = 0

        self._tokens: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._worker_reqs: dict[str, _WorkerRequest] = {}
        self._batch_queue: collections.deque[
            tuple[SchedulerOutput, ModelRunnerOutput]
        ] = collections.deque()
        self._in_flight_aborts: list[str] = []
        self._awaiting_resume: set[str] = set()
        self._step_failures: list[str] = []
        # Per request, per layer: blocks whose KV was wrong when the
        # layer's wait returned (`_check_layer`), judged at step end.
        self._layer_misses: dict[str, dict[str, set[int]]] = {}

        module, _, class_name = connector.rpartition(".")
        with self._runner_env():
            self.vllm_config = self._make_vllm_config(
                module,
                class_name,
                kv_role=kv_role,
                extra_config=extra_config or {},
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                model=model,
                revision=revision,
                kv_events_config=kv_events_config,
            )
            self.kv_cache_config = self._make_kv_cache_config()
            self.scheduler = self._make_scheduler()
            self.worker_connector = self._make_worker_connector()
            self._batch_queue_size = (
                self.vllm_config.max_concurrent_batches
                if async_scheduling
                else 1
            )
            if self.vllm_config.use_v2_model_runner != (model_runner == "v2"):
                msg = f"vLLM did not select the {model_runner} model runner"
                raise HarnessError(msg)
        self._spy_on_scheduler_connector()

    # ------------------------------------------------------------ set-up

    @contextlib.contextmanager
    def _runner_env(self) -> Iterator[None]:
        """Make `vllm_config.use_v2_model_runner` answer for this harness."""
        key = "VLLM_USE_V2_MODEL_RUNNER"
        old = os.environ.get(key)
        os.environ[key] = "1" if self.model_runner == "v2" else "0"
        try:
            yield
        finally:
            if old is None:
                del os.environ[key]
            else:
                os.environ[key] = old

    def _make_vllm_config(
        self,
        module: str,
        class_name: str,
        *,
        kv_role: KVRole,
        extra_config: dict[str, Any],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool,
        model: str | os.PathLike[str] | None,
        revision: str | None,
        kv_events_config: dict[str, Any] | None,
    ) -> VllmConfig:
        from vllm.config import (  # noqa: PLC0415
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        if model is None:
            model = _model_dir(
                len(self.layer_names), max_model_len, self.kv_heads
            )
        model_config = ModelConfig(
            model=str(model),
            revision=revision,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=max_model_len,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            disable_hybrid_kv_cache_manager=True,
            async_scheduling=self.async_scheduling,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=enable_prefix_caching,
        )
        kv_transfer_config = KVTransferConfig(
            kv_connector=class_name,
            kv_connector_module_path=module,
            kv_role=kv_role,
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy="recompute",
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            kv_transfer_config=kv_transfer_config,
            kv_events_config=KVEventsConfig(**kv_events_config)
            if kv_events_config
            else None,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tp_size),
        )
        vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        return vllm_config

    def _make_kv_cache_config(self) -> KVCacheConfig:
        import torch  # noqa: PLC0415
        from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.local_heads,
            head_size=self.kv_width // 2,
            dtype=torch.float32,
        )
        page = spec.page_size_bytes
        return KVCacheConfig(
            num_blocks=self.num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * self.num_blocks,
                    layers=[name],
                    layer_stride=page * self.num_blocks,
                    block_stride=page,
                )
                for name in self.layer_names
            ],
            kv_cache_groups=[KVCacheGroupSpec(self.layer_names, spec)],
        )

    def _make_scheduler(self) -> Scheduler:
        from vllm.utils.hashing import sha256  # noqa: PLC0415
        from vllm.v1.core.kv_cache_utils import (  # noqa: PLC0415
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.structured_output import (  # noqa: PLC0415
            StructuredOutputManager,
        )

        # sha256 derives NONE_HASH from a fixed seed, so block hashes agree
        # across harness instances (a producer and a consumer).
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(self.block_size, sha256)
        scheduler_cls = self.vllm_config.scheduler_config.get_scheduler_cls()
        scheduler = scheduler_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(
                self.vllm_config
            ),
            block_size=self.block_size,
            hash_block_size=self.block_size,
            log_stats=self.log_stats,
        )
        return cast("Scheduler", scheduler)

    def _make_worker_connector(self) -> KVConnectorBase_V1:
        from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
            KVConnectorFactory,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVConnectorRole,
        )

        #: Per rank: (its WORKER-role connector, its KV tensors).
        self.ranks: list[tuple[KVConnectorBase_V1, dict[str, torch.Tensor]]]
        self.ranks = []
        for rank in range(self.tp_size):
            config = self.vllm_config
            if self.tp_size > 1:  # as vLLM's workers do, rank by rank
                config = copy.copy(config)
                config.parallel_config = copy.copy(config.parallel_config)
                config.parallel_config.rank = rank
            with _tp_rank_is(rank if self.tp_size > 1 else None):
                connector = KVConnectorFactory.create_connector(
                    config=config,
                    role=KVConnectorRole.WORKER,
                    kv_cache_config=self.kv_cache_config,
                )
                self._rank = rank
                caches = self._make_kv_caches()
                connector.register_kv_caches(caches)
            self.ranks.append((connector, caches))
        self._use_rank(0)
        return self.ranks[0][0]

    def _use_rank(self, rank: int) -> None:
        """Play rank `rank`: its connector and KV tensors become current."""
        self._rank = rank
        self.worker_connector, self.kv_caches = self.ranks[rank]

    @property
    def local_heads(self) -> int:
        """KV heads in one rank's cache."""
        if self.kv_heads is None:
            return 1
        return max(self.kv_heads // self.tp_size, 1)

    def rank_heads(self, rank: int) -> list[int]:
        """The model's KV heads rank `rank` holds, in its cache's order."""
        if self.kv_heads is None:
            return [0]
        if self.tp_size > self.kv_heads:  # replicated heads
            return [rank // (self.tp_size // self.kv_heads)]
        n = self.local_heads
        return list(range(rank * n, (rank + 1) * n))

    def _make_kv_caches(self) -> dict[str, torch.Tensor]:
        """Each layer's KV cache, by layer name (one tensor per layer)."""
        import torch  # noqa: PLC0415

        heads = () if self.kv_heads is None else (self.local_heads,)
        return {
            name: torch.zeros(
                self.num_blocks,
                *heads,
                self.block_size,
                self.kv_width,
                dtype=torch.float32,
            )
            for name in self.layer_names
        }

    def _head_views(self, name: str) -> list[tuple[int, Any]]:
        """Per head of the current rank's layer `name`: (model head, view).

        Each view is indexed by slot, as ``[slots, kv_width]``.
        """
        kv = self.kv_caches[name]
        if self.kv_heads is None:
            return [(0, kv.view(-1, self.kv_width))]
        heads = self.rank_heads(self._rank)
        return [(h, _HeadSlots(kv, i)) for i, h in enumerate(heads)]

    def _spy_on_scheduler_connector(self) -> None:
        """Count external hits as the scheduler hands them to the connector."""
        hits = self.external_hits

        def spy(original: Callable[..., None]) -> Callable[..., None]:
            def update_state_after_alloc(
                request: Request, blocks: Any, num_external_tokens: int
            ) -> None:
                hits[request.request_id] += num_external_tokens
                original(request, blocks, num_external_tokens)

            return update_state_after_alloc

        # The scheduler calls it through `self.connector`.
        shadow_method(
            self.scheduler_connector, "update_state_after_alloc", spy
        )

    # ------------------------------------------------------------ accessors

    @property
    def scheduler_connector(self) -> KVConnectorBase_V1:
        """The SCHEDULER-role connector that vLLM's scheduler created."""
        connector = self.scheduler.connector
        if connector is None:
            msg = "the scheduler has no KV connector"
            raise HarnessError(msg)
        return connector

    @property
    def external_hit_tokens(self) -> int:
        """Tokens admitted as external hits, summed over all admissions."""
        return sum(self.external_hits.values())

    @property
    def num_preemptions(self) -> int:
        """Preemptions seen in `SchedulerOutput.preempted_req_ids`."""
        return self._num_preemptions

    def finished_by_status(self) -> collections.Counter[str]:
        """Count finished requests by their final `RequestStatus` name."""
        return collections.Counter(self.finished_status.values())

    def output_token_ids(self, req_id: str) -> list[int]:
        """Return the tokens the scheduler recorded as the request's output."""
        return list(self.requests[req_id].output_token_ids)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks in the scheduler's block pool (cached ones included)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.get_num_free_blocks())

    def is_idle(self) -> bool:
        """Return whether the engine core would stop stepping."""
        return not self._batch_queue and not self.scheduler.has_requests()

    def forget_finished(self) -> list[FinishedRequest]:
        """Drop what the harness keeps of finished requests; return them.

        For long runs, whose memory would otherwise grow with every request
        seen.  A request vLLM still holds (a finished request whose load is
        draining) is kept until vLLM lets it go.
        """
        done = [
            FinishedRequest(
                req_id,
                status,
                self.requests[req_id],
                self.external_hits.pop(req_id, 0),
            )
            for req_id, status in self.finished_status.items()
            if req_id not in self.scheduler.requests
        ]
        for finished in done:
            del self.finished_status[finished.req_id]
        self.forget(finished.req_id for finished in done)
        return done

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop what the harness keeps of these finished requests.

        For drivers that step the scheduler themselves (benchmarks); the
        harness's own checks need the records of requests vLLM holds.
        """
        for req_id in req_ids:
            if req_id not in self.scheduler.requests:
                self.requests.pop(req_id, None)
                self._tokens.pop(req_id, None)
                self._hashes.pop(req_id, None)

    # ------------------------------------------------------------- requests

    def block_hashes_of(self, prompt_token_ids: Sequence[int]) -> list[Any]:
        """vLLM's block hashes of a prompt, as a request of it would have.

        Nothing is added: a driver can store a prompt's blocks before
        the request arrives.
        """
        request = self._new_request("block-hashes-of", prompt_token_ids, 1)
        return list(request.block_hashes)

    def _new_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        stop_token_ids: Sequence[int] = (),
    ) -> Request:
        """A vLLM request of exactly `max_tokens` tokens, hashed as vLLM's."""
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415
        from vllm.v1.request import Request  # noqa: PLC0415

        return Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                detokenize=False,
                stop_token_ids=list(stop_token_ids) or None,
            ),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        stop_token_ids: Sequence[int] = (),
    ) -> Request:
        """Add a request that generates exactly `max_tokens` tokens.

        It stops earlier (``FINISHED_STOPPED``) on a token of
        `stop_token_ids` (`first_token` tells a prompt's first).  An id may
        be reused once its previous request has finished.
        """
        old = self.requests.get(req_id)
        if old is not None and not old.is_finished():
            msg = f"request {req_id} is still running"
            raise ValueError(msg)
        self.finished_status.pop(req_id, None)
        prompt = list(prompt_token_ids)
        request = self._new_request(req_id, prompt, max_tokens, stop_token_ids)
        self.requests[req_id] = request
        self._tokens[req_id] = list(prompt)
        self._hashes[req_id] = prefix_hashes(prompt)
        with self._vllm_call(f"add_request({req_id})"):
            self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str, *, in_flight: bool = False) -> None:
        """Abort a request as the engine core does.

        With `in_flight`, the abort lands like a client abort that arrives
        during model execution: after the next step's execution, before its
        `update_from_output`.
        """
        if in_flight:
            self._in_flight_aborts.append(req_id)
            return
        self._finish_aborted([req_id])

    def _finish_aborted(self, req_ids: list[str]) -> None:
        from vllm.v1.request import RequestStatus  # noqa: PLC0415

        with self._vllm_call(f"finish_requests({req_ids})"):
            self.scheduler.finish_requests(
                req_ids, RequestStatus.FINISHED_ABORTED
            )
        self._record_finished()

    # ----------------------------------------------------------------- steps

    def step(self) -> StepReport:
        """Run one engine-core step; see `StepReport`."""
        self.num_steps += 1
        self._step_failures = []
        scheduled: dict[str, int] = {}
        preempted: frozenset[str] = frozenset()
        executed: ModelRunnerOutput | None = None
        if self.scheduler.has_requests():
            with self._vllm_call("schedule()"):
                scheduler_output = self.scheduler.schedule()
            self._settle_lookups()
            scheduled = dict(scheduler_output.num_scheduled_tokens)
            preempted = frozenset(scheduler_output.preempted_req_ids or ())
            self.preempted.extend((self.num_steps, r) for r in preempted)
            self._num_preemptions += len(preempted)
            self._awaiting_resume |= preempted
            executed = self._execute(scheduler_output)
            self._batch_queue.appendleft((scheduler_output, executed))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            queue_full = len(self._batch_queue) >= self._batch_queue_size
            if not queue_full and (
                model_executed or self.scheduler.has_requests()
            ):
                return self._report(scheduled, preempted, executed, None)
        updated = bool(self._batch_queue)
        if updated:
            update = self._batch_queue.pop()
            if self._in_flight_aborts:
                aborts, self._in_flight_aborts = self._in_flight_aborts, []
                self._finish_aborted(aborts)
            with self._vllm_call("update_from_output()"):
                self.scheduler.update_from_output(*update)
            self.num_updates += 1
        finished = self._record_finished()
        if self.check_every_step:
            self._check_contents()
            self._check_block_pool()
        return self._report(
            scheduled, preempted, executed, finished if updated else None
        )

    def _settle_lookups(self) -> None:
        wait = getattr(self.scheduler.connector, "wait_for_lookups", None)
        if self.settle_lookups_s is not None and callable(wait):
            wait(self.settle_lookups_s)

    def run_until_idle(
        self, max_steps: int = 1000, *, check: bool = True
    ) -> list[StepReport]:
        """Step until the engine core would stop, then `check()`.

        Raises:
            HarnessError: not idle after `max_steps`, or a check failed.

        """
        reports = []
        for _ in range(max_steps):
            if self.is_idle():
                break
            reports.append(self.step())
        else:
            if not self.is_idle():
                self._fail(f"not idle after {max_steps} steps")
        if check:
            self.check()
        return reports

    def check(self, *, final: bool = True) -> None:
        """Check now; raise `HarnessError` if any check ever failed.

        With `final`, also require that every request finished and every
        block is free again (the engine core has nothing left to do).
        """
        self._check_contents()
        self._check_block_pool()
        if final:
            self._check_drained()
        if self.failures:
            msg = f"{len(self.failures)} failure(s):\n" + "\n".join(
                self.failures[:50]
            )
            raise HarnessError(msg)

    def close(self) -> None:
        """Shut every connector instance and the scheduler down."""
        ranks = getattr(self, "ranks", None) or [
            (getattr(self, "worker_connector", None), {})
        ]
        for connector, _ in ranks:
            with contextlib.suppress(Exception):
                if connector is not None:
                    connector.shutdown()
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------- the worker

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Play the model runner for one scheduled step, on every rank."""
        with self._vllm_call("model runner"):
            positions = self._update_worker_states(scheduler_output)
        if self.tp_size == 1:
            return self._execute_rank(scheduler_output, positions)
        from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: PLC0415
            KVOutputAggregator,
        )

        if not hasattr(self, "_aggregator"):
            self._aggregator = KVOutputAggregator(self.tp_size)
        outputs = []
        for rank in range(self.tp_size):
            self._use_rank(rank)
            # A copy: a rank with nothing to report returns vLLM's shared
            # `EMPTY_MODEL_RUNNER_OUTPUT`, and the aggregator writes the
            # folded output (its expected rank count included) into the
            # object of rank 0.  Across processes, as in vLLM, each rank's
            # output is a fresh object; here the shared one would carry
            # one harness's count and completions into the next.
            output = self._execute_rank(scheduler_output, positions)
            outputs.append(copy.copy(output))
        self._use_rank(0)
        with self._vllm_call("KVOutputAggregator"):
            out = self._aggregator.aggregate(list(outputs))
        if out is None:
            msg = "KVOutputAggregator returned no output"
            raise HarnessError(msg)
        return out

    def _execute_rank(
        self, scheduler_output: SchedulerOutput, positions: dict[str, range]
    ) -> ModelRunnerOutput:
        """Play the current rank's model runner for one step."""
        from vllm.forward_context import (  # noqa: PLC0415
            ForwardContext,
            override_forward_context,
        )
        from vllm.v1.outputs import (  # noqa: PLC0415
            KVConnectorOutput,
            ModelRunnerOutput,
        )

        with self._vllm_call("model runner"):
            # A stand-in, not vLLM's AttentionMetadata.
            attn_metadata: Any = self._attn_metadata(positions)
            forward_context = ForwardContext(
                no_compile_layers={
                    name: _LayerStub(name, [kv])
                    for name, kv in self.kv_caches.items()
                },
                attn_metadata=dict.fromkeys(self.layer_names, attn_metadata),
                slot_mapping=dict.fromkeys(
                    self.layer_names, attn_metadata.slot_mapping
                ),
            )
            connector = self.worker_connector
            meta = scheduler_output.kv_connector_metadata
            if meta is None:
                msg = "SchedulerOutput carries no kv_connector_metadata"
                raise HarnessError(msg)
            has_forward = scheduler_output.total_num_scheduled_tokens > 0
            load_first = (
                self.load_order == "before_forward"
                or scheduler_output.has_sync_kv_loads
            )
            load_kwargs = self._load_kwargs(
                scheduler_output, has_forward=has_forward
            )
            with override_forward_context(forward_context):
                connector.handle_preemptions(meta)
                connector.bind_connector_metadata(meta)
                if load_first:
                    connector.start_load_kv(forward_context, **load_kwargs)
                if has_forward:
                    self._forward(positions, attn_metadata)
                if self.model_runner == "v2":
                    connector.finish_forward()
                if not load_first:
                    connector.start_load_kv(forward_context, **load_kwargs)
                connector.wait_for_save()  # type: ignore[no-untyped-call]
                results = connector.get_transfer_results(
                    scheduler_output.finished_req_ids
                )
                invalid = connector.get_block_ids_with_load_errors()
                self._judge_layers(invalid)
                # vLLM drops the token sampled this step by a running
                # request whose (layer-wise) load failed: it recomputes.
                self._discard = frozenset(
                    r
                    for r in positions
                    if invalid & set(self._worker_reqs[r].block_ids)
                )
                # The v2 runner turns empty sets into None;
                # the v1 runner passes them on as they are.
                empty: set[str] | None = (
                    None if self.model_runner == "v2" else set()
                )
                kv_output = KVConnectorOutput(
                    finished_sending=results.finished_sending or empty,
                    finished_recving=results.finished_recving or empty,
                    failed_recving=results.failed_recving,
                    invalid_block_ids=invalid,
                    kv_connector_stats=connector.get_kv_connector_stats(),
                    kv_cache_events=(
                        connector.get_kv_connector_kv_cache_events()
                    ),
                    kv_connector_worker_meta=(
                        connector.build_connector_worker_meta()
                    ),
                )
                connector.clear_connector_metadata()
        if not has_forward:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_output)
        req_ids = list(positions)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sample(r, positions[r]) for r in req_ids],
            kv_connector_output=kv_output,
        )

    def _load_kwargs(
        self, scheduler_output: SchedulerOutput, *, has_forward: bool
    ) -> dict[str, Any]:
        """Keyword arguments the runner passes to `start_load_kv`.

        The v1 runner passes none; the v2 runner passes the scheduler output
        and batch layout on steps with a forward.
        """
        if self.model_runner == "v1" or not has_forward:
            return {}
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return {
            "scheduler_output": scheduler_output,
            "request_ids": req_ids,
            "num_tokens": scheduler_output.total_num_scheduled_tokens,
        }

    def _update_worker_states(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, range]:
        """Apply the step to the runner's block tables, as the runner does.

        Returns the token positions each scheduled request computes.
        """
        for req_id in scheduler_output.finished_req_ids:
            self._worker_reqs.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids or ():
            self._worker_reqs.pop(req_id, None)
        starts = self._apply_new_requests(scheduler_output)
        starts.update(self._apply_cached_requests(scheduler_output))
        manager = self.scheduler.kv_cache_manager
        positions = {}
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            table = self._worker_reqs[req_id].block_ids
            expected = list(manager.get_block_ids(req_id)[0])
            if table != expected:
                self._fail(
                    f"{req_id}: runner block table {table} differs from the "
                    f"scheduler's {expected}"
                )
                self._worker_reqs[req_id].block_ids = expected
            positions[req_id] = range(starts[req_id], starts[req_id] + num_new)
        return positions

    def _apply_new_requests(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, int]:
        """New requests (and, under v2, resumed ones) bring a whole table."""
        starts = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._note_resumed(new.req_id, "scheduled_new_reqs")
            self._worker_reqs[new.req_id] = _WorkerRequest(
                list(new.block_ids[0])
            )
            starts[new.req_id] = new.num_computed_tokens
            tokens = new.prefill_token_ids or new.prompt_token_ids or []
            self._adopt_tokens(new.req_id, tokens, "new request")
        return starts

    def _apply_cached_requests(
        self, scheduler_output: SchedulerOutput
    ) -> dict[str, int]:
        """Continuing requests append blocks; v1-resumed ones replace them."""
        starts = {}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._note_resumed(req_id, "resumed_req_ids")
                self._worker_reqs[req_id] = _WorkerRequest(
                    list(new_ids[0]) if new_ids else []
                )
            elif req_id not in self._worker_reqs:
                self._fail(
                    f"{req_id}: scheduled as a continuing request, but the "
                    "runner holds no state for it (a resumed request not "
                    "marked as resumed?)"
                )
                self._worker_reqs[req_id] = _WorkerRequest([])
            elif new_ids:
                self._worker_reqs[req_id].block_ids.extend(new_ids[0])
            starts[req_id] = cached.num_computed_tokens[i]
            if req_id in cached.all_token_ids:
                self._adopt_tokens(
                    req_id, cached.all_token_ids[req_id], "resent tokens"
                )
        return starts

    def _note_resumed(self, req_id: str, how: str) -> None:
        """Record how a preempted request came back."""
        if req_id in self._awaiting_resume:
            self._awaiting_resume.discard(req_id)
            self.resumed.append((self.num_steps, req_id, how))
            self.num_resumed += 1

    def _adopt_tokens(
        self, req_id: str, tokens: Sequence[int], what: str
    ) -> None:
        """Take the tokens the scheduler sent, as the runner's state.

        They must be a prefix of what the harness sampled so far; sampled
        tokens the scheduler dropped are forgotten.
        """
        known = self._tokens[req_id]
        if list(tokens) != known[: len(tokens)]:
            self._fail(f"{req_id}: {what} disagree with the tokens so far")
            return
        del known[len(tokens) :]
        del self._hashes[req_id][len(tokens) :]

    def _slots(self, req_id: str, positions: range) -> torch.Tensor:
        import torch  # noqa: PLC0415

        table = self._worker_reqs[req_id].block_ids
        bs = self.block_size
        return torch.tensor(
            [table[p // bs] * bs + p % bs for p in positions],
            dtype=torch.int64,
        )

    def _attn_metadata(self, positions: dict[str, range]) -> _AttnMetadata:
        import torch  # noqa: PLC0415

        slots = [self._slots(r, ps) for r, ps in positions.items()]
        slot_mapping = (
            torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
        )
        return _AttnMetadata(slot_mapping, int(slot_mapping.numel()))

    def _forward(
        self, positions: dict[str, range], attn_metadata: Any
    ) -> None:
        """Write each scheduled token's KV, layer by layer, with the hooks."""
        connector = self.worker_connector
        for layer, name in enumerate(self.layer_names):
            connector.wait_for_layer_load(name)
            for head, kv in self._head_views(name):
                for req_id, ps in positions.items():
                    if not ps:
                        continue
                    hashes = self._hashes[req_id]
                    if ps.stop > len(hashes):
                        self._fail(
                            f"{req_id}: scheduled position {ps.stop - 1} but "
                            f"only {len(hashes)} tokens exist"
                        )
                        continue
                    kv[self._slots(req_id, ps)] = kv_values(
                        hashes[ps.start : ps.stop],
                        _head_layer(layer, head),
                        self.kv_width,
                    )
            if self.check_every_step:  # what the layer's attention reads
                self._check_layer(layer, name, positions)
            connector.save_kv_layer(name, self.kv_caches[name], attn_metadata)

    def _check_layer(
        self, layer: int, name: str, positions: dict[str, range]
    ) -> None:
        """When layer `name`'s attention runs, its KV is in.

        After `wait_for_layer_load(name)` and the step's own writes of the
        layer (another request of the batch may be computing a block this
        one hit in vLLM's prefix cache): every position a scheduled
        request counts as computed before this step (a local hit, a load,
        earlier steps) must hold, in this layer, the KV recomputation
        writes, unless the connector reports its block failed this step
        (`_judge_layers`).
        """
        for req_id, ps in positions.items():
            if not ps.start:
                continue
            hashes = self._hashes[req_id][: ps.start]
            slots = self._slots(req_id, range(ps.start))
            for head, kv in self._head_views(name):
                expected = kv_values(
                    hashes, _head_layer(layer, head), self.kv_width
                )
                bad = (kv[slots] != expected).any(dim=1).nonzero()
                if bad.numel():
                    blocks = {
                        int(slots[int(i)]) // self.block_size for i in bad
                    }
                    self._layer_misses.setdefault(req_id, {}).setdefault(
                        name, set()
                    ).update(blocks)

    def _judge_layers(self, invalid: set[int]) -> None:
        """Fail each layer whose KV was wrong when its wait returned.

        Not for blocks the connector reported as load errors this step
        (vLLM discards the step's output for them and recomputes).
        """
        misses, self._layer_misses = self._layer_misses, {}
        for req_id, layers in misses.items():
            for name, blocks in layers.items():
                if wrong := sorted(blocks - invalid):
                    self._fail(
                        f"step {self.num_steps}: {req_id}: layer {name} "
                        f"holds wrong KV in block(s) {wrong}"
                        " when its attention runs (not reported as load "
                        "errors)"
                    )

    def _sample(self, req_id: str, positions: range) -> list[int]:
        """Sample after a step that reaches the request's last known token."""
        tokens = self._tokens[req_id]
        if positions.stop < len(tokens):
            return []  # a partial prefill chunk
        if positions.stop > len(tokens):
            return []  # already failed in _forward
        token = sample_token(self._hashes[req_id][positions.stop - 1])
        if positions.stop == len(tokens) and req_id not in self._discard:
            tokens.append(token)
            hashes = self._hashes[req_id]
            hashes.append(extend_hash(hashes[-1], token))
        return [token]

    def _report(
        self,
        scheduled: dict[str, int],
        preempted: frozenset[str],
        executed: ModelRunnerOutput | None,
        finished: dict[str, str] | None,
    ) -> StepReport:
        kv = executed.kv_connector_output if executed is not None else None
        sending = (kv.finished_sending if kv else None) or ()
        recving = (kv.finished_recving if kv else None) or ()
        invalid = (kv.invalid_block_ids if kv else None) or ()
        return StepReport(
            index=self.num_steps,
            scheduled=scheduled,
            preempted=preempted,
            finished=finished or {},
            finished_sending=frozenset(sending),
            finished_recving=frozenset(recving),
            invalid_block_ids=frozenset(invalid),
            updated=finished is not None,
            num_free_blocks=self.num_free_blocks,
            failures=list(self._step_failures),
        )

    # --------------------------------------------------------------- checks

    @contextlib.contextmanager
    def _vllm_call(self, what: str) -> Iterator[None]:
        with self._runner_env():
            try:
                yield
            except HarnessError:
                raise
            except Exception as exc:
                self._fail(f"step {self.num_steps}: {what} raised {exc!r}")
                msg = f"{what} raised {exc!r}"
                raise HarnessError(msg) from exc

    def _fail(self, message: str) -> None:
        self.failures.append(message)
        self._step_failures.append(message)

    def _record_finished(self) -> dict[str, str]:
        finished = {}
        for req_id, request in self.requests.items():
            if req_id not in self.finished_status and request.is_finished():
                finished[req_id] = request.status.name
        self.finished_status.update(finished)
        self._awaiting_resume.difference_update(finished)
        return finished

    def _computed_requests(self) -> Iterator[tuple[str, Request]]:
        """Requests whose blocks must hold their computed tokens' KV.

        Skipped: nothing computed yet, finished, or still waiting for a
        load (its blocks are being written).
        """
        from vllm.v1.request import RequestStatus  # noqa: PLC0415

        for req_id, request in self.scheduler.requests.items():
            if (
                request.num_computed_tokens == 0
                or request.is_finished()
                or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ):
                continue
            yield req_id, request

    def _check_contents(self) -> None:
        """Every block covering a request's computed tokens holds its KV."""
        manager = self.scheduler.kv_cache_manager
        bs = self.block_size
        reported = 0
        for req_id, request in self._computed_requests():
            computed = request.num_computed_tokens
            table = manager.get_block_ids(req_id)[0]
            if len(table) * bs < computed:
                self._fail(
                    f"{req_id}: {computed} computed tokens but only "
                    f"{len(table)} blocks"
                )
                continue
            hashes = self._hashes[req_id][:computed]
            if len(hashes) < computed:
                self._fail(f"{req_id}: {computed} computed tokens unknown")
                continue
            table_tensor = self._table_tensor(table)
            positions = self._positions(computed)
            slots = table_tensor[positions // bs] * bs + positions % bs
            for rank, layer, name, head, kv in self._all_heads():
                actual = kv[slots]
                expected = kv_values(
                    hashes, _head_layer(layer, head), self.kv_width
                )
                bad = (actual != expected).any(dim=1).nonzero()
                if bad.numel() and reported < _MAX_FAILURES_PER_CHECK:
                    reported += 1
                    p = int(bad[0])
                    where = f" (rank {rank}, head {head})" * (
                        self.kv_heads is not None
                    )
                    self._fail(
                        f"step {self.num_steps}: {req_id} "
                        f"({request.status.name}, {computed} computed) "
                        f"holds wrong KV in {name}{where} at "
                        f"{bad.numel()} position(s), first {p} (block "
                        f"{table[p // bs]})"
                    )

    def _all_heads(
        self,
    ) -> Iterator[tuple[int, int, str, int, Any]]:
        """(rank, layer, name, model head, slot view) over every rank."""
        if self.tp_size == 1:  # also a subclass that builds no `ranks`
            for layer, name in enumerate(self.layer_names):
                for head, kv in self._head_views(name):
                    yield 0, layer, name, head, kv
            return
        current = self._rank
        for rank in range(self.tp_size):
            self._use_rank(rank)
            for layer, name in enumerate(self.layer_names):
                for head, kv in self._head_views(name):
                    yield rank, layer, name, head, kv
        self._use_rank(current)

    @staticmethod
    def _table_tensor(table: Sequence[int]) -> torch.Tensor:
        import torch  # noqa: PLC0415

        return torch.tensor(table, dtype=torch.int64)

    @staticmethod
    def _positions(count: int) -> torch.Tensor:
        import torch  # noqa: PLC0415

        return torch.arange(count, dtype=torch.int64)

    def _check_block_pool(self) -> None:
        """Reference counts never go negative and match the free queue."""
        pool = self.scheduler.kv_cache_manager.block_pool
        blocks = [b for b in pool.blocks if not b.is_null]
        negative = [b.block_id for b in blocks if b.ref_cnt < 0]
        if negative:
            self._fail(
                f"step {self.num_steps}: blocks freed more often than "
                f"allocated (ref_cnt < 0): {negative}"
            )
        unreferenced = sum(1 for b in blocks if b.ref_cnt == 0)
        if unreferenced != pool.get_num_free_blocks():
            self._fail(
                f"step {self.num_steps}: {pool.get_num_free_blocks()} blocks "
                f"in the free queue but {unreferenced} with ref_cnt 0"
            )
        manager = self.scheduler.kv_cache_manager
        for req_id in self.scheduler.requests:
            for block_id in manager.get_block_ids(req_id)[0]:
                block = pool.blocks[block_id]
                if not block.is_null and block.ref_cnt <= 0:
                    self._fail(
                        f"step {self.num_steps}: {req_id} holds block "
                        f"{block_id}, which is free"
                    )

    def _check_drained(self) -> None:
        """Every request finished and every block is free again."""
        unfinished = [
            r for r, req in self.requests.items() if not req.is_finished()
        ]
        if unfinished:
            self._fail(f"requests never finished: {unfinished}")
        if self.scheduler.requests:
            held = {
                r: req.status.name
                for r, req in self.scheduler.requests.items()
            }
            self._fail(f"scheduler still holds requests: {held}")
        usable = self.num_blocks - 1  # block 0 is vLLM's null block
        if self.num_free_blocks != usable:
            self._fail(
                f"leaked blocks: {self.num_free_blocks} of {usable} free at "
                "the end"
            )


@contextlib.contextmanager
def _tp_rank_is(rank: int | None) -> Iterator[None]:
    """vLLM's `get_tensor_model_parallel_rank` answers `rank` (None: as is).

    A worker process of a TP engine gets its rank from its TP process
    group; the harness plays every rank in one process without one.
    """
    if rank is None:
        yield
        return
    from vllm import distributed  # noqa: PLC0415

    name = "get_tensor_model_parallel_rank"
    original = getattr(distributed, name)
    setattr(distributed, name, lambda: rank)
    try:
        yield
    finally:
        setattr(distributed, name, original)


def _check_tp(tp_size: int, kv_heads: int | None) -> None:
    if tp_size < 1 or (tp_size > 1 and kv_heads is None):
        msg = f"tp_size {tp_size} needs kv_heads (and must be positive)"
        raise ValueError(msg)
    if kv_heads is not None and (
        kv_heads < 1 or (kv_heads % tp_size and tp_size % kv_heads)
    ):
        msg = f"kv_heads {kv_heads} do not split over {tp_size} ranks"
        raise ValueError(msg)


def _head_layer(layer: int, head: int) -> int:
    """The `kv_values` layer index of a head of a layer (head 0: layer)."""
    return layer + 1_000 * head


def _model_dir(
    num_layers: int, max_model_len: int, kv_heads: int | None
) -> Path:
    """The tiny model (2 KV heads), or a sibling with `kv_heads` KV heads.

    The sibling's folder name is fixed per process, so instances of one
    process share keys.
    """
    base = _tiny_model_dir(num_layers, max_model_len)
    if kv_heads is None or kv_heads == _TINY_KV_HEADS:
        return base
    return _heads_model_dir(base, kv_heads)


@functools.cache
def _heads_model_dir(base: Path, kv_heads: int) -> Path:
    folder = base.parent / f"{base.name}-kvh{kv_heads}"
    folder.mkdir(exist_ok=True)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = json.loads((base / "config.json").read_text())
    config["num_key_value_heads"] = kv_heads
    config["num_attention_heads"] = max(kv_heads, 4)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def tiny_model_dir(
    folder: Path, *, num_layers: int = 2, max_model_len: int = 1024
) -> Path:
    """Write the harness's tiny model `config.json` into `folder`.

    For a harness configured with a model path of its own (`model`);
    `num_layers` and `max_model_len` must match the harness's.
    """
    source = _tiny_model_dir(num_layers, max_model_len) / "config.json"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, folder / "config.json")
    return folder


@functools.cache
def _tiny_model_dir(num_layers: int, max_model_len: int) -> Path:
    """Write a tiny Llama `config.json` (no weights) into a temporary folder.

    The folder is made once per process and removed at exit.
    """
    folder = Path(tempfile.mkdtemp(prefix="kv-lifecycle-tiny-llama-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": _TINY_KV_HEADS,
        "num_hidden_layers": num_layers,
        "vocab_size": _VOCAB_SIZE,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
