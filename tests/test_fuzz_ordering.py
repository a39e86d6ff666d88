"""Ordering fuzzer: arbitrary interleavings of vLLM's connector hooks.

A hypothesis `RuleBasedStateMachine` drives the connector's scheduler half
(`connector.scheduler.side.SchedulerSide`) and worker half
(`connector.worker.side.WorkerSide`) with real parts: vLLM 0.33's `Request`
(real block hashes), `BlockPool` and `KVConnectorOutput`, CPU KV tensors
and the real `mooncake_master`; the workers read through a client of
their own with no segment and a load deadline, so every load is a peer's
(staged) and a layer-wise one is read in spans of layers while the
forward waits layer by layer.  A small reference model plays vLLM: which
ids it tracks, which blocks it handed out, which requests wait for their
KV.  Rules produce what vLLM does (lookups, allocations, scheduling steps
with preemptions, finishes, output updates with async-scheduling
reordering) and what it should not (duplicate finishes, finish before
lookup, lookups repeated without allocation, preemption of a loading
request, completions and job results for unknown, finished or still
loading ids, preempted ids vLLM does not track, allocation of a request
whose lookup is still in flight).  Admission lookups run when a rule lets
the lookup thread run (`lookups_return`), so their completions race
aborts, finishes, preemptions and re-admissions; some expire first (a
fake clock jumps past the lookup timeout); in half the examples they
leave as requests arrive (``on_new_request`` with a lookup wait budget),
so they race vLLM's first question too.  Examples run over one
or two tensor-parallel ranks (a worker and a KV shard each, results
reported by each rank in its own step and aggregated as vLLM does), or
one rank whose blocks are stored as two head-shard objects
(``store_tp_size``: read and written side by side, a layer landing once
both shards wrote it); in
some a third of the transfers fail (`tests.test_faults_vllm.Flaky`, which
scribbles over a failed load's blocks).

Invariants, checked after every rule:

- no exception escapes a hook (a rule raising fails the run);
- each step's receive completions are exactly the requests whose awaited
  load ended (never one vLLM does not await, never two for one load);
  delayed frees get exactly one send completion;
- the connector pins only blocks a live request holds and releases each
  pin exactly once (checked on vLLM's real block pool);
- loaded blocks hold exactly the deterministic content of their hash,
  and each layer of a layer-wise load is in when that layer's wait
  returns, or its blocks are reported that step;
- a finished request leaves no tracker;
- a lookup answer is None (held back) only for a waiting request, and a
  request is held back at most until its lookup returns or expires;
- at the end of each example, after draining: no tracker in either half,
  no open job, every pin released, every block free, no request left
  waiting for its KV.

Budget: ``FUZZ_PROFILE=ci`` (default, derandomized, `FUZZ_EXAMPLES`
examples, 300 by default) or ``FUZZ_PROFILE=long`` (``make fuzz``).
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import os
import time
import uuid

import attrs
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from connector.integration.vllm_connector import LifecycleWorkerMetadata
from connector.metadata import JobKind, JobResult, TransferJob, WorkerReport
from connector.parallel import ShardKeys, TPPlan
from connector.scheduler.side import Role, SchedulerSide
from connector.scheduler.store_lookup import StoreLookup
from connector.store import Regions, StoreClient
from connector.store.keys import KeyLayout, KeyScheme
from connector.worker.shards import group_lane
from connector.worker.side import KVLayout, WorkerSide
from connector.worker.transfer import open_transfer
from harness.prompts import arithmetic_prompt
from lifecycle.kv import Event
from tests.test_faults_vllm import Flaky

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

BS = 16  # tokens per block
NUM_BLOCKS = 20  # including vLLM's null block 0
LAYERS = 2
LAYER_BYTES = 1024
FAMILIES = 4  # prompt families; 0 and 1 are stored before the run
LENGTHS = (20, 33, 48, 64, 70)
MAX_TP = 2  # tensor-parallel ranks: each has its own KV shard and worker
HEADS = 2  # KV heads of the head-sharded examples: one rank, 2 objects
SHARD_PLAN = TPPlan(0, 1, num_kv_heads=HEADS, store_tp=HEADS)
MAX_QUEUE = 3  # outputs awaiting update_from_output (async scheduling)
SETTLE_S = 10.0  # bound on any transfer (the master is healthy)

settings.register_profile(
    "fuzz-ci",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    # Shrinking a stateful run costs minutes; CI reports the
    # unshrunk (derandomized, so reproducible) run, `make fuzz` shrinks.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz-long",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2000")),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
COVERAGE: collections.Counter[str] = collections.Counter()
PROFILE = settings.get_profile(
    "fuzz-long" if os.environ.get("FUZZ_PROFILE") == "long" else "fuzz-ci"
)


prompt = arithmetic_prompt  # one prompt family per seed


@functools.cache
def expected(block_hash: bytes, rank: int) -> torch.Tensor:
    """The KV rank `rank` holds for a block with this hash, `[LAYERS, B]`."""
    digest = hashlib.blake2b(bytes(block_hash) + bytes([rank]), digest_size=8)
    digest = digest.digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest) >> 1)
    return torch.randint(
        0, 256, (LAYERS, LAYER_BYTES), dtype=torch.uint8, generator=gen
    )


class Env:
    """Module-wide parts: KV shards registered once, fresh namespaces."""

    def __init__(self, client, reader):
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.client = client
        # The workers' client: no segment, so every load is a peer's
        # (staged, and layer-wise ones read in spans of layers).
        self.reader = reader
        self.kv = [
            {
                f"layer{i}": torch.zeros(
                    NUM_BLOCKS, LAYER_BYTES, dtype=torch.uint8
                )
                for i in range(LAYERS)
            }
            for _ in range(MAX_TP)
        ]
        self.tensors = [t for shard in self.kv for t in shard.values()]
        # Rank 0's cache seen head-major ([blocks, heads, bytes]): the
        # head-sharded examples store each head as an object of its own.
        self.heads = {
            name: t.view(NUM_BLOCKS, HEADS, LAYER_BYTES // HEADS)
            for name, t in self.kv[0].items()
        }
        for tensor in self.tensors:
            client.register_tensor(tensor)
            reader.register_tensor(tensor)
        self.layouts = [KVLayout.from_tensors(s, NUM_BLOCKS) for s in self.kv]
        self.run = uuid.uuid4().hex[:8]
        self.examples = 0

    def request(self, req_id, family, length):
        return Request(
            request_id=req_id,
            prompt_token_ids=prompt(family, length),
            sampling_params=SamplingParams(
                max_tokens=4, ignore_eos=True, detokenize=False
            ),
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def write(self, block_id, block_hash):
        """What the forward pass writes, on every rank."""
        for rank, shard in enumerate(self.kv):
            content = expected(block_hash, rank)
            for i, tensor in enumerate(shard.values()):
                tensor[block_id] = content[i]

    def holds(self, block_id, block_hash, rank, layer=None):
        """Whether the block holds its content (of one layer, if given)."""
        content = expected(block_hash, rank)
        return all(
            torch.equal(tensor[block_id], content[i])
            for i, tensor in enumerate(self.kv[rank].values())
            if layer is None or i == layer
        )

    def fresh_store(self, tp, *, sharded=False):
        """A namespace of its own for one example, so examples repeat.

        Families 0 and 1 (full length) are stored first, on every rank, as
        another instance would have.  `sharded` (one rank): as `HEADS`
        head-shard objects per block (`store_tp_size`), the schemes
        returned being the shards'.
        """
        self.examples += 1
        schemes = [
            KeyScheme(
                namespace=f"fuzz-{self.run}-{self.examples}",
                model="fuzz",
                tp_rank=rank,
                tp_size=tp,
                layout=KeyLayout(
                    "uint8", BS, LAYERS * LAYER_BYTES, detail="2l"
                ),
            )
            for rank in range(tp)
        ]
        if sharded:
            schemes = list(SHARD_PLAN.schemes(schemes[0]))
        for family in (0, 1):
            hashes = self.request("seed", family, max(LENGTHS)).block_hashes
            ids = list(range(1, len(hashes) + 1))
            for block_id, block_hash in zip(ids, hashes, strict=True):
                self.write(block_id, block_hash)
            for rank, scheme in enumerate(schemes):
                regions = (
                    self.head_regions(ids, rank)
                    if sharded
                    else Regions.pieces(*self.layouts[rank].pieces(ids))
                )
                result = self.client.put(scheme.keys(hashes), regions)
                assert result.ok, list(result)
        for tensor in self.tensors:
            tensor.zero_()
        return schemes, StoreLookup(self.client, tuple(schemes))

    def head_regions(self, ids, head):
        """Blocks `ids` of rank 0's head `head`, every layer's slice."""
        views = list(self.heads.values())
        return Regions.pieces(
            [[v[b, head].data_ptr() for v in views] for b in ids],
            [[LAYER_BYTES // HEADS] * len(views) for _ in ids],
        )

    def close(self):
        for tensor in self.tensors:
            self.client.unregister(tensor.data_ptr())
            self.reader.unregister(tensor.data_ptr())


@pytest.fixture(scope="module")
def env(store_client):
    reader = StoreClient.open(
        attrs.evolve(store_client.config, global_segment_size=0),
        check_regions=True,
    )
    made = Env(store_client, reader)
    yield made
    made.close()
    reader.close()


class PinSpy:
    """vLLM's real block pool, seen by the connector; counts its pins."""

    def __init__(self, pool, violations):
        self.pool = pool
        self.blocks = pool.blocks
        self.touched = collections.Counter()
        self.freed = collections.Counter()
        self.violations = violations

    def touch(self, blocks):
        for block in blocks:
            if block.ref_cnt <= 0:
                self.violations.append(f"pinned free block {block.block_id}")
            self.touched[block.block_id] += 1
        self.pool.touch(blocks)

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        for block in blocks:
            self.freed[block.block_id] += 1
            if self.freed[block.block_id] > self.touched[block.block_id]:
                self.violations.append(
                    f"block {block.block_id} released more often than pinned"
                )
        self.pool.free_blocks(blocks)

    @property
    def pinned(self):
        return sum((self.touched - self.freed).values())


class Status(enum.Enum):
    """What vLLM's scheduler thinks of a request."""

    WAITING = "waiting"  # queued, or preempted and queued again
    LOADING = "loading"  # WAITING_FOR_REMOTE_KVS
    RUNNING = "running"
    HELD = "held"  # finished while loading: blocks kept until recv
    GONE = "gone"  # finished and freed


@attrs.define(eq=False)
class Ref:
    """vLLM's view of one request."""

    request: Request
    status: Status = Status.WAITING
    blocks: list = attrs.field(factory=list)
    computed: int = 0
    lookup: tuple[int, int] | None = None  # (local tokens, external)
    table_sent: bool = False
    ever_scheduled: bool = False
    load: TransferJob | None = None  # the load job vLLM awaits
    layerwise: bool = False  # its load is layer-wise: it runs meanwhile
    unanswered: bool = False  # admitted while its lookup was in flight

    @property
    def req_id(self):
        return self.request.request_id

    @property
    def hashes(self):
        return self.request.block_hashes

    @property
    def length(self):
        return self.request.num_prompt_tokens


@attrs.define
class Output:
    """A scheduled step's model-runner output, awaiting its update."""

    kv: KVConnectorOutput
    step: int
    #: Blocks of the step's layer-wise loads (their errors are handled
    #: in the step itself, `check_layerwise`).
    layerwise: frozenset[int] = frozenset()


class OrderingFuzzer(RuleBasedStateMachine):
    """vLLM (the reference model) driving the connector's two halves."""

    def __init__(self, env):
        super().__init__()
        self.env = env
        self.violations: list[str] = []
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=False,
                              hash_block_size=BS)  # fmt: skip
        self.spy = PinSpy(self.pool, self.violations)
        self.workers: list[WorkerSide] = []
        self.sharded = False
        self.connect(tp=1)
        self.refs: dict[str, Ref] = {}
        self.outputs: collections.deque[Output] = collections.deque()
        self.finished_since_step: set[str] = set()
        self.jobs_issued = 0
        self.drained = 0  # job results the workers reported so far
        self.rank_results = collections.Counter()  # job id -> ranks done
        self.load_errors: set[int] = set()  # reported, not yet received
        self.settled_jobs: set[int] = set()
        self.jobs: dict[int, TransferJob] = {}
        self.next_id = 0
        self.runner = "v2"
        self.now = 0.0  # the lookups' clock (seconds)
        self.recv_delivered = collections.Counter()
        self.send_delivered = collections.Counter()
        self.delayed: set[str] = set()
        self.layerwise = 0  # the scheduler half's layer-wise bound

    def connect(self, tp, *, sharded=False):
        """The connector's halves over `tp` ranks, on a fresh namespace.

        `sharded` (one rank): the rank's blocks are stored as `HEADS`
        head-shard objects, read and written side by side (`Sharded`).
        """
        self.retire_workers()
        self.tp, self.sharded = tp, sharded
        schemes, lookup = self.env.fresh_store(tp, sharded=sharded)
        self.side = SchedulerSide(
            block_size=BS,
            role=Role.BOTH,
            lookup=lookup,
            world_size=tp,
            threaded_lookups=False,  # they run in `lookups_return`
        )
        self.side.lookups.clock = lambda: self.now
        self.side.bind_block_pool(self.spy)
        if sharded:
            self.workers = [self.sharded_worker(schemes)]
            return
        self.workers = [
            WorkerSide(
                self.env.reader,
                scheme,
                self.env.layouts[rank],
                Regions,
                transfer=open_transfer(
                    self.env.kv[rank],
                    NUM_BLOCKS,
                    Regions,
                    register=self.env.reader.register,
                    deadlines=True,
                ),
                load_timeout_s=SETTLE_S,
            )
            for rank, scheme in enumerate(schemes)
        ]

    def sharded_worker(self, schemes):
        """Rank 0's worker over its head shards (`group_lane`'s lane)."""
        lane = group_lane(
            self.env.heads,
            NUM_BLOCKS,
            Regions,
            register=self.env.reader.register,
            plan=SHARD_PLAN,
            keys=ShardKeys(tuple(schemes)),
            block_bytes=LAYERS * LAYER_BYTES,
            deadlines=True,
        )
        return WorkerSide(
            self.env.reader,
            lane.keys,
            self.env.layouts[0],
            Regions,
            transfer=lane.transfer,
            lanes=[lane],
            load_timeout_s=SETTLE_S,
        )

    # -- helpers --------------------------------------------------------------

    def retire_workers(self):
        """Shut the workers down; unregister their load staging."""
        for worker in self.workers:
            assert worker.shutdown(), "a worker's transfer did not stop"
            for ptr in worker.registered:
                self.env.reader.unregister(ptr)

    def live(self, *statuses):
        return sorted(
            r for r, ref in self.refs.items() if ref.status in statuses
        )

    def pick(self, ids, n):
        return self.refs[ids[n % len(ids)]]

    def free(self, ref):
        if any(self.spy.touched[b.block_id] > self.spy.freed[b.block_id]
               for b in ref.blocks):  # fmt: skip
            COVERAGE["pins outlived their request"] += 1
        if ref.blocks:
            self.pool.free_blocks(reversed(ref.blocks))
        ref.blocks = []

    def end(self, ref, status):
        ref.request.status = status
        delay, _ = self.side.request_finished(
            ref.request, [b.block_id for b in ref.blocks]
        )
        if delay:
            self.delayed.add(ref.req_id)
        self.finished_since_step.add(ref.req_id)
        if ref.status in (Status.GONE, Status.HELD):
            return  # a duplicate finish: only the hook sees it
        if ref.status is Status.LOADING:
            COVERAGE["finished while loading"] += 1
            ref.status = Status.HELD  # vLLM awaits the receive completion
        else:
            ref.status = Status.GONE
            if not delay:
                self.free(ref)

    def wait_for_transfers(self):
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            queued = sum(w._done.qsize() for w in self.workers)
            if self.drained + queued >= self.jobs_issued * self.tp:
                return
            time.sleep(0.001)
        self.violations.append(f"transfers not done within {SETTLE_S} s")

    # -- vLLM's rules ------------------------------------------------------

    @initialize(
        runner=st.sampled_from(["v1", "v2"]),
        families=st.lists(st.integers(0, FAMILIES - 1), max_size=4),
        lossy=st.sampled_from([None, None, 1, 2, 3]),
        tp=st.integers(1, MAX_TP),
        layerwise=st.sampled_from([0, 2, 8, 8]),
        on_arrival=st.booleans(),
        sharded=st.booleans(),
    )
    def start(
        self,
        runner,
        families,
        lossy,
        tp,
        *,
        layerwise=0,
        on_arrival=0,
        sharded=False,
    ):
        """Pick the runner, the ranks (or one rank over head shards),
        the link, the layer-wise bound (hits of at most that many blocks
        load layer-wise) and whether lookups leave as requests arrive (a
        lookup wait budget); a few requests arrive."""
        self.runner = runner
        sharded = sharded and tp == 1
        if (tp, sharded) != (self.tp, self.sharded):
            self.connect(tp, sharded=sharded)
        self.layerwise = layerwise
        self.side.layerwise_max_blocks = layerwise
        # Lookups run only in `lookups_return`: the budget is never
        # waited out, it only sends each lookup in `on_new_request`.
        self.side.lookup_wait_s = 1e-3 if on_arrival else 0.0
        if lossy is not None:  # a third of the transfers fail, seeded
            for rank, worker in enumerate(self.workers):
                seed = f"{lossy}/{rank}"
                worker._store = Flaky(self.env.reader, seed, rate=1 / 3)
        for i, family in enumerate(families):
            self.add_request(family, LENGTHS[(family + i) % len(LENGTHS)], 1)

    @rule(
        family=st.integers(0, FAMILIES - 1),
        length=st.sampled_from(LENGTHS),
        reuse=st.integers(0, 50),
    )
    def add_request(self, family, length, reuse):
        """A new request; sometimes it reuses the id of a finished one."""
        gone = self.live(Status.GONE)
        if gone and reuse % 3 == 0:
            req_id = gone[reuse % len(gone)]
        else:
            req_id = f"r{self.next_id}"
            self.next_id += 1
        request = self.env.request(req_id, family, length)
        self.refs[req_id] = Ref(request)
        sent = self.side.lookup_counts["on_arrival"]
        self.side.on_new_request(request)
        COVERAGE["lookups sent on arrival"] += (
            self.side.lookup_counts["on_arrival"] - sent
        )

    @precondition(lambda self: self.refs)
    @rule(n=st.integers(0, 50), local=st.integers(0, 2))
    def lookup(self, n, local):
        """vLLM asks (again and again, or for a running request)."""
        ids = self.live(Status.WAITING, Status.RUNNING)
        if not ids:
            return
        self.ask(self.pick(ids, n), local)

    def ask(self, ref, local):
        """`get_num_new_matched_tokens` as vLLM calls it."""
        local_tokens = min(local * BS, (ref.length - 1) // BS * BS)
        ext, load_async = self.side.get_num_new_matched_tokens(
            ref.request, local_tokens
        )
        if ext is None:  # held back: the lookup runs off this thread
            COVERAGE["lookups held back"] += 1
            running = ref.status is not Status.WAITING and not ref.unanswered
            if running or load_async:
                self.violations.append(f"{ref.req_id}: None while running")
            ref.lookup = None
            return
        if ext < 0 or ext % BS or local_tokens + ext >= ref.length:
            self.violations.append(f"{ref.req_id}: bad hit {ext}")
        layerwise = 0 < ext // BS <= self.layerwise
        if load_async != (ext > 0 and not layerwise):
            self.violations.append(f"{ref.req_id}: async flag {load_async}")
        if ref.status is Status.WAITING:
            ref.lookup = (local_tokens, ext)
            ref.layerwise = layerwise
            COVERAGE["store hits answered"] += ext > 0

    @precondition(lambda self: self.live(Status.WAITING))
    @rule(n=st.integers(0, 50))
    def allocate(self, n):
        """Admit a waiting request: ask unless answered, blocks, the hook."""
        ref = self.pick(self.live(Status.WAITING), n)
        if not ref.lookup:
            self.ask(ref, n % 3)
        if ref.lookup:  # None: held back, its lookup is in flight
            self.admit(ref)

    def admit(self, ref):
        """Allocate a looked-up request's blocks, then tell the connector."""
        need = -(-ref.length // BS)
        if need > self.pool.get_num_free_blocks():
            return
        ref.blocks = self.pool.get_new_blocks(need)
        local, ext = ref.lookup
        ref.lookup = None
        for i in range(local // BS):  # vLLM's own prefix-cache hit
            self.env.write(ref.blocks[i].block_id, ref.hashes[i])
        self.side.update_state_after_alloc(
            ref.request, KVCacheBlocks((ref.blocks,)), ext
        )
        ref.computed = local + ext
        ref.table_sent = False
        # A layer-wise load runs in the step vLLM schedules it in.
        ext_async = ext and not ref.layerwise
        ref.status = Status.LOADING if ext_async else Status.RUNNING
        COVERAGE["layer-wise loads admitted"] += bool(ext) and ref.layerwise

    @precondition(lambda self: self.side.lookups.queued)
    @rule(expire=st.booleans())
    def lookups_return(self, expire):
        """The lookup thread runs the dispatched batches, maybe too late."""
        if expire:
            self.now += self.side.lookups.timeout_s + 1.0
        self.side.lookups.run_pending()

    @precondition(lambda self: self.live(Status.WAITING))
    @rule(n=st.integers(0, 50))
    def admit_unanswered(self, n):
        """vLLM allocates a request whose lookup it has not had answered."""
        ids = [r for r in self.live(Status.WAITING) if not self.refs[r].lookup]
        if ids:
            ref = self.pick(ids, n)
            ref.lookup = (0, 0)
            ref.unanswered = True  # until it is preempted or ends
            self.admit(ref)

    @precondition(lambda self: len(self.outputs) < MAX_QUEUE)
    @rule(
        preempt=st.sets(st.integers(0, 50), max_size=2),
        odd_preempt=st.sampled_from(["", "loading", "gone", "unknown"]),
        chunk=st.sampled_from([BS, 2 * BS, 40, 128]),
        collect=st.lists(st.booleans(), min_size=MAX_TP, max_size=MAX_TP),
        admit=st.integers(0, 3),
        local=st.integers(0, 2),
        lookups=st.sampled_from([True, True, False]),
    )
    def schedule(
        self, *, preempt, odd_preempt, chunk, collect, admit, local,
        lookups=True,
    ):  # fmt: skip
        """One step: preempt, admit, build the metadata, run the worker.

        With `lookups`, the lookup thread answers the step's lookups
        during the forward pass; otherwise they wait for `lookups_return`.
        """
        preempted = self.preempt(preempt, odd_preempt)
        # vLLM asks every waiting request (a held-back one gets None and
        # is skipped) and admits what fits.
        for req_id in self.live(Status.WAITING):
            ref = self.refs[req_id]
            if req_id in preempted:
                continue
            if admit <= 0:
                if ref.lookup is None:
                    self.ask(ref, local)
                continue
            self.ask(ref, local)
            if ref.lookup:  # None: held back this step
                self.admit(ref)
                admit -= 1
        new_reqs, cached, scheduled = self.batch(chunk)
        so = SchedOut(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            preempted_req_ids=preempted,
            finished_req_ids=set(self.finished_since_step),
        )
        self.finished_since_step.clear()
        meta = self.side.build_connector_meta(so)
        if lookups:
            self.side.lookups.run_pending()
        self.check_jobs(meta)
        self.execute(meta, scheduled, collect=collect)

    def preempt(self, picks, odd_preempt):
        """vLLM preempts running requests (and frees their blocks)."""
        preempted = set()
        running = self.live(Status.RUNNING)
        for n in picks:
            if running:
                preempted.add(self.pick(running, n).req_id)
        COVERAGE["preemptions"] += len(preempted)
        for req_id in preempted:
            ref = self.refs[req_id]
            self.free(ref)
            ref.status = Status.WAITING
            ref.computed = 0
            ref.lookup = None
        odd = {
            "loading": self.live(Status.LOADING),
            "gone": self.live(Status.GONE),
            "unknown": ["never-seen"],
        }.get(odd_preempt, [])
        preempted.update(odd[:1])
        return preempted

    def batch(self, chunk):
        """Schedule a prefill chunk of every running request."""
        new_reqs, cached = [], CachedReqs()
        scheduled = {}
        for req_id in self.live(Status.RUNNING):
            ref = self.refs[req_id]
            todo = min(chunk, ref.length - ref.computed)
            if todo <= 0:
                continue
            scheduled[req_id] = todo
            table = [b.block_id for b in ref.blocks]
            if ref.table_sent:
                cached.add(req_id, None, ref.computed, resumed=False)
            elif ref.ever_scheduled and self.runner == "v1":
                cached.add(req_id, (table,), ref.computed, resumed=True)
            else:
                new_reqs.append(NewReq(req_id, (table,), ref.computed))
            ref.table_sent = ref.ever_scheduled = True
        return new_reqs, cached, scheduled

    def execute(self, meta, scheduled, *, collect):
        """The model runner: forward (writes KV), then the worker hooks.

        Transfers always run to the end (the run stays deterministic);
        a rank not in `collect` drains its results a later step, as if
        they had not finished yet.
        """
        layerwise = [
            j for j in meta.jobs if j.kind is JobKind.LOAD and j.layerwise
        ]
        unfilled = self.start_and_wait(meta, layerwise)
        for req_id, todo in scheduled.items():
            ref = self.refs[req_id]
            end = ref.computed + todo
            last = min(end // BS, len(ref.hashes))
            for i in range(ref.computed // BS, last):
                self.env.write(ref.blocks[i].block_id, ref.hashes[i])
            ref.computed = end
        for worker in self.workers:
            worker.wait_for_save(meta)
        self.wait_for_transfers()
        recving, invalid, meta_out = set(), set(), None
        for index, (worker, drain) in enumerate(
            zip(self.workers, collect, strict=False)
        ):
            if not drain:
                continue
            recving |= worker.get_finished()[1] or set()
            errors = worker.get_block_ids_with_load_errors()
            self.check_layerwise(unfilled[index], index, errors)
            invalid |= errors
            report = worker.build_report()
            if report is None:
                continue
            self.drained += sum(r.ok + r.failed for r in report.results)
            rank = LifecycleWorkerMetadata(report)
            meta_out = rank if meta_out is None else meta_out.aggregate(rank)
        kv = KVConnectorOutput(
            finished_recving=recving or None,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=meta_out,
        )
        self.outputs.append(
            Output(
                kv,
                meta.step,
                frozenset(b for j in layerwise for b in j.block_ids),
            )
        )
        for job in layerwise:
            ref = self.refs.get(job.req_id)
            if ref is not None and ref.load is job:
                ref.load = None  # over within its step: nothing awaited
                self.recompute_from(ref, invalid, job.block_ids)

    def start_and_wait(self, meta, layerwise):
        """Start the step's loads, then wait layer by layer, as the
        forward does: per rank, what a layer's wait let through without
        its KV (it must be reported this step)."""
        for worker in self.workers:
            worker.handle_preemptions(meta)
            worker.start_load_kv(meta)
        unfilled = [set() for _ in self.workers]
        for layer in range(LAYERS):
            for rank, worker in enumerate(self.workers):
                worker.wait_for_layer_load(f"layer{layer}")
                unfilled[rank] |= self.unfilled(layerwise, rank, layer)
        return unfilled

    def unfilled(self, jobs, rank, layer):
        """Blocks of live layer-wise loads whose `layer` is not in."""
        missing = set()
        for job in jobs:
            ref = self.refs.get(job.req_id)
            if ref is None or ref.load is not job:
                continue  # preempted or ended since
            if layer == 0:
                COVERAGE["layer-wise loads run"] += 1
            for block_id, block_hash in zip(
                job.block_ids, job.block_hashes, strict=True
            ):
                if not self.env.holds(block_id, block_hash, rank, layer):
                    missing.add((job.req_id, block_id, layer))
        return missing

    def check_layerwise(self, unfilled, rank, errors):
        """A layer-wise load's layer is in when that layer's wait returns,
        on this rank, or its blocks are reported this step."""
        for req_id, block_id, layer in sorted(unfilled):
            if block_id in errors:
                COVERAGE["layer-wise blocks recomputed"] += 1
            else:
                self.violations.append(
                    f"{req_id}: layer {layer} of layer-wise block "
                    f"{block_id} not in on rank {rank} after its wait, "
                    "and not reported"
                )

    def recompute_from(self, ref, invalid, block_ids):
        """vLLM recomputes a running request from its first bad block."""
        table = [b.block_id for b in ref.blocks]
        bad = [table.index(b) for b in block_ids if b in invalid]
        if bad:
            ref.computed = min(ref.computed, min(bad) * BS)

    @precondition(lambda self: self.outputs)
    @rule(
        junk_recv=st.sampled_from(["", "unknown", "gone", "loading"]),
        junk_job=st.sampled_from(["", "unknown", "settled"]),
    )
    def update(self, junk_recv, junk_job):
        """`update_from_output` of the oldest step, maybe with junk added."""
        out = self.outputs.popleft()
        kv = out.kv
        recving = set(kv.finished_recving or ())
        junk = {
            "unknown": ["never-seen"],
            "gone": self.live(Status.GONE),
            "loading": self.live(Status.LOADING),
        }.get(junk_recv, [])
        recving.update(junk[:1])
        kv.finished_recving = recving or None
        results = (
            list(kv.kv_connector_worker_meta.results)
            if (kv.kv_connector_worker_meta)
            else []
        )
        awaited = set()
        for result in results:
            self.rank_results[result.job_id] += result.ok + result.failed
            if self.rank_results[result.job_id] < self.tp:
                continue  # another rank has not finished it yet
            self.settled_jobs.add(result.job_id)
            job = self.jobs[result.job_id]
            ref = self.refs.get(job.req_id)
            if ref is not None and ref.load is job and not job.layerwise:
                awaited.add(job.req_id)
        if junk_job == "unknown":
            results.append(JobResult(10**9, ok=1))
        elif junk_job == "settled" and self.settled_jobs:
            results.append(JobResult(min(self.settled_jobs), ok=1))
        kv.kv_connector_worker_meta = LifecycleWorkerMetadata(
            WorkerReport(tuple(results))
        )
        self.side.update_connector_output(kv)
        kv.invalid_block_ids = set(kv.invalid_block_ids or ()) - out.layerwise
        delivered = set(kv.finished_recving or ())
        if delivered != awaited:
            self.violations.append(
                f"step {out.step}: receive completions {sorted(delivered)}, "
                f"loads that ended {sorted(awaited)}"
            )
        self.apply(kv)

    @precondition(lambda self: self.refs)
    @rule(
        n=st.integers(0, 50),
        aborted=st.booleans(),
        again=st.booleans(),
    )
    def finish(self, n, aborted, again):
        """vLLM finishes a request (any state); maybe a second time."""
        ended = (Status.GONE, Status.HELD) if again else ()
        ids = self.live(Status.WAITING, Status.LOADING, Status.RUNNING, *ended)
        if not ids:
            return
        status = (
            RequestStatus.FINISHED_ABORTED
            if aborted
            else RequestStatus.FINISHED_LENGTH_CAPPED
        )
        self.end(self.pick(ids, n), status)

    # -- what vLLM does with an output ----------------------------------------

    def apply(self, kv):
        """Check the output against vLLM's contracts, then apply it."""
        for req_id in sorted(kv.finished_sending or ()):
            self.send_delivered[req_id] += 1
            if req_id not in self.delayed:
                self.violations.append(f"send completion for {req_id}")
            self.delayed.discard(req_id)
        # A rank's load errors may come a step before the completion.
        self.load_errors |= set(kv.invalid_block_ids or ())
        for req_id in sorted(kv.finished_recving or ()):
            self.recv_delivered[req_id] += 1
            ref = self.refs.get(req_id)
            if ref is None or ref.status not in (Status.LOADING, Status.HELD):
                state = ref.status.name if ref else "unknown"
                self.violations.append(
                    f"receive completion for {req_id}, which vLLM does not "
                    f"await ({state})"
                )
                continue
            self.check_loaded(ref, self.load_errors)
            if ref.status is Status.HELD:
                ref.status = Status.GONE
                self.free(ref)
            else:
                ref.status = Status.RUNNING
                ref.table_sent = False
            ref.load = None

    def check_loaded(self, ref, invalid):
        if ref.load is None:
            self.violations.append(f"{ref.req_id}: completion, no load job")
            return
        block_ids, hashes = ref.load.block_ids, ref.load.block_hashes
        table = [b.block_id for b in ref.blocks]
        first_bad = None
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            if block_id in invalid:
                first_bad = first_bad if first_bad is not None else block_id
                continue
            for rank in range(self.tp):
                if not self.env.holds(block_id, block_hash, rank):
                    self.violations.append(
                        f"{ref.req_id}: block {block_id} loaded wrong bytes "
                        f"on rank {rank}"
                    )
        invalid.difference_update(block_ids)
        if first_bad is not None:  # vLLM recomputes from the first bad one
            ref.computed = min(ref.computed, table.index(first_bad) * BS)

    def check_jobs(self, meta):
        for job in meta.jobs:
            self.jobs_issued += 1
            self.jobs[job.job_id] = job
            ref = self.refs.get(job.req_id)
            held = {b.block_id for b in ref.blocks} if ref else set()
            if not set(job.block_ids) <= held:
                self.violations.append(
                    f"job {job.job_id} ({job.kind.value}) on blocks "
                    f"{job.block_ids} that {job.req_id} does not hold"
                )
            if job.kind is JobKind.LOAD and ref is not None:
                if ref.load is not None:
                    self.violations.append(f"{job.req_id}: second load")
                ref.load = job

    # -- invariants ---------------------------------------------------------

    @invariant()
    def no_violation(self):
        assert self.violations == []

    @invariant()
    def finished_requests_leave_no_tracker(self):
        for req_id, ref in self.refs.items():
            if ref.status is Status.GONE:
                assert req_id not in self.side.registry, req_id

    @invariant()
    def awaited_loads_stay_tracked(self):
        for req_id, ref in self.refs.items():
            if ref.status in (Status.LOADING, Status.HELD):
                assert req_id in self.side.registry, req_id

    def teardown(self):
        try:
            self.drain()
        finally:
            self.tally()
            self.retire_workers()

    def tally(self):
        """Count what the example exercised (the test checks coverage)."""
        kinds = collections.Counter(j.kind for j in self.jobs.values())
        COVERAGE["load jobs"] += kinds[JobKind.LOAD]
        COVERAGE["save jobs"] += kinds[JobKind.SAVE]
        COVERAGE["receive completions"] += sum(self.recv_delivered.values())
        COVERAGE["stale completions"] += sum(
            self.side.machine.stale_counts.values()
        )
        COVERAGE["illegal orderings"] += sum(
            self.side.machine.illegal_counts.values()
        )
        COVERAGE["dropped reports"] += self.side.unexpected_reports
        counts = self.side.lookup_counts
        # An answer that comes back after its request was preempted is
        # fenced by the request's epoch (a stale ``lookup_done``) or,
        # once the lookup was dropped at admission, by the lookup's own
        # epoch (a stale ``answer`` of the admission-lookup table).
        stale_answers = sum(self.side.lookup_machine.stale_counts.values())
        COVERAGE["lookups after a preemption"] += stale_answers + sum(
            n
            for (_, event), n in self.side.machine.stale_counts.items()
            if event is Event.LOOKUP_DONE
        )
        COVERAGE["lookups answered"] += counts["answered"]
        COVERAGE["lookups after their request ended"] += counts["ended"]
        COVERAGE["lookups refused (stale or illegal)"] += (
            counts["refused"] + stale_answers
        )
        COVERAGE["lookups expired"] += counts["timed_out"]
        COVERAGE["failed loads"] += sum(
            w.jobs_failed[JobKind.LOAD] for w in self.workers
        )
        COVERAGE["examples over two ranks"] += self.tp > 1
        COVERAGE["examples over head shards"] += self.sharded
        COVERAGE["head-sharded loads"] += kinds[JobKind.LOAD] * self.sharded
        spans = sum(spanned(w) for w in self.workers)
        COVERAGE["layer-wise loads read in spans"] += spans
        COVERAGE["head-sharded loads read in spans"] += spans * self.sharded

    def step(self):
        """A plain step: nothing preempted or admitted, transfers settled."""
        self.schedule(
            preempt=set(), odd_preempt="", chunk=BS, collect=[True] * MAX_TP,
            admit=0,
            local=0,
        )  # fmt: skip

    def drain(self):
        """Finish everything, settle every job, then nothing may be left."""
        for req_id in self.live(
            Status.WAITING, Status.RUNNING, Status.LOADING
        ):
            self.end(self.refs[req_id], RequestStatus.FINISHED_ABORTED)
        deadline = time.monotonic() + 2 * SETTLE_S
        while time.monotonic() < deadline:
            while self.outputs:
                self.update("", "")
            self.side.lookups.run_pending()
            if not (
                self.side.pending_lookups
                or self.side.lookups.completed
                or self.side.open_jobs
                or self.live(Status.HELD)
                or self.finished_since_step  # the worker learns of them
            ):
                break
            self.step()
        assert self.violations == []
        assert self.live(Status.HELD) == [], "waiting for KV forever"
        assert len(self.side.registry) == 0, list(self.side.registry)
        worker_left = [
            (rank, t.req_id, t.state)
            for rank, worker in enumerate(self.workers)
            for t in worker.registry
        ]
        assert worker_left == [], worker_left
        assert self.side.open_jobs == 0
        assert self.side.pending_lookups == 0
        assert self.side.lookups.completed == 0
        assert self.spy.pinned == 0
        assert self.spy.touched == self.spy.freed
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(n == 1 for n in self.send_delivered.values())


# -- plain records for vLLM's SchedulerOutput (only what the hooks read) ------


@attrs.define
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@attrs.define
class CachedReqs:
    req_ids: list[str] = attrs.field(factory=list)
    new_block_ids: list = attrs.field(factory=list)
    num_computed_tokens: list[int] = attrs.field(factory=list)
    resumed_req_ids: set[str] = attrs.field(factory=set)

    def add(self, req_id, new_block_ids, computed, *, resumed):
        self.req_ids.append(req_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(computed)
        if resumed:
            self.resumed_req_ids.add(req_id)


@attrs.define
class SchedOut:
    scheduled_new_reqs: list[NewReq]
    scheduled_cached_reqs: CachedReqs
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]


COVERAGE_NEEDED = (
    "load jobs",
    "save jobs",
    "receive completions",
    "stale completions",
    "illegal orderings",
    "dropped reports",
    "preemptions",
    "finished while loading",
    "pins outlived their request",
    "failed loads",
    "examples over two ranks",
    "examples over head shards",
    "head-sharded loads",
    "head-sharded loads read in spans",
    "lookups held back",
    "lookups answered",
    "lookups after their request ended",
    "lookups refused (stale or illegal)",
    "lookups after a preemption",
    "lookups expired",
    "layer-wise loads admitted",
    "layer-wise loads run",
    "layer-wise loads read in spans",
    "lookups sent on arrival",
    # "layer-wise blocks recomputed" (a lossy link under a layer-wise
    # load) is counted but not required: the CI budget reaches it only
    # by chance; tests/test_layerwise.py drives that path directly.
)


def spanned(worker):
    """Loads `worker` read in spans of layers, over every head shard."""
    transfer = worker.lanes[0].transfer
    parts = getattr(transfer, "parts", (transfer,))
    return sum(part.loads.spanned for part in parts)


def test_hook_orderings(env):
    """Any interleaving of hooks keeps vLLM's contracts; nothing leaks."""
    COVERAGE.clear()
    run_state_machine_as_test(lambda: OrderingFuzzer(env), settings=PROFILE)
    print(dict(COVERAGE))
    # The run must have reached the interesting orderings at all.
    assert all(COVERAGE[k] for k in COVERAGE_NEEDED), dict(COVERAGE)


def test_finish_between_alloc_and_meta_still_loads(env):
    """Finish after `update_state_after_alloc`, before the step's metadata.

    vLLM 0.33 does this when it defers an async load (HiSparse): the
    allocation hook runs in `update_from_output`, an abort can land before
    the next `schedule()`.  vLLM keeps the blocks until one receive
    completion, so the load must still be issued and reported.
    """
    fuzz = OrderingFuzzer(env)
    try:
        fuzz.add_request(family=0, length=64, reuse=1)
        fuzz.lookup(n=0, local=0)  # held back: the lookup is dispatched
        fuzz.step()  # at the end of the step
        fuzz.update("", "")
        fuzz.lookups_return(expire=False)
        fuzz.lookup(n=0, local=0)
        assert fuzz.refs["r0"].lookup == (0, 48)
        fuzz.allocate(n=0)
        ref = fuzz.refs["r0"]
        assert ref.status is Status.LOADING
        fuzz.end(ref, RequestStatus.FINISHED_ABORTED)
        assert ref.status is Status.HELD
        fuzz.step()
        fuzz.update("", "")
        assert fuzz.violations == []
        assert fuzz.recv_delivered == {"r0": 1}
        assert ref.status is Status.GONE
        assert "r0" not in fuzz.side.registry
    finally:
        fuzz.teardown()
